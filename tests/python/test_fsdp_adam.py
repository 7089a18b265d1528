"""FrozenVarianceAdamW under FSDP2 (gradzip.fsdp.compress(..., optimizer=opt)) on real Gloo
ranks, world sizes 2 and 3, on a model whose odd sizes FSDP pads: every step against a float64
reference of the algorithm written here (exact warm-up, then the fp32 codec, whose reduce-scatter
is an exact average: the reference computes it); one Adam state (the denominator's bits the same
on every rank and the owner's own, the parameters the same) after the freeze with sign and int8;
resume from state_dict before and after the freeze; a NaN gradient visible with the state restored;
the configurations it refuses."""

import pytest
import torch

import fsdp_adam_scenarios as fa
import fsdp_scenarios as sc
from dist_util import run_ranks
from fsdp_scenarios import load
from gradzip.fsdp import FSDPCompressionState
from gradzip.optim import FrozenVarianceAdamW

B1, B2, EPS = 0.9, 0.999, 1e-8  # FrozenVarianceAdamW's defaults, which the scenarios use
STEPS = 6
REFERENCE = [("fp32", "fp32"), ("fp32", "bf16")]
ONE_STATE = [("sign", "bf16"), ("int8", "bf16"), ("sign", "fp32")]
RESUME = ["sign", "int8"]


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def session(request, tmp_path_factory):
    """One set of W spawned Gloo ranks runs every scenario; the tests check what they recorded."""
    world = request.param
    outdir = tmp_path_factory.mktemp(f"fsdp_adam{world}")
    plan = [(fa.trajectory, (REFERENCE + ONE_STATE, STEPS)), (fa.resume, (RESUME, STEPS)),
            (fa.nonfinite, ("sign",)), (fa.refused, ())]
    run_ranks(sc.session, world, str(outdir), plan, timeout=300)
    return world, outdir


def rank_gradients(params, step, world):
    """Each rank's float64 gradient at ``step`` (fsdp_scenarios' batches and loss)."""
    out = []
    for rank in range(world):
        ps = [p.detach().clone().requires_grad_() for p in params]
        x, y = sc.batch(step, rank)
        h = torch.tanh(x.double() @ ps[0].T + ps[1])
        h = torch.tanh(h @ ps[2].T + ps[3])
        loss = (h @ ps[4].T + ps[5] - y.double()).pow(2).mean()
        out.append(torch.autograd.grad(loss, ps))
    return out


def reference(world, steps, denominator_dtype):
    """The parameters after each step, in float64: AdamW on the exact average through the
    warm-up; then v frozen, its denominator rounded to ``denominator_dtype``, each rank's
    (1 - b1) g / denominator clipped to Adam's largest step and averaged exactly, added to
    b1 m / denominator and clipped again; decoupled weight decay."""
    params = [p.detach().double() for p in sc.plain_model().parameters()]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    denominator = None
    bound = (1 - B1) / (1 - B2) ** 0.5
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[denominator_dtype]
    trajectory = [params]
    for step in range(steps):
        t = step + 1
        grads = rank_gradients(params, step, world)
        updates = []
        for i in range(len(params)):
            if step < fa.WARMUP:
                g = sum(gr[i] for gr in grads) / world
                m[i] = B1 * m[i] + (1 - B1) * g
                v[i] = B2 * v[i] + (1 - B2) * g * g
                denom = (v[i] / (1 - B2 ** t)).sqrt() + EPS
                updates.append(m[i] / (1 - B1 ** t) / denom)
            else:
                if denominator is None:
                    denominator = [((vi / (1 - B2 ** fa.WARMUP)).sqrt() + EPS).to(dtype).double()
                                   for vi in v]
                d = denominator[i]
                avg = sum(((1 - B1) * gr[i] / d).clamp(-bound, bound) for gr in grads) / world
                moment = (B1 * m[i] / d + avg).clamp(-bound, bound)
                m[i] = moment * d
                updates.append(moment / (1 - B1 ** t))
        params = [p * (1 - fa.LR * fa.WD) - fa.LR * u for p, u in zip(params, updates)]
        trajectory.append(params)
    return trajectory


def test_steps_match_the_float64_reference(session):
    world, outdir = session
    run = load(outdir, "trajectory", world)[0]
    for codec, dtype in REFERENCE:
        # the reference's bf16 denominator rounds the float64 value: a tie rounded otherwise
        # would move one element of thousands
        bound = 1e-4
        expected = reference(world, STEPS, dtype)
        got = run[(codec, dtype)]["params"]
        for step in range(1, STEPS + 1):
            for i, (g, e) in enumerate(zip(got[step], expected[step])):
                moved, ref_moved = g.double() - got[0][i].double(), e - expected[0][i]
                err = ((moved - ref_moved).norm() / ref_moved.norm()).item()
                assert err < bound, f"{codec} {dtype} step {step} tensor {i}: {err:.3g}"
        for d in run[(codec, dtype)]["adam"].values():
            assert d["exact_updates"] == fa.WARMUP and d["updates"] == STEPS
            assert d["denominator"].dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]


def test_one_adam_state_after_the_freeze(session):
    """The whole denominator: the same bits on every rank, and each owner's shard of it what its
    own v gives; the parameters the same on every rank, and moved by the codec (else the test
    would pass without compression)."""
    world, outdir = session
    runs = load(outdir, "trajectory", world)
    for key in ONE_STATE:
        base = runs[0][key]
        for rank, run in enumerate(runs):
            for i, d in run[key]["adam"].items():
                assert torch.equal(d["denominator"], base["adam"][i]["denominator"]), (key, rank, i)
                shard = d["m"].numel()
                own = torch.div(d["v"], 1 - B2 ** d["exact_updates"]).sqrt_().add_(EPS)
                mine = d["denominator"][rank * shard:(rank + 1) * shard]
                assert torch.equal(mine, own.to(mine.dtype)), (key, rank, i)
                assert torch.isfinite(d["m"]).all() and d["m"].norm() > 0, (key, rank, i)
            for a, b in zip(run[key]["params"][-1], base["params"][-1]):
                assert torch.equal(a, b), f"{key}: rank {rank}'s parameters differ from rank 0's"
        exact = runs[0][("fp32", key[1])]["params"][-1][0]
        assert not torch.equal(base["params"][-1][0], exact), key


def test_padding_of_the_moments_stays_zero(session):
    """FSDP pads dim 0 of the 65- and 7-row parameters on the last rank; sign decodes a padded
    zero to a non-zero value, which must not reach m. Every real element had a gradient in the
    warm-up, so v is zero exactly on the padding, and m must be zero there too."""
    world, outdir = session
    runs = load(outdir, "trajectory", world)
    for key in ONE_STATE:
        padded = 0
        for run in runs:
            for d in run[key]["adam"].values():
                pad = d["v"] == 0
                padded += int(pad.sum())
                assert not d["m"][pad].any(), key
        assert padded > 0, key  # the last rank's shards hold padding


def test_resume_from_state_dict_equals_uninterrupted_run(session):
    world, outdir = session
    for rank, run in enumerate(load(outdir, "resume", world)):
        for (codec, at), res in run.items():
            for a, b in zip(res["uninterrupted"], res["resumed"]):
                assert torch.equal(a, b), f"{codec}: rank {rank} diverged after resuming at {at}"


def test_nonfinite_gradient_stays_visible_and_the_state_is_restored(session):
    world, outdir = session
    for rank, run in enumerate(load(outdir, "nonfinite", world)):
        log = run["log"]
        assert [s["finite"] for s in log] == [True, False, True, True, False, True], (rank, log)
        # a skipped step leaves m, v and the residual as they were; a finite one updates them
        assert [s["kept"] for s in log[1:]] == [True, False, False, True, False], (rank, log)
        assert all(torch.isfinite(p).all() for p in run["params"])


@pytest.mark.parametrize("case, error", [
    ("torch_adamw", "TypeError: gradzip.fsdp: optimizer must be a gradzip.optim.FrozenVarianceAdamW"),
    ("compressed_sgd", "TypeError: gradzip.fsdp: optimizer must be a gradzip.optim.FrozenVarianceAdamW"),
    ("refresh", "ValueError: gradzip.fsdp: FrozenVarianceAdamW's refresh_until"),
    ("lowrank", "ValueError: gradzip.fsdp: optimizer=... needs a codec that encodes each shard"),
    ("other_params", "ValueError: gradzip.fsdp: the optimizer must hold exactly"),
    ("fp16_reduce", "ValueError: gradzip.fsdp: with optimizer=..., the reduce-scatter writes"),
])
def test_refused_configurations(session, case, error):
    world, outdir = session
    for run in load(outdir, "refused", world):
        assert run[case].startswith(error), run[case]


def test_bad_settings_raise_before_any_collective():
    opt = FrozenVarianceAdamW([torch.nn.Parameter(torch.zeros(3))])
    with pytest.raises(ValueError, match="warmup_steps must be >= 1"):
        FSDPCompressionState("sign", optimizer=opt)
    with pytest.raises(ValueError, match="denominator_dtype"):
        FSDPCompressionState("sign", warmup_steps=1, optimizer=opt, denominator_dtype="fp16")
