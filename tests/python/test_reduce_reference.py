"""The whole compressed average of every codec against a float64 reference written here.

``SimulatedWorkers`` runs the same C++ phases as the multi-rank DDP hook, bit for bit (pinned by
test_ddp.py), so what it returns is what every rank's bucket holds. This file re-derives that
result from the algorithm's description alone, in plain torch float64 (no gradzip encoder,
decoder or layout helper is called). fp16/bf16 run here with ``cast_sum="fp32"`` (their
two-phase fp32 sum; the default one all-reduce in the wire dtype is test_cast_allreduce.py's):

  * each rank forms c = g * p + e in fp32 (p = fl32(1/W), e its residual);
  * two-phase codecs (fp32, fp16, bf16, int8, sign): the bucket is cut into W shards (the first
    n % W get n // W + 1 elements); int8/sign cut each shard further at the bucket's tensor
    boundaries and restart their blocks at each piece; a tensor's part of fewer than 64 elements,
    and with ``uncompressed_numel`` the tensors it names, are encoded as fp32 (consecutive ones in
    one piece); the owner of a shard sums the W decoded contributions in rank order and re-encodes the
    sum (prescale 1, no residual); everyone decodes every re-encoded shard;
  * top-k: each rank keeps the k = min(n, max(1, ceil(ratio * n))) largest |c| (ties to the lowest
    index), every rank adds the W decoded payloads in rank order into zeros;
  * the worker residual after the step is c - decode(encode(c)).

Element math: fp16/bf16 round to nearest even (torch's float32 casts); int8: per block
scale = absmax / 127, q = round-half-even(c / scale) clamped to +-127; sign: per block
scale = mean |c|, decoded = +-scale by c's sign bit; top-k values kept as fp32 or fp16.

Two references are built from that description:

  * ``ideal``: float64 arithmetic after c (sums, scales and quotients exact to float64); each codec
    is checked against it within the error bound derived from its rounding steps (test_first_step,
    test_second_step_carries_the_residual), and the result is checked against the TRUE mean within
    the codec's stated bound (test_error_against_the_true_mean);
  * ``fp32``: the same description, with each step the algorithm performs in fp32 rounded to fp32
    (float64 arithmetic rounded once to float32 is the correctly rounded float32 result for + - * /,
    since 53 >= 2 * 24 + 2), and sign's block mean taken with the documented 32-lane tree. It must
    equal gradzip's output and residuals bit for bit (test_bitwise_against_fp32_mirror): errors far
    below the codecs' bounds, such as a different summation order, show up there.

test_ties runs both on integer-valued gradients, where |c| ties at top-k's threshold and int8's
quotients fall exactly half-way, so the tie rules (lowest index, round half to even) are exercised.
"""

import math

import pytest
import torch

from gradzip.simulation import SimulatedWorkers
from gradzip.wire import MIN_PIECE  # tied to the extension's by test_wire.py

F64 = torch.float64
U32 = 2.0 ** -24  # unit roundoff of fp32

NUMELS = {"a": [1000, 37, 4099], "b": [3, 700, 64, 1500, 65, 611]}
SCALES = {"a": [1.0, 1e-3, 3.0], "b": [2.0, 1.0, 1e-2, 0.5, 50.0, 1e-4]}


# ---- the reference ----------------------------------------------------------------------------
def parse(spec):
    parts = spec.split(":")
    kind = parts[0]
    opts = dict(p.split("=") for p in parts[1:] if "=" in p)
    out = {"kind": kind}
    if kind == "int8":
        out["block"] = int(opts.get("block", 256))
    elif kind == "sign":
        out["block"] = int(opts.get("block", 1024))
    elif kind == "topk":
        out["ratio"] = float(parts[1])
        out["values"] = opts.get("values", "fp32")
    return out


def f32(x):
    """Rounds float64 values to float32 (kept as float64)."""
    return x.to(torch.float32).to(F64)


def shard_starts(n, world):
    base, extra = divmod(n, world)
    starts = [0]
    for j in range(world):
        starts.append(starts[-1] + base + (1 if j < extra else 0))
    return starts


def pieces(lo, hi, numels, exact=None, short_exact=True):
    """(a, b, exact) messages of shard [lo, hi): one per tensor part in it, a part shorter than 64
    elements exact (with ``short_exact``), consecutive exact parts in one message."""
    exact = exact or [False] * len(numels)
    out, start = [], 0
    for m, ex in zip(numels, exact):
        a, b = max(lo, start), min(hi, start + m)
        start += m
        if b <= a:
            continue
        ex = ex or (short_exact and b - a < MIN_PIECE)
        if ex and out and out[-1][2]:
            out[-1] = (out[-1][0], b, True)
        else:
            out.append((a, b, ex))
    return out


def blocks_of(x, block):
    """x (m,) padded with zeros to (nb, block); also the real length of each block."""
    m = x.numel()
    nb = -(-m // block)
    padded = torch.zeros(nb * block, dtype=F64)
    padded[:m] = x
    lens = torch.full((nb,), float(block), dtype=F64)
    lens[-1] = m - (nb - 1) * block
    return padded.view(nb, block), lens


def sign_scales(x, block, mirror):
    xb, lens = blocks_of(x.abs(), block)
    if not mirror:
        return xb.sum(1) / lens
    # 32 lanes; lane j sums elements j, j+32, ... in order; then the halving tree; / count
    rows = xb.view(xb.shape[0], block // 32, 32)
    lanes = torch.zeros(xb.shape[0], 32, dtype=F64)
    for i in range(rows.shape[1]):
        lanes = f32(lanes + rows[:, i, :])
    s = 16
    while s >= 1:
        lanes[:, :s] = f32(lanes[:, :s] + lanes[:, s:2 * s])
        s //= 2
    return f32(lanes[:, 0] / lens)


def encode_decode(codec, x, mirror):
    """decode(encode(x)) of one message, and the per-element block scale (int8, sign)."""
    kind = codec["kind"]
    m = x.numel()
    if kind == "fp32":
        return x.clone(), None
    if kind == "fp16":
        return x.to(torch.float32).to(torch.float16).to(F64), None
    if kind == "bf16":
        return x.to(torch.float32).to(torch.bfloat16).to(F64), None
    block = codec["block"]
    if kind == "int8":
        xb, _ = blocks_of(x, block)
        absmax = xb.abs().amax(1, keepdim=True)
        tiny = absmax < 2.0 ** -100
        safe = torch.where(tiny, torch.ones_like(absmax), absmax)
        if mirror:
            scale = torch.where(tiny, 0.0, f32(safe / 127))
            inv = torch.where(tiny, 0.0, f32(127 / safe))
            q = torch.round(f32(xb * inv)).clamp(-127, 127)
            dec = f32(q * scale)
        else:
            scale = torch.where(tiny, 0.0, safe / 127)
            q = torch.round(torch.where(tiny, 0.0, xb / safe * 127)).clamp(-127, 127)
            dec = q * scale
        return dec.reshape(-1)[:m], scale.expand_as(xb).reshape(-1)[:m]
    if kind == "sign":
        scale = sign_scales(x, block, mirror).repeat_interleave(block)[:m]
        return torch.where(torch.signbit(x), -scale, scale), scale
    raise AssertionError(kind)


def reference(spec, grads, residuals, numels, mirror=False, exact=None):
    """The compressed average of ``grads`` (float32, one per rank) with ``residuals`` (float32);
    ``exact``: per tensor, whether it travels as fp32 (int8/sign only)."""
    codec = parse(spec)
    fp32 = parse("fp32")
    world = len(grads)
    n = grads[0].numel()
    rnd = f32 if mirror else (lambda t: t)
    p = float(torch.tensor(1.0 / world, dtype=torch.float32))
    # c = g * p + e in fp32, on every path (it is the encoders' input)
    cs = [f32(f32(g.to(F64) * p) + e.to(F64)) for g, e in zip(grads, residuals)]
    dec = [torch.zeros(n, dtype=F64) for _ in range(world)]
    scale = [torch.zeros(n, dtype=F64) for _ in range(world)]
    out = torch.zeros(n, dtype=F64)
    oscale = torch.zeros(n, dtype=F64)
    sent_exact = torch.zeros(n, dtype=torch.bool)  # the parts that travel as fp32
    selected = None
    if codec["kind"] == "topk":
        k = min(n, max(1, math.ceil(codec["ratio"] * n)))
        selected = []
        for r, c in enumerate(cs):
            order = torch.sort(c.abs(), descending=True, stable=True).indices  # ties: lowest index
            keep = torch.zeros(n, dtype=torch.bool)
            keep[order[:k]] = True
            vals = c
            if codec["values"] == "fp16":
                vals = c.to(torch.float32).to(torch.float16).to(F64)
            if codec["values"] == "int8":  # int8 of the kept values, a scale per 65536 elements
                vals, scale[r] = encode_decode({"kind": "int8", "block": 65536},
                                               torch.where(keep, c, 0.0), mirror)
            dec[r] = torch.where(keep, vals, 0.0)
            selected.append(keep)
            out = rnd(out + dec[r])
        total = out
    else:
        starts = shard_starts(n, world)
        piecewise = codec["kind"] in ("int8", "sign")
        split = numels if piecewise else [n]
        ranges = [pieces(starts[j], starts[j + 1], split, exact if piecewise else None, piecewise)
                  for j in range(world)]
        for rs in ranges:
            for a, b, ex in rs:
                sent_exact[a:b] = ex
        for r, c in enumerate(cs):
            for rs in ranges:
                for a, b, ex in rs:
                    d, s = encode_decode(fp32 if ex else codec, c[a:b], mirror)
                    dec[r][a:b] = d
                    if s is not None:
                        scale[r][a:b] = s
        total = torch.zeros(n, dtype=F64)
        for d in dec:  # the owner's sum, rank order, from zero
            total = rnd(total + d)
        for rs in ranges:
            for a, b, ex in rs:
                d, s = encode_decode(fp32 if ex else codec, total[a:b], mirror)
                out[a:b] = d
                if s is not None:
                    oscale[a:b] = s
    res = [rnd(c - d) for c, d in zip(cs, dec)]
    return {"c": cs, "dec": dec, "scale": scale, "sum": total, "out": out, "oscale": oscale,
            "res": res, "selected": selected, "sum_abs": sum(d.abs() for d in dec),
            "codec": codec, "exact": sent_exact}


# ---- driving gradzip --------------------------------------------------------------------------
def make_grads(world, layout, seed, ties=False):
    """Gaussian tensors of different scales; ``ties``: a few integer levels instead (equal |c|
    everywhere: top-k's tie rule, int8's round-half-even)."""
    g = torch.Generator().manual_seed(seed)
    numels, scales = NUMELS[layout], SCALES[layout]
    draw = (lambda m: torch.randint(-4, 5, (m,), generator=g).float()) if ties else \
        (lambda m: torch.randn(m, generator=g))
    return [torch.cat([draw(m) * s for m, s in zip(numels, scales)]) for _ in range(world)]


def gz_residuals(sim, n):
    """Each worker's residual of bucket 0 (n elements, float64 from its float32 or bfloat16);
    zeros where it keeps none (fp32, lossless, keeps no residual)."""
    return [w[0]["residual"].to(F64) if w else torch.zeros(n, dtype=F64)
            for w in sim.state_dict()["workers"]]


def run_gradzip(spec, world, steps, residual_dtype=torch.float32):
    """steps: list of (grads, numels); returns [(output, residuals after the step)]."""
    # the casts' two-phase fp32 sum; top-k's all-gather (its two-phase form: test_topk_two_phase.py)
    cast_sum = "wire" if spec.startswith("topk") else "fp32"
    sim = SimulatedWorkers(spec, world, min_compress_numel=0, cast_sum=cast_sum,
                           residual_dtype=residual_dtype)
    out = []
    for grads, numels in steps:
        o = sim.reduce(grads, numels=numels).to(F64)
        out.append((o, gz_residuals(sim, o.numel())))
    return out


# ---- the bounds -------------------------------------------------------------------------------
UNIT = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}
TINY = {"fp16": 2.0 ** -25, "bf16": 2.0 ** -134}  # half the smallest subnormal step


def check_against_ideal(spec, out, res, ref, world, true_mean=None, mag=None):
    """Asserts gradzip's ``out`` / worker ``res`` against the ideal reference ``ref``."""
    kind = ref["codec"]["kind"]
    n = out.numel()
    c, S, sum_abs = ref["c"], ref["sum"], ref["sum_abs"]
    # the owner's fp32 sum of W terms differs from the float64 one by at most (W - 1) u sum |d|
    acc = world * U32 * sum_abs
    if kind == "fp32":
        assert all(torch.equal(e, torch.zeros(n, dtype=F64)) for e in res)
        assert ((out - true_mean).abs() <= 1e-6 * mag).all()
        assert ((out - S).abs() <= acc).all()
        return
    if kind in ("fp16", "bf16"):
        for r in range(world):  # c - round(c) is exact in fp32: equality
            assert torch.equal(res[r], ref["res"][r]), f"{spec}: residual of rank {r}"
        cast = torch.float16 if kind == "fp16" else torch.bfloat16
        assert torch.equal(out.to(cast).to(F64), out), f"{spec}: output not re-encoded"
        u = UNIT[kind]
        bound = u * (S.abs() + acc) + TINY[kind] + acc
        err = (out - S).abs()
        assert (err <= bound * (1 + 1e-9)).all(), f"{spec}: output err {(err / bound).max():.3g} bound"
        return
    if kind in ("int8", "sign"):  # the parts sent as fp32: the fp32 sum, no residual
        ex, keep = ref["exact"], ~ref["exact"]
        assert all(bool((e[ex] == 0).all()) for e in res), f"{spec}: residual of an exact part"
        assert ((out - S).abs()[ex] <= acc[ex]).all(), f"{spec}: exact part"
        c, res, out, S, acc = [x[keep] for x in c], [x[keep] for x in res], out[keep], S[keep], acc[keep]
        ref = {**ref, "scale": [x[keep] for x in ref["scale"]], "oscale": ref["oscale"][keep],
               "res": [x[keep] for x in ref["res"]]}
    if kind == "int8":
        for r in range(world):
            step = ref["scale"][r]
            assert (res[r].abs() <= step * (0.5 + 1e-5)).all(), f"{spec}: rank {r} beyond half a step"
            # equal to the reference up to the fp32 scale (|q| <= 127 times u), the product's and
            # the residual's roundings, except where c / step sits on a rounding tie (float64 vs
            # fp32 quotient): there one step apart at most
            y = torch.where(step > 0, c[r] / torch.where(step > 0, step, 1.0), 0.0)
            tie = ((y - y.floor()) - 0.5).abs() < 1e-4
            diff = (res[r] - ref["res"][r]).abs()
            near = 256 * U32 * step + U32 * res[r].abs()
            assert (diff[~tie] <= near[~tie]).all(), f"{spec}: rank {r} residual"
            assert (diff[tie] <= step[tie] * (1 + 1e-5)).all()
            acc = acc + tie.to(F64) * step
        # the owner's step comes from the absmax of its fp32 sum, off the float64 one by <= acc
        bound = ref["oscale"] * (0.5 + 1e-5) + acc + acc.max() / 254
        err = (out - S).abs()
        assert (err <= bound * (1 + 1e-6)).all(), f"{spec}: output err {(err / bound).max():.3g} bound"
        return
    if kind == "sign":
        for r in range(world):
            scale = ref["scale"][r]
            decoded = c[r] - res[r]  # what rank r sent, up to the fp32 rounding of its residual
            slack = 1e-6 * scale + 2 * U32 * res[r].abs()
            assert ((decoded.abs() - scale).abs() <= slack).all(), f"{spec}: rank {r} block scale"
            assert torch.equal(torch.signbit(decoded), torch.signbit(c[r])), f"{spec}: rank {r} sign"
        osc = ref["oscale"]
        assert ((out.abs() - osc).abs() <= 2e-6 * osc).all(), f"{spec}: owner block scale"
        sure = S.abs() > acc + 1e-6 * osc  # where the fp32 sum cannot change sign
        assert sure.float().mean() > 0.5  # (integer-valued data cancels to exactly 0 often)
        assert torch.equal(torch.signbit(out[sure]), torch.signbit(S[sure])), f"{spec}: owner sign"
        return
    if kind == "topk":
        int8 = ref["codec"]["values"] == "int8"
        slack = torch.zeros_like(S)
        for r in range(world):
            mine = res[r] != c[r]  # kept elements: the residual is c - value (0 or its rounding)
            if int8:  # kept values below half a step send 0: their residual stays c
                step = ref["scale"][r]
                big = c[r].abs() > step
                assert torch.equal(mine[big], ref["selected"][r][big]), f"{spec}: rank {r} set"
                # the float64 reference up to the fp32 scale's rounding, or one step where the
                # quotient sits on a rounding tie (as int8's check above)
                y = torch.where(step > 0, c[r] / torch.where(step > 0, step, 1.0), 0.0)
                tie = ((y - y.floor()) - 0.5).abs() < 1e-4
                near = 256 * U32 * step + U32 * res[r].abs() + tie.to(F64) * step * (1 + 1e-5)
                assert ((res[r] - ref["res"][r]).abs() <= near).all(), f"{spec}: rank {r} residual"
                slack = slack + near
                continue
            assert torch.equal(mine, ref["selected"][r]), f"{spec}: rank {r} selected set"
            assert torch.equal(res[r], ref["res"][r]), f"{spec}: rank {r} residual"
        assert ((out - S).abs() <= 1e-6 * sum_abs + slack).all(), f"{spec}: output"
        none = ~torch.stack(ref["selected"]).any(0)
        assert (out[none] == 0).all()
        return
    raise AssertionError(kind)


CODECS = ["fp32", "fp16", "bf16", "int8", "int8:block=32", "sign", "sign:block=64", "topk:0.1",
          "topk:0.05:values=fp16", "topk:0.1:values=int8"]
WORLDS = [2, 3, 5]


def zeros_like_all(grads):
    return [torch.zeros_like(g) for g in grads]


@pytest.mark.parametrize("layout", ["a", "b"])
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("codec", CODECS)
def test_first_step(codec, world, layout):
    for seed in (0, 1):
        grads = make_grads(world, layout, seed)
        numels = NUMELS[layout]
        [(out, res)] = run_gradzip(codec, world, [(grads, numels)])
        ref = reference(codec, grads, zeros_like_all(grads), numels)
        true_mean = sum(g.to(F64) for g in grads) / world
        mag = sum(g.to(F64).abs() for g in grads) / world
        check_against_ideal(codec, out, res, ref, world, true_mean, mag)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("codec", ["int8", "int8:block=32", "sign", "sign:block=64", "fp16",
                                   "topk:0.1", "topk:0.05:values=fp16"])
def test_second_step_carries_the_residual(codec, world):
    """Step 2 from the residuals gradzip carried out of step 1 (error feedback)."""
    layout, numels = "a", NUMELS["a"]
    g1, g2 = make_grads(world, layout, 10), make_grads(world, layout, 11)
    (o1, res1), (o2, res2) = run_gradzip(codec, world, [(g1, numels), (g2, numels)])
    ref1 = reference(codec, g1, zeros_like_all(g1), numels)
    check_against_ideal(codec, o1, res1, ref1, world)
    carried = [e.to(torch.float32) for e in res1]
    assert any(e.abs().sum() > 0 for e in carried)
    ref2 = reference(codec, g2, carried, numels)
    check_against_ideal(codec, o2, res2, ref2, world)


def true_error_bound(spec, grads, ref, world):
    """Per element, the codec's stated bound on |output - true mean| (zero residuals)."""
    kind = ref["codec"]["kind"]
    c = ref["c"]
    abs_c = sum(x.abs() for x in c)
    mean_abs = sum(g.to(F64).abs() for g in grads) / world
    # c = fl32(g * fl32(1/W)): two fp32 roundings away from g / W; the owner's / decoder's fp32 sum
    base = 2 * U32 * mean_abs + world * U32 * ref["sum_abs"]
    if kind == "fp32":
        return 1e-6 * mean_abs
    if kind in ("fp16", "bf16"):  # one rounding per rank, one of the owner's sum
        u = UNIT[kind]
        return u * (abs_c + ref["sum"].abs() + base) + (world + 1) * TINY[kind] + 2 * base
    if kind == "int8":  # half a step per rank, half a step of the owner's re-encode
        return (0.5 + 1e-5) * (sum(ref["scale"]) + ref["oscale"]) + 2 * base
    if kind == "sign":  # |+-m - x| <= max(|x|, m) with the same sign, per rank and owner
        per_rank = sum(torch.maximum(x.abs(), s) for x, s in zip(c, ref["scale"]))
        return per_rank + torch.maximum(ref["sum"].abs(), ref["oscale"]) + 2 * base
    if kind == "topk":  # dropped entries are below each rank's k-th largest |c|; fp16 rounding
        k = min(c[0].numel(), max(1, math.ceil(ref["codec"]["ratio"] * c[0].numel())))
        kth = sum(torch.sort(x.abs(), descending=True).values[k - 1] for x in c)
        values = ref["codec"]["values"]
        value_err = 2.0 ** -11 * abs_c + world * 2.0 ** -25 if values == "fp16" else 0
        if values == "int8":  # half a step per rank, and the fp32 scale's rounding
            value_err = (0.5 + 1e-5) * sum(ref["scale"])
        return kth + value_err + 2 * base
    raise AssertionError(kind)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("codec", CODECS)
def test_error_against_the_true_mean(codec, world):
    layout, numels = "b", NUMELS["b"]
    grads = make_grads(world, layout, 5)
    [(out, _)] = run_gradzip(codec, world, [(grads, numels)])
    true_mean = sum(g.to(F64) for g in grads) / world
    ref = reference(codec, grads, zeros_like_all(grads), numels)
    bound = true_error_bound(codec, grads, ref, world)
    err = (out - true_mean).abs()
    assert (err <= bound).all(), f"{codec}: error / bound up to {(err / bound).max():.3g}"


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("codec", CODECS)
def test_bitwise_against_fp32_mirror(codec, world):
    """Two steps (error feedback carried); outputs and residuals equal bit for bit."""
    layout, numels = "a", NUMELS["a"]
    g1, g2 = make_grads(world, layout, 20), make_grads(world, layout, 21)
    (o1, res1), (o2, res2) = run_gradzip(codec, world, [(g1, numels), (g2, numels)])
    ref1 = reference(codec, g1, zeros_like_all(g1), numels, mirror=True)
    ref2 = reference(codec, g2, [e.to(torch.float32) for e in ref1["res"]], numels, mirror=True)
    for step, (o, res, ref) in enumerate([(o1, res1, ref1), (o2, res2, ref2)], 1):
        bad = (o != ref["out"]).sum().item()
        assert bad == 0, f"{codec} W={world} step {step}: {bad} output elements differ"
        for r in range(world):
            bad = (res[r] != ref["res"][r]).sum().item()
            assert bad == 0, f"{codec} W={world} step {step}: rank {r}: {bad} residuals differ"


def to_bf16(t):
    """float32 -> bfloat16, round to nearest even (torch's cast), back to float64 exactly."""
    return t.to(torch.float32).to(torch.bfloat16).to(F64)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("codec", [c for c in CODECS if c != "fp32"])
def test_compact_residual_bitwise_against_fp32_mirror(codec, world):
    """residual_dtype=bfloat16: the residual kept is the fp32 residual rounded to bfloat16 after
    every update, and the next step's c adds it back exactly; outputs and residuals bit for bit."""
    layout, numels = "a", NUMELS["a"]
    g1, g2 = make_grads(world, layout, 22), make_grads(world, layout, 23)
    (o1, res1), (o2, res2) = run_gradzip(codec, world, [(g1, numels), (g2, numels)],
                                         residual_dtype=torch.bfloat16)
    ref1 = reference(codec, g1, zeros_like_all(g1), numels, mirror=True)
    kept1 = [to_bf16(e) for e in ref1["res"]]
    ref2 = reference(codec, g2, [e.to(torch.float32) for e in kept1], numels, mirror=True)
    kept2 = [to_bf16(e) for e in ref2["res"]]
    assert any((k != e).any() for k, e in zip(kept1, ref1["res"])), "no residual was rounded"
    for step, (o, res, ref, kept) in enumerate([(o1, res1, ref1, kept1), (o2, res2, ref2, kept2)], 1):
        bad = (o != ref["out"]).sum().item()
        assert bad == 0, f"{codec} W={world} step {step}: {bad} output elements differ"
        for r in range(world):
            bad = (res[r] != kept[r]).sum().item()
            assert bad == 0, f"{codec} W={world} step {step}: rank {r}: {bad} residuals differ"


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("codec", ["topk:0.1", "topk:0.05:values=fp16", "int8", "int8:block=32",
                                   "sign:block=64"])
def test_ties(codec, world):
    """Integer-valued gradients: |c| ties at top-k's threshold (lowest indices kept) and int8
    quotients exactly half-way (round half to even); the ideal bounds and the fp32 mirror."""
    numels = NUMELS["a"]
    g1, g2 = make_grads(world, "a", 30, ties=True), make_grads(world, "a", 31, ties=True)
    (o1, res1), (o2, res2) = run_gradzip(codec, world, [(g1, numels), (g2, numels)])
    ref1 = reference(codec, g1, zeros_like_all(g1), numels)
    check_against_ideal(codec, o1, res1, ref1, world)
    check_against_ideal(codec, o2, res2, reference(codec, g2, [e.float() for e in res1], numels),
                        world)
    m1 = reference(codec, g1, zeros_like_all(g1), numels, mirror=True)
    m2 = reference(codec, g2, [e.float() for e in m1["res"]], numels, mirror=True)
    for o, res, m in ((o1, res1, m1), (o2, res2, m2)):
        assert torch.equal(o, m["out"])
        assert all(torch.equal(a, b) for a, b in zip(res, m["res"]))


# ---- tensors sent uncompressed ----------------------------------------------------------------
# Weights (2-D), biases and norms (1-D), small 2-D tensors; odd sizes. With uncompressed_numel 50
# the 1-D ones and those under 50 elements travel as fp32: the flags written out here.
SHAPES = [(40, 25), (37,), (3, 5), (64, 33), (6, 10), (31, 61), (65,), (1,), (5, 40), (2, 3, 9)]
EXACT = [False, True, True, False, False, False, True, True, False, False]
UNCOMPRESSED = 50


def run_with_uncompressed(spec, world, steps):
    sim = SimulatedWorkers(spec, world, min_compress_numel=0, uncompressed_numel=UNCOMPRESSED)
    return [(o, gz_residuals(sim, o.numel()))
            for o in (sim.reduce(grads, shapes=SHAPES).to(F64) for grads in steps)]


def shaped_grads(world, seed):
    """Each tensor at a scale of its own (the 1-D ones much smaller, as biases' often are)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.cat([torch.randn(math.prod(s), generator=g) * (1e-3 if e else 1.0 + i)
                       for i, (s, e) in enumerate(zip(SHAPES, EXACT))]) for _ in range(world)]


def exact_mask():
    return torch.cat([torch.full((math.prod(s),), e) for s, e in zip(SHAPES, EXACT)])


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("codec", ["int8", "int8:block=32", "sign", "sign:block=64"])
def test_uncompressed_tensors_bitwise_against_fp32_mirror(codec, world):
    """Two steps: outputs and residuals equal the reference bit for bit; the uncompressed tensors'
    average is the fp32 sum of fl32(g * fl32(1/W)) in rank order, and their residuals stay zero."""
    numels = [math.prod(s) for s in SHAPES]
    g1, g2 = shaped_grads(world, 40), shaped_grads(world, 41)
    (o1, res1), (o2, res2) = run_with_uncompressed(codec, world, [g1, g2])
    ref1 = reference(codec, g1, zeros_like_all(g1), numels, mirror=True, exact=EXACT)
    ref2 = reference(codec, g2, [e.float() for e in ref1["res"]], numels, mirror=True, exact=EXACT)
    mask = exact_mask()
    p = torch.tensor(1.0 / world, dtype=torch.float32)
    for step, (o, res, ref, gs) in enumerate([(o1, res1, ref1, g1), (o2, res2, ref2, g2)], 1):
        assert torch.equal(o, ref["out"]), f"{codec} W={world} step {step}: output"
        for r in range(world):
            assert torch.equal(res[r], ref["res"][r]), f"{codec} W={world} step {step}: rank {r}"
            assert (res[r][mask] == 0).all() and (res[r][~mask] != 0).any()
        exact_sum = torch.zeros(mask.sum().item(), dtype=torch.float32)
        for g in gs:
            exact_sum = exact_sum + g[mask] * p
        assert torch.equal(o[mask], exact_sum.to(F64)), f"{codec} W={world} step {step}"


@pytest.mark.parametrize("codec", ["int8", "sign", "sign:block=64"])
def test_a_tensor_shorter_than_a_piece_travels_exact(codec):
    """A 1x1 output convolution's 16 weights and its bias beside a weight of a much larger scale
    (a depth net's last layer, without uncompressed_numel): they travel in fp32 rather than share
    the large tensor's block scale, so their average is the exact fp32 sum in rank order and their
    residuals stay zero."""
    world, numels = 3, [5000, 16, 1]
    g = torch.Generator().manual_seed(5)
    gs = [torch.cat([torch.randn(5000, generator=g) * 100.0, torch.randn(17, generator=g) * 1e-4])
          for _ in range(world)]
    sim = SimulatedWorkers(codec, world, min_compress_numel=0)
    out = sim.reduce(gs, numels=numels)
    p = torch.tensor(1.0 / world, dtype=torch.float32)
    exact = torch.zeros(17)
    for x in gs:
        exact = exact + x[5000:] * p
    assert torch.equal(out[5000:], exact)
    assert all(bool((e[5000:] == 0).all()) and bool((e[:5000] != 0).any())
               for e in gz_residuals(sim, out.numel()))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("codec", ["int8", "sign"])
def test_uncompressed_tensors_leave_the_compressed_ones_alone(codec, world):
    """Against the reference without the option: only the flagged tensors change."""
    numels = [math.prod(s) for s in SHAPES]
    gs = shaped_grads(world, 42)
    [(out, _)] = run_with_uncompressed(codec, world, [gs])
    with_flags = reference(codec, gs, zeros_like_all(gs), numels, mirror=True, exact=EXACT)
    without = reference(codec, gs, zeros_like_all(gs), numels, mirror=True)
    assert torch.equal(out, with_flags["out"])
    # a compressed piece's message is the same whenever its range is the same in both layouts
    starts = shard_starts(sum(numels), world)
    for j in range(world):
        plain = {(a, b) for a, b, _ in pieces(starts[j], starts[j + 1], numels)}
        for a, b, ex in pieces(starts[j], starts[j + 1], numels, EXACT):
            if not ex and (a, b) in plain:
                assert torch.equal(out[a:b], without["out"][a:b]), (j, a, b)
