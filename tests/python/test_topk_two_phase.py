"""Top-k's two-phase exchange (``cast_sum="fp32"``) against a float64 reference written here, and
its bytes per rank against the cost model and the all-gathered form.

The algorithm, from its description (bindings/torch/bucket_reduction.hpp), in plain torch (no
gradzip encoder, decoder or layout helper is called):

  * each rank forms c = fl32(fl32(g * fl32(1/W)) + e), e its residual;
  * the bucket is cut into W shards (the first n % W get n // W + 1 elements); in each shard of m
    elements every rank keeps its k = min(m, max(1, ceil(ratio * m))) largest |c| (ties to the
    lowest index), values as fp32, fp16 or int8 (a scale per 65536 elements of the shard: the
    kept values' absmax / 127, q = round(c * (127 / absmax)), value q * scale); its residual
    becomes c - kept value (c where not kept);
  * the shard's owner adds the W kept values in rank order into fp32 zeros, adds its owner residual
    o (c_owner = fl32(sum + o)), keeps the k largest |c_owner| of the shard (values rounded as the
    ranks'), and its owner residual becomes c_owner - kept value;
  * every rank's average is the owners' kept values, zero elsewhere.

Each fp32 step is written as a float64 operation rounded to fp32 (correctly rounded, 53 >= 2*24+2),
so gradzip's outputs and both residuals must equal the reference bit for bit, over three steps of
error feedback, on random data of odd sizes.
"""

import math

import pytest
import torch

from gradzip import costmodel as cm
from gradzip.simulation import SimulatedWorkers

F64 = torch.float64


def f32(x):
    return x.to(torch.float32).to(F64)


def top(c: torch.Tensor, k: int) -> torch.Tensor:
    """Mask of the k largest |c|, ties to the lowest index."""
    keep = torch.zeros(c.numel(), dtype=torch.bool)
    keep[torch.sort(c.abs(), descending=True, stable=True).indices[:k]] = True
    return keep


def value(c: torch.Tensor, keep: torch.Tensor, values: str) -> torch.Tensor:
    """What the kept values of one message decode to (zero where not kept)."""
    if values == "fp16":
        c = c.to(torch.float32).to(torch.float16).to(F64)
    if values == "int8":
        out = torch.zeros_like(c)
        for a in range(0, c.numel(), 65536):
            x = torch.where(keep[a:a + 65536], c[a:a + 65536], 0.0)
            amax = x.abs().max()
            if amax >= 2.0 ** -100:
                q = torch.round(f32(x * f32(127 / amax))).clamp(-127, 127)
                out[a:a + 65536] = f32(q * f32(amax / 127))
        c = out
    return torch.where(keep, c, 0.0)


def reference(ratio, values, grads, residuals, owner_residual):
    """(average, worker residuals, owner residual) of one step; owner_residual: n floats, shard j
    held by rank j."""
    world, n = len(grads), grads[0].numel()
    p = float(torch.tensor(1.0 / world, dtype=torch.float32))
    cs = [f32(f32(g.to(F64) * p) + e.to(F64)) for g, e in zip(grads, residuals)]
    base, extra = divmod(n, world)
    starts = [0]
    for j in range(world):
        starts.append(starts[-1] + base + (1 if j < extra else 0))
    out = torch.zeros(n, dtype=F64)
    res = [c.clone() for c in cs]
    owner = owner_residual.to(F64).clone()
    for a, b in zip(starts, starts[1:]):
        m = b - a
        k = min(m, max(1, math.ceil(ratio * m)))
        total = torch.zeros(m, dtype=F64)
        for r, c in enumerate(cs):
            keep = top(c[a:b], k)
            sent = value(c[a:b], keep, values)
            res[r][a:b] = f32(c[a:b] - sent)
            total = f32(total + sent)
        c_owner = f32(total + owner[a:b])
        keep = top(c_owner, k)
        kept = value(c_owner, keep, values)
        out[a:b] = kept
        owner[a:b] = f32(c_owner - kept)
    return out, res, owner


def owner_residual_of(sim, world, n):
    """The ranks' owner residuals of bucket 0, concatenated in rank (= shard) order."""
    return torch.cat([w[0]["owner_residual"].to(F64) for w in sim.state_dict()["workers"]])


@pytest.mark.parametrize("world", [2, 3, 5])
@pytest.mark.parametrize("spec,ratio,values", [("topk:0.1", 0.1, "fp32"),
                                               ("topk:0.03:values=fp16", 0.03, "fp16"),
                                               ("topk:0.04:values=int8", 0.04, "int8")])
@pytest.mark.parametrize("residual_dtype", [torch.float32, torch.bfloat16])
def test_against_float64_reference(spec, ratio, values, world, residual_dtype):
    """residual_dtype=bfloat16 (compact): both residuals kept rounded to bfloat16 after every
    update."""
    n = 4099 + world  # odd shard sizes
    numels = [1500, 37, n - 1537]
    sim = SimulatedWorkers(spec, world, min_compress_numel=0, cast_sum="fp32",
                           residual_dtype=residual_dtype)
    kept = lambda t: t.to(torch.float32).to(residual_dtype).to(F64)  # noqa: E731
    assert sim.config.plan.two_phase
    gen = torch.Generator().manual_seed(7 * world)
    res = [torch.zeros(n) for _ in range(world)]
    owner = torch.zeros(n)
    for step in range(3):
        scales = torch.cat([torch.full((m,), s) for m, s in zip(numels, (1.0, 50.0, 1e-3))])
        grads = [torch.randn(n, generator=gen) * scales for _ in range(world)]
        out = sim.reduce(grads, numels=numels).to(F64)
        want, want_res, want_owner = reference(ratio, values, grads, res, owner)
        want_res, want_owner = [kept(e) for e in want_res], kept(want_owner)
        assert torch.equal(out, want), f"step {step}: {(out != want).sum()} outputs differ"
        got_res = [w[0]["residual"].to(F64) for w in sim.state_dict()["workers"]]
        for r in range(world):
            assert torch.equal(got_res[r], want_res[r]), f"step {step}: rank {r}'s residual"
        assert torch.equal(owner_residual_of(sim, world, n), want_owner), f"step {step}: owner"
        res, owner = [e.to(torch.float32) for e in want_res], want_owner.to(torch.float32)
        # k nonzeros per shard: the same coordinates on every rank (they decode the same bytes)
        assert (out != 0).sum() <= sum(math.ceil(ratio * (n // world + 1)) for _ in range(world))


def test_error_feedback_loses_nothing():
    """What the ranks and the owners hold back plus what was averaged equals what was given: the
    sum over steps of the averages, plus the residuals (worker residuals summed, owner residual)
    equals the sum of the mean gradients, to fp32 rounding."""
    world, n = 4, 3001
    sim = SimulatedWorkers("topk:0.02", world, min_compress_numel=0, cast_sum="fp32")
    gen = torch.Generator().manual_seed(3)
    given = torch.zeros(n, dtype=F64)
    averaged = torch.zeros(n, dtype=F64)
    for _ in range(20):
        grads = [torch.randn(n, generator=gen) for _ in range(world)]
        given += sum(g.to(F64) for g in grads) / world
        averaged += sim.reduce(grads).to(F64)
    held = sum(w[0]["residual"].to(F64) for w in sim.state_dict()["workers"])
    held += owner_residual_of(sim, world, n)
    torch.testing.assert_close(averaged + held, given, rtol=0, atol=1e-4)


def test_bytes_per_rank_stay_flat_and_match_the_cost_model():
    """A rank's bytes per step, as the reduction reports them, grow with W no faster than fp32's
    ring all-reduce ((W - 1) / W of a fixed amount; all-gathered top-k's grow as W - 1), stay at
    most 1/20 of fp32's at 2 %, and the cost model's bytes agree with them to 1 %."""
    n = 1 << 20
    sent, ratio = {}, {}
    for world in (4, 16, 32):
        for cast_sum in ("wire", "fp32"):
            sim = SimulatedWorkers("topk:0.02:values=fp16", world, min_compress_numel=0,
                                   cast_sum=cast_sum)
            sim.reduce([torch.randn(n) for _ in range(world)])
            sent[world, cast_sum] = sim.stats["bytes_sent"]
            raw = sim.stats["raw_bytes"]
            ratio[world, cast_sum] = raw / sent[world, cast_sum]
            model = cm.bucket_cost(cm.Codec.parse("topk:0.02:values=fp16", cast_sum), [(n,)],
                                   world, cm.Link(1.0)).sent_bytes
            assert model == pytest.approx(sent[world, cast_sum], rel=0.01), (world, cast_sum)
        assert sent[world, "fp32"] <= raw / 20
    assert ratio[32, "fp32"] >= 0.95 * ratio[4, "fp32"]
    assert ratio[32, "wire"] < ratio[4, "wire"] / 7  # W / 4: 8x fewer


def test_error_feedback_without_an_owner_residual_is_refused():
    """The C++ reduction refuses a worker residual without an owner residual (what the owner
    drops would vanish silently), in every driver: here the in-memory one."""
    n, world = 1000, 2
    ranks = [torch.classes.gradzip.BucketReduction("topk:0.1", world, r, [n], torch.zeros(1),
                                                   "fp32") for r in range(world)]
    xs = [torch.randn(n) for _ in range(world)]
    with pytest.raises(ValueError, match="owner residual"):
        torch.ops.gradzip.reduce_in_memory(ranks, xs, [torch.zeros(n)] * world, [None] * world,
                                           [None] * world, [torch.empty(n) for _ in range(world)])
    outs = [torch.empty(n) for _ in range(world)]  # without error feedback: nothing to keep
    torch.ops.gradzip.reduce_in_memory(ranks, xs, [None] * world, [None] * world, [None] * world,
                                       outs)
    assert torch.equal(outs[0], outs[1]) and (outs[0] != 0).sum() <= 2 * 50


def test_default_stays_all_gathered():
    """Top-k all-gathers unless cast_sum="fp32" is asked for, with or without an optimizer."""
    assert SimulatedWorkers("topk:0.01", 4).config.plan.collective == "allgather"
    assert SimulatedWorkers("topk:0.01", 4, cast_sum="fp32").config.plan.collective == "two_phase"
