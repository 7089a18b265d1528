"""Error feedback that never hurts: on a small fixed problem (tests/python/ef_problem.py), with SGD
with momentum and with AdamW, every codec with error feedback ends no worse than without it in the
recommended recipe (gradzip.optim.compresses_direction: the gradient for torch's optimizer, or
gradzip.optim's CompressedSGD / FrozenVarianceAdamW after its warm-up), and the residual stays
bounded wherever it is kept.

At a high learning rate under SGD with momentum, the residual of the two-phase codecs grew to 30x
the gradient while the shard owner kept a second residual for its re-encode; with the worker's
residual only (and blocks that restart at tensor boundaries) it stays a few times the gradient."""
import pytest
import torch

import ef_problem as ep
from gradzip.optim import compresses_direction

CODECS = ["fp16", "bf16", "int8", "sign", "topk:0.01"]
RESIDUAL_BOUND = 15.0  # worker residual / averaged input, at any step


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the same bits on any machine; tiny tensors gain nothing from more
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("codec", CODECS)
def test_error_feedback_never_hurts_the_recommended_recipe(codec, optimizer):
    direction = compresses_direction(codec, optimizer)
    with_ef, ratio = ep.train(codec, optimizer, error_feedback=True, direction=direction)
    without, _ = ep.train(codec, optimizer, error_feedback=False, direction=direction)
    assert with_ef <= without + 1e-3, f"{codec}/{optimizer}: EF {with_ef:.4f} vs no EF {without:.4f}"
    assert ratio <= RESIDUAL_BOUND, f"{codec}/{optimizer}: residual reached {ratio:.1f}x"
    reference, _ = ep.train("fp32", optimizer, error_feedback=False, direction=False)
    assert with_ef <= 1.15 * reference, f"{codec}/{optimizer}: {with_ef:.4f} vs fp32 {reference:.4f}"


@pytest.mark.parametrize("direction", [False, True])
@pytest.mark.parametrize("codec", ["int8", "sign", "topk:0.01"])
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
