"""Error feedback that never hurts: on a small fixed problem (tests/python/ef_problem.py), with SGD
with momentum and with AdamW, every codec with error feedback ends no worse than without it in the
recommended recipe (gradzip.optim.compresses_direction: the gradient for torch's optimizer, or
gradzip.optim's CompressedSGD / FrozenVarianceAdamW after its warm-up) by more than the noise of
several seeds, and the residual stays bounded wherever it is kept.

At a high learning rate under SGD with momentum, the residual of the two-phase codecs grew to 30x
the gradient while the shard owner kept a second residual for its re-encode; with the worker's
residual only (and blocks that restart at tensor boundaries) it stays a few times the gradient."""
import functools

import pytest
import torch

import ef_problem as ep
from gradzip.optim import compresses_direction

CODECS = ["fp16", "bf16", "int8", "sign", "topk:0.01"]
RESIDUAL_BOUND = 15.0  # worker residual / averaged input, at any step
SEEDS = 4  # problem, initialisation and batches
NOISE_FLOOR = 1e-3  # of the loss: a difference below it is no result on this problem


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the same bits on any machine; tiny tensors gain nothing from more
    yield
    torch.set_num_threads(before)


@functools.lru_cache(maxsize=None)  # the fp32 reference is shared by every codec
def _final_losses(codec, optimizer, error_feedback, direction):
    """Final losses over SEEDS (and the largest residual ratio over them)."""
    runs = [ep.train(codec, optimizer, error_feedback=error_feedback, direction=direction, seed=s)
            for s in range(SEEDS)]
    return torch.tensor([loss for loss, _ in runs], dtype=torch.float64), max(r for _, r in runs)


@pytest.mark.training
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("codec", CODECS)
def test_error_feedback_never_hurts_the_recommended_recipe(codec, optimizer):
    """Paired over seeds: EF minus no EF, in the mean, within its own noise (twice its standard
    error) plus NOISE_FLOOR of the loss. A single seed is not enough: where a codec loses almost
    nothing (int8, the casts) EF's effect is smaller than what the instruction set of torch's CPU
    kernels changes (AVX2 and AVX-512 hosts end a few 1e-4 apart)."""
    direction = compresses_direction(codec, optimizer)
    with_ef, ratio = _final_losses(codec, optimizer, True, direction)
    without, _ = _final_losses(codec, optimizer, False, direction)
    diff = with_ef - without
    bound = 2 * float(diff.std()) / SEEDS ** 0.5 + NOISE_FLOOR * float(without.mean())
    assert float(diff.mean()) <= bound, (
        f"{codec}/{optimizer}: EF - no EF = {float(diff.mean()):+.5f} (per seed "
        f"{[round(float(d), 5) for d in diff]}) > {bound:.5f}")
    assert ratio <= RESIDUAL_BOUND, f"{codec}/{optimizer}: residual reached {ratio:.1f}x"
    reference, _ = _final_losses("fp32", optimizer, False, False)
    assert float(with_ef.mean()) <= 1.15 * float(reference.mean()), (
        f"{codec}/{optimizer}: {float(with_ef.mean()):.4f} vs fp32 {float(reference.mean()):.4f}")


@pytest.mark.parametrize("direction", [False, True])
@pytest.mark.parametrize("codec", ["int8", "sign", "topk:0.01"])
@pytest.mark.training
def test_residual_stays_bounded_at_a_high_learning_rate(codec, direction):
    _, ratio = ep.train(codec, "sgd", error_feedback=True, direction=direction, lr=0.2)
    assert ratio <= RESIDUAL_BOUND, f"{codec}: residual reached {ratio:.1f}x"


def test_uncompressed_compressed_sgd_is_sgd_with_momentum():
    a, _ = ep.train("fp32", "sgd", error_feedback=False, direction=False, steps=50)
    b, _ = ep.train("fp32", "sgd", error_feedback=False, direction=True, steps=50)
    assert abs(a - b) <= 1e-5 * a


def test_compressed_optimizer_without_its_state_refuses_to_step():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    with pytest.raises(RuntimeError, match="CompressionState"):
        ep.make_optimizer("adamw", [p], compressed=True).step()
    with pytest.raises(ValueError, match="optimizer"):
        compresses_direction("sign", "adam")
