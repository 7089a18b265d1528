"""FrozenVarianceAdamW under FSDP2 (gradzip.fsdp.compress(..., optimizer=opt)) on real Gloo
ranks, world sizes 2 and 3, on a model whose odd sizes FSDP pads: every step against a float64
reference of the algorithm written here (exact warm-up, then the fp32 codec, whose reduce-scatter
is an exact average: the reference computes it); one Adam state (the denominator's bits the same
on every rank and the owner's own, the parameters the same) after the freeze with sign and int8;
resume from state_dict before and after the freeze; a NaN gradient visible with the state restored;
the configurations it refuses; every call of the sign reduce-scatter (with and without the optimizer)
recomputed in float64 from the codec's definition."""

import math

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
            (fa.nonfinite, ("sign",)), (fa.refused, ()), (fa.reductions, (fa.REDUCTIONS, STEPS))]
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


def rounded(x, dtype):
    """float64 -> float32 (the implementation's arithmetic) -> ``dtype``, back to float64."""
    return x.to(torch.float32).to(dtype).double()


def reference(world, steps, denominator_dtype):
    """The parameters after each step, in float64: AdamW on the exact average through the
    warm-up; then v frozen, its denominator and m over it rounded to ``denominator_dtype``, each
    rank's candidate (1 - b1) g / denominator + b1 m / denominator clipped to Adam's largest step,
    averaged exactly: the new m over the denominator (kept rounded) and, unbiased, the update;
    decoupled weight decay."""
    params = [p.detach().double() for p in sc.plain_model().parameters()]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    denominator = m_over_den = None
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
                    m_over_den = [rounded(mi / d, dtype) for mi, d in zip(m, denominator)]
                d = denominator[i]
                moment = sum(((1 - B1) * gr[i] / d + B1 * m_over_den[i]).clamp(-bound, bound)
                             for gr in grads) / world
                m_over_den[i] = rounded(moment, dtype)
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


def _rows(size, world):
    """A dim-0 parameter's chunk in each of FSDP's W rows: (chunk elements, real elements)."""
    per_row = -(-size[0] // world)
    cols = math.prod(size[1:])
    return [(per_row * cols, max(0, min(per_row, size[0] - j * per_row)) * cols)
            for j in range(world)]


def _sign_reference(c, sizes, world, uncompressed):
    """The 1-bit codec's decode of ``c`` (what a rank encodes: float32, FSDP's layout of
    ``sizes``) in float64, by its definition: each parameter's chunk of each row is a piece, exact
    (fp32) when shorter than 64 elements or sent uncompressed; the others restart 1024-element
    blocks whose elements decode to +-(the block's mean |c|), negative where the sign bit is set.
    Returns the decoded values and the per-element block scale (0 on exact pieces)."""
    c64 = c.double()
    dec, scale = c64.clone(), torch.zeros_like(c64)
    start = 0
    for j in range(world):
        for size in sizes:
            chunk = _rows(size, world)[j][0]
            exact = chunk < 64 or (uncompressed > 0 and (len(size) <= 1 or
                                                        math.prod(size) < uncompressed))
            if not exact:
                for lo in range(start, start + chunk, 1024):
                    block = slice(lo, min(lo + 1024, start + chunk))
                    s = c64[block].abs().mean()
                    dec[block] = torch.where(torch.signbit(c[block]), -s, s)
                    scale[block] = s
            start += chunk
    return dec, scale


def _close(got, expected, tol, what):
    err = (got.double() - expected).abs() - tol
    assert (err <= 0).all(), f"{what}: off by {float(err.max()):.3g} beyond tolerance"


def _padding(sizes, world, shard):
    """The group's padding elements in FSDP's layout (W rows of ``shard``)."""
    padding = torch.ones(world * shard, dtype=torch.bool)
    start = 0
    for j in range(world):
        for size in sizes:
            chunk, real = _rows(size, world)[j]
            padding[start:start + real] = False
            start += chunk
    return padding


def _calls(session, config):
    """The recorded calls of ``config`` by (train step, group, rank), after the checks every
    configuration shares: one call per group and step, an AVG op, the warm-up FSDP's own."""
    world, outdir = session
    runs = [r[config] for r in load(outdir, "reductions", world)]
    groups = runs[0]["groups"]
    for rank, run in enumerate(runs):
        assert [(c["train_step"], c["step"]) for c in run["calls"]] == \
            [(s, s) for s in range(STEPS) for _ in range(groups)], rank
        assert all(sorted(c["index"] for c in run["calls"][s * groups:(s + 1) * groups]) ==
                   list(range(groups)) for s in range(STEPS)), rank
        assert all(c["op"].endswith("AVG") and c["divide"] is None and not c["async"]
                   for c in run["calls"])
    calls = {(c["train_step"], c["index"], rank): c for rank, run in enumerate(runs)
             for c in run["calls"]}
    for (step, index, rank), call in calls.items():  # the warm-up: FSDP's own, exact
        if step < fa.WARMUP:
            assert torch.equal(call["sent"], call["input"]), (config, step, index, rank)
            assert not call["residual_after"].any(), (config, step, index, rank)
    return world, runs, groups, calls


def _lands_in_the_gradients(runs, calls, groups, world, with_opt):
    """Each output is the rank's sharded gradients, padding left out (group i: the i-th Linear's
    weight and bias), and with the optimizer p -= lr * (update + wd * p)."""
    for (step, index, j), call in calls.items():
        if step < fa.WARMUP:
            continue
        at = 0
        for k, size in zip([2 * index, 2 * index + 1], call["sizes"]):
            chunk, real = _rows(size, world)[j]
            got = runs[j]["steps"][step]["grads"][k].reshape(-1)
            assert torch.equal(got, call["output"][at:at + real]), (step, k)
            at += chunk
    if with_opt:
        for run in runs:
            for s in run["steps"]:
                for p, g, q in zip(s["before"], s["grads"], s["after"]):
                    e = p.double() * (1 - fa.LR * fa.WD) - fa.LR * g.double()
                    _close(q, e, 1e-6 * (p.double().abs() + fa.LR * g.double().abs()), "step")


@pytest.mark.parametrize("config", [c for c in fa.REDUCTIONS if not c[1]])
def test_compressed_reduce_scatter_matches_the_codec_definition(session, config):
    """Every call of the sign reduce-scatter, recomputed in float64 from what each rank had before
    it: its codec input ``g / W + residual`` (padding's residual zeroed), the residual after, each
    output shard (the sum over ranks of the decoded shard); the residual carried bit for bit from
    one step to the next, the output landing in the sharded gradients. Tolerance: 1e-6 of the
    magnitudes summed (float32 arithmetic and the codec's fixed mean-|c| tree)."""
    world, runs, groups, calls = _calls(session, config)
    _, _, uncompressed = config
    compared = 0
    for step in range(fa.WARMUP, STEPS):
        for index in range(groups):
            mine = [calls[(step, index, r)] for r in range(world)]
            sizes = mine[0]["sizes"]
            shard = sum(_rows(size, world)[0][0] for size in sizes)
            padding = _padding(sizes, world, shard)
            decoded, magnitude = [], torch.zeros(world * shard, dtype=torch.float64)
            for r, call in enumerate(mine):
                assert torch.equal(call["sent"], call["input"])
                before = call["residual"].clone()
                if step == fa.WARMUP:
                    assert not before.any(), "the residual starts at zero when compressing"
                else:
                    assert torch.equal(before, calls[(step - 1, index, r)]["residual_after"])
                before[padding] = 0.0
                # the codec's input in float32, as the definition forms it (then exactly signed)
                c = call["sent"] * torch.tensor(1.0 / world, dtype=torch.float32) + before
                dec, scale = _sign_reference(c, sizes, world, uncompressed)
                _close(call["residual_after"], c.double() - dec,
                       1e-6 * (c.double().abs() + scale), f"{config} residual {step} {index} {r}")
                decoded.append(dec)
                magnitude += dec.abs()
            total = sum(decoded)
            for j, call in enumerate(mine):
                own = slice(j * shard, (j + 1) * shard)
                _close(call["output"], total[own], 1e-6 * magnitude[own],
                       f"{config} output {step} {index} rank {j}")
                compared += 1
    assert compared == (STEPS - fa.WARMUP) * groups * world
    _lands_in_the_gradients(runs, calls, groups, world, with_opt=False)


@pytest.mark.parametrize("config", [c for c in fa.REDUCTIONS if c[1]])
def test_a_compressed_adam_step_is_the_ddp_hooks_on_the_group(session, config):
    """With FrozenVarianceAdamW, every compressed step in float64 from what each rank had before
    it: the average every rank decodes (left in place of what it sent; the update is it over the
    bias correction) is what the two-phase all-reduce's error feedback says was sent of each
    rank's candidate ((1 - b1) g / denominator + b1 m_over_den, clipped to Adam's largest step):
    the sum over ranks of candidate / W + residual before - residual after, plus the owner's
    residual before - after (so nothing is lost at either level); m_over_den becomes that average on every rank (the same
    bits), m its owner's shard times the denominator; the residuals carried bit for bit from one
    step to the next; the update lands in the sharded gradients and the parameters. The codec
    itself (each phase's sign encoding of the pieces) is test_reduce_reference.py's."""
    world, runs, groups, calls = _calls(session, config)
    bound = (1 - B1) / (1 - B2) ** 0.5
    for step in range(fa.WARMUP, STEPS):
        correction = 1 - B1 ** (step + 1)
        for index in range(groups):
            mine = [calls[(step, index, r)] for r in range(world)]
            sizes = mine[0]["sizes"]
            shard = sum(_rows(size, world)[0][0] for size in sizes)
            padding = _padding(sizes, world, shard)
            den = mine[0]["denominator"].double()
            if step == fa.WARMUP:  # at the freeze: every owner's m over the denominator, gathered
                m_over_den = rounded(torch.cat([c["m"] for c in mine]).double() / den,
                                     mine[0]["denominator"].dtype)
                assert all(c["m_over_den"] is None for c in mine)
            else:
                m_over_den = mine[0]["m_over_den"].double()
            sent_total = torch.zeros(world * shard, dtype=torch.float64)
            tol = torch.zeros(world * shard, dtype=torch.float64)
            for r, call in enumerate(mine):
                assert torch.equal(call["denominator"], mine[0]["denominator"])
                prev = None if step == fa.WARMUP else calls[(step - 1, index, r)]
                for key in ("residual", "owner"):
                    if prev is None:
                        assert not call[key].any(), "the residuals start at zero when compressing"
                    else:
                        assert torch.equal(call[key], prev[key + "_after"]), (key, step, r)
                if prev is not None:
                    assert torch.equal(call["m_over_den"], prev["m_over_den_after"])
                candidate = ((1 - B1) * call["input"].double() / den +
                             B1 * m_over_den).clamp(-bound, bound)
                before = call["residual"].double()
                before[padding] = 0.0
                sent_total += candidate / world + before - call["residual_after"].double()
                tol += candidate.abs() / world + before.abs()
            owner = torch.cat([c["owner"] for c in mine]).double()
            owner_after = torch.cat([c["owner_after"] for c in mine]).double()
            # the all-reduce leaves the average in place of the candidates, the same on every rank
            avg = mine[0]["sent"].double()
            assert all(torch.equal(c["sent"], mine[0]["sent"]) for c in mine)
            _close(torch.cat([c["output"] for c in mine]), avg / correction,
                   1e-6 * avg.abs() / correction, f"{config} update {step} {index}")
            expected = sent_total + owner - owner_after
            expected[padding] = 0.0
            _close(avg, expected, 1e-5 * (tol + owner.abs() + avg.abs()) + 1e-7,
                   f"{config} average {step} {index}")
            assert avg.abs().max() > 0, (config, step, index)
            for j, call in enumerate(mine):
                after = call["m_over_den_after"]
                assert torch.equal(after, mine[0]["m_over_den_after"]), (step, index, j)
                _close(after, avg, 2.0 ** -8 * avg.abs() + 1e-7, f"{config} m_over_den {step}")
                own = slice(j * shard, (j + 1) * shard)
                _close(call["m_after"], avg[own] * den[own], 1e-6 * (avg[own] * den[own]).abs()
                       + 1e-9, f"{config} m {step} {index} {j}")
    _lands_in_the_gradients(runs, calls, groups, world, with_opt=True)
