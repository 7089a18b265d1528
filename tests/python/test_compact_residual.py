"""The compact residual (residual_dtype=torch.bfloat16) around the reduction: a checkpoint resumes
exactly, a float32 checkpoint loads into it (rounded to bfloat16) and back, bad settings are
refused. Its arithmetic (every update rounded to bfloat16, bit for bit against a float64 mirror) is
test_reduce_reference.py's and test_topk_two_phase.py's; the multi-rank hook and its overflow
guard are test_ddp.py's; its bytes per parameter test_state_memory.py's."""

import copy

import pytest
import torch

from gradzip.simulation import SimulatedWorkers

WORLD, NUMELS = 3, [1001, 37, 2050]


def grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(sum(NUMELS), generator=g) for _ in range(WORLD)]


def run(sim, steps):
    return [sim.reduce(grads(s), numels=NUMELS) for s in steps]


@pytest.mark.parametrize("codec,kwargs", [("int8", {}), ("sign", {}),
                                          ("topk:0.05", {"cast_sum": "fp32"})])
def test_a_checkpoint_resumes_exactly(codec, kwargs):
    def make():
        return SimulatedWorkers(codec, WORLD, min_compress_numel=0,
                                residual_dtype=torch.bfloat16, **kwargs)

    sim = make()
    run(sim, range(3))
    saved = copy.deepcopy(sim.state_dict())
    assert all(t.dtype == torch.bfloat16 for w in saved["workers"] for b in w.values()
               for k, t in b.items() if k in ("residual", "owner_residual") and t is not None)
    want = run(sim, range(3, 6))
    resumed = make()
    resumed.load_state_dict(saved)
    got = run(resumed, range(3, 6))
    for a, b in zip(want, got):
        assert torch.equal(a, b)


def residuals(sim):
    return [b["residual"] for w in sim.state_dict()["workers"] for b in w.values()]


def test_a_float32_checkpoint_loads_rounded_and_back():
    fp32 = SimulatedWorkers("int8", WORLD, min_compress_numel=0)
    run(fp32, range(2))
    saved = fp32.state_dict()
    compact = SimulatedWorkers("int8", WORLD, min_compress_numel=0, residual_dtype=torch.bfloat16)
    compact.load_state_dict(copy.deepcopy(saved))
    # the reference: the float32 checkpoint with its residuals rounded to bfloat16 beforehand, on
    # the float32 path, whose residual after the step is then rounded as the compact one is
    rounded = copy.deepcopy(saved)
    for w in rounded["workers"]:
        for b in w.values():
            b["residual"] = b["residual"].to(torch.bfloat16).float()
    ref = SimulatedWorkers("int8", WORLD, min_compress_numel=0)
    ref.load_state_dict(rounded)
    assert torch.equal(run(compact, [2])[0], run(ref, [2])[0])
    for got, want in zip(residuals(compact), residuals(ref)):
        assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16))
    # and back: a float32 state loads the compact checkpoint (exactly: bfloat16 widens exactly)
    back = SimulatedWorkers("int8", WORLD, min_compress_numel=0)
    back.load_state_dict(copy.deepcopy(compact.state_dict()))
    want = run(compact, [3])[0]
    assert torch.equal(run(back, [3])[0], want)
    assert all(t.dtype == torch.float32 for t in residuals(back))


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="residual_dtype"):
        SimulatedWorkers("int8", WORLD, residual_dtype=torch.float16)
    with pytest.raises(ValueError, match="lowrank"):
        SimulatedWorkers("lowrank:2", WORLD, residual_dtype=torch.bfloat16)


def test_the_reduction_refuses_another_residual_dtype():
    import gradzip  # noqa: F401  (loads the extension's classes)

    red = torch.classes.gradzip.BucketReduction("int8", 2, 0, [300], torch.zeros(1))
    x = torch.randn(300)
    red.encode(x, torch.zeros(300, dtype=torch.bfloat16))  # the compact residual is taken
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        red.encode(x, torch.zeros(300, dtype=torch.float16))
