"""fp16/bf16 over one all-reduce (``cast_sum="wire"``, the hook's default) on 3 real Gloo ranks,
against a float64 reference written here, and the two-phase fp32 sum (``cast_sum="fp32"``)
against SimulatedWorkers bit for bit.

The reference, from the algorithm's description only: each rank forms c = g * p + e in fp32
(p = fl32(1/W), two roundings: the encoders use no fma), sends t = c rounded to the wire dtype
(nearest even) and keeps e' = c - t; the backend sums the W values t in the wire dtype, in an
order of its own, so the hook's average is sum(t) up to the wire dtype's rounding of a W-term sum:
|out - sum(t)| <= (W - 1) u sum|t| (+ (W - 1) times half the smallest subnormal step).
"""

import math
import os

import pytest
import torch

import ddp_scenarios as sc
from dist_util import run_ranks
from gradzip import costmodel as cm
from gradzip.ddp import CompressionState
from gradzip.simulation import SimulatedWorkers

F64 = torch.float64
WORLD = 3
WIRE = {"fp16": torch.float16, "bf16": torch.bfloat16}
UNIT = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}  # unit roundoff
TINY = {"fp16": 2.0 ** -25, "bf16": 2.0 ** -134}  # half the smallest subnormal step
# bf16 on the wire: a layer of more than 2**20 elements, so that the CPU path sends its bucket
# in two chunks (the second of 4075 elements), each encoded while the previous one is summed.
CONFIGS = [(f"{codec}_{cast_sum}", codec, cast_sum,
            (1031, 1021) if (codec, cast_sum) == ("bf16", "wire") else (64, 50))
           for codec in ("bf16", "fp16") for cast_sum in ("wire", "fp32")]


def f32(t):
    return t.to(torch.float32).to(F64)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    outdir = tmp_path_factory.mktemp("casts")
    run_ranks(sc.session, WORLD, str(outdir), [("sum_16_bit", ()), ("cast_sums", (CONFIGS,))],
              timeout=240)
    return {name: [torch.load(os.path.join(outdir, f"{name}_{r}.pt"), weights_only=False)
                   for r in range(WORLD)] for name in ["sums"] + [c[0] for c in CONFIGS]}


def by_step(run):
    recs = sorted(run["records"], key=lambda rec: rec[0][:2])
    assert [rec[0][1] for rec in recs] == [0] * 5, "one bucket per step"
    return recs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gloo_sums_16_bit_tensors(runs, dtype):
    """The path needs the backend's SUM all-reduce of float16 / bfloat16 CPU tensors (Gloo has
    both in torch 2.11): it runs, in the dtype, exact on small integers."""
    for r in range(WORLD):
        got = runs["sums"][r][str(dtype)]
        assert got.dtype == dtype and torch.equal(got, torch.full((5,), 6.0, dtype=dtype))


@pytest.mark.parametrize("codec", ["bf16", "fp16"])
def test_wire_sum_against_float64_reference(runs, codec):
    """Replicas identical; every step's average within the wire dtype's rounding of the W-term sum
    of the reference's payloads; the residuals equal the reference's c - t bit for bit, carried
    from step to step (error feedback)."""
    ranks = runs[f"{codec}_wire"]
    for r in range(1, WORLD):
        assert torch.equal(ranks[r]["params"], ranks[0]["params"]), f"replica {r} differs"
    recs = [by_step(run) for run in ranks]
    p = float(torch.tensor(1.0 / WORLD, dtype=torch.float32))
    e = [torch.zeros_like(recs[0][0][1], dtype=F64) for _ in range(WORLD)]
    for step in range(5):
        out = recs[0][step][2]
        for r in range(1, WORLD):
            assert torch.equal(recs[r][step][2], out), f"step {step}: rank {r}'s average differs"
        c = [f32(f32(recs[r][step][1].to(F64) * p) + e[r]) for r in range(WORLD)]
        t = [ci.to(torch.float32).to(WIRE[codec]).to(F64) for ci in c]
        e = [ci - ti for ci, ti in zip(c, t)]
        total = sum(t)
        bound = (WORLD - 1) * (UNIT[codec] * sum(ti.abs() for ti in t) + TINY[codec])
        err = (out.to(F64) - total).abs()
        assert (err <= bound).all(), f"step {step}: error / bound up to {(err / bound).max():.3g}"
        for r in range(WORLD):
            got = ranks[r]["residuals"][step].to(F64)
            assert torch.equal(got, e[r]), f"step {step}: rank {r}: {(got != e[r]).sum()} residuals differ"
        assert all(ei.abs().max() > 0 for ei in e)


@pytest.mark.parametrize("codec", ["bf16", "fp16"])
def test_wire_sum_matches_simulation_to_the_wire_rounding(runs, codec):
    """SimulatedWorkers sums the payloads in fp32 and rounds once; the hook's backend sums in the
    wire dtype: equal to that rounding, and the residuals (each rank's own) bit for bit."""
    ranks = runs[f"{codec}_wire"]
    recs = [by_step(run) for run in ranks]
    sim = SimulatedWorkers(codec, WORLD, min_compress_numel=0)
    differ = 0
    for step in range(5):
        grads = [recs[r][step][1] for r in range(WORLD)]
        expected = sim.reduce(grads)
        bound = WORLD * (UNIT[codec] * sum(g.to(F64).abs() for g in grads) / WORLD * 1.01
                         + TINY[codec])
        assert ((recs[0][step][2].to(F64) - expected.to(F64)).abs() <= bound).all(), step
        differ += (recs[0][step][2] != expected).sum().item()
        for r in range(WORLD):
            assert torch.equal(sim.residuals(r)[0], ranks[r]["residuals"][step]), (step, r)
    # Gloo adds in the wire dtype, the simulation rounds an fp32 sum once: some elements differ
    assert differ > 0


@pytest.mark.parametrize("codec", ["bf16", "fp16"])
def test_fp32_sum_equals_simulation_bit_for_bit(runs, codec):
    ranks = runs[f"{codec}_fp32"]
    recs = [by_step(run) for run in ranks]
    sim = SimulatedWorkers(codec, WORLD, min_compress_numel=0, cast_sum="fp32")
    for step in range(5):
        expected = sim.reduce([recs[r][step][1] for r in range(WORLD)])
        for r in range(WORLD):
            assert torch.equal(recs[r][step][2], expected), (step, r)
    for r in range(1, WORLD):
        assert torch.equal(ranks[r]["params"], ranks[0]["params"])


@pytest.mark.parametrize("name", [name for name, *_ in CONFIGS])
def test_resume_from_state_dict_is_exact(runs, name):
    for r in range(WORLD):
        assert torch.equal(runs[name][r]["resumed"], runs[name][r]["params"]), (name, r)


def test_traffic_is_a_16_bit_ring_all_reduce():
    """2 (W-1)/W of the 2n payload bytes each way, no header, in the C++ layout and the cost model;
    the fp32 sum keeps its two-phase bytes (a header per shard)."""
    for world in (2, 3, 8):
        for n in (world, 1000, 1_000_003):
            want = 2 * (world - 1) * 2 * n // world
            for codec in ("bf16", "fp16"):
                def traffic(cast_sum):
                    return torch.classes.gradzip.BucketReduction(
                        codec, world, 0, [n], torch.zeros(1), cast_sum).traffic()

                assert traffic("wire") == (want, want)
                model = cm.bucket_cost(cm.Codec.parse(codec), [(n,)], world, cm.Link(8.0),
                                       min_compress_numel=0).sent_bytes
                assert model == pytest.approx(want, abs=1)
                two_phase = traffic("fp32")[0]
                assert two_phase > want
                assert cm.Codec.parse(codec, "fp32").collective == "two_phase"


def test_bad_cast_sum_and_owner_residual_are_clear_errors():
    with pytest.raises(ValueError, match="cast_sum"):
        CompressionState("bf16", cast_sum="fp16")
    with pytest.raises(ValueError, match="cast_sum"):
        SimulatedWorkers("bf16", 2, cast_sum="")
    from gradzip.optim import CompressedSGD

    def sgd():
        return CompressedSGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)

    # an optimizer direction with error feedback keeps the owner's residual of the fp32 sum
    with pytest.raises(ValueError, match="cast_sum='fp32'"):
        CompressionState("bf16", optimizer=sgd(), cast_sum="wire")
    assert CompressionState("bf16", optimizer=sgd()).config.plan.cast_sum == "fp32"
    assert CompressionState("bf16", optimizer=sgd(), error_feedback=False).config.plan.cast_sum == "wire"
    assert CompressionState("bf16").config.plan.wire_sum
    assert not CompressionState("int8").config.plan.wire_sum


@pytest.mark.parametrize("codec", ["bf16", "fp16"])
def test_simulated_wire_sum_rounds_the_fp32_sum_once(codec):
    """The simulation of the one all-reduce: the fp32 sum of the W payloads in rank order, rounded
    once to the wire dtype; residuals c - t."""
    world, n = 3, 4099
    gen = torch.Generator().manual_seed(7)
    sim = SimulatedWorkers(codec, world, min_compress_numel=0)
    p = torch.tensor(1.0 / world, dtype=torch.float32)
    e = [torch.zeros(n) for _ in range(world)]
    for _ in range(3):
        grads = [torch.randn(n, generator=gen) * 10.0 ** float(torch.randint(-3, 3, (1,), generator=gen))
                 for _ in range(world)]
        out = sim.reduce(grads)
        c = [g * p + ei for g, ei in zip(grads, e)]
        t = [ci.to(WIRE[codec]) for ci in c]
        total = torch.zeros(n)
        for ti in t:
            total += ti.float()
        assert torch.equal(out, total.to(WIRE[codec]).float())
        e = [ci - ti.float() for ci, ti in zip(c, t)]
        for r in range(world):
            assert torch.equal(sim.residuals(r)[0], e[r])
    assert math.isclose(sim.stats["bytes_sent"], 2 * (world - 1) * 2 * n // world)
