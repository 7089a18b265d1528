"""lowrank:R (the PowerSGD class) in the DDP hook on real Gloo ranks (W = 2 and 3): against an
independent float64 reference of the whole reduce (power iteration from the warm start,
orthonormalisation, error feedback), replicas identical, equal to SimulatedWorkers (bit for bit at
W = 2), against PyTorch's powerSGD_hook on a fixed problem, many small buckets, exact resume, the
non-finite guard, bad specs."""

import math
import os
import zlib

import pytest
import torch

import lowrank_scenarios as sc
from dist_util import run_ranks
from gradzip import _ops
from gradzip.ddp import CompressionState
from gradzip.simulation import SimulatedWorkers

STEPS = 4


def load(outdir, name, world):
    return [torch.load(os.path.join(outdir, f"{name}_{r}.pt"), weights_only=False)
            for r in range(world)]


def reference(shapes, keys, world, steps, rank, error_feedback=True, seed=0):
    """The averages of lowrank:``rank`` in float64, tensor by tensor, written from the algorithm's
    definition: M_w = g_w / W + e_w; tensors where two rank-r factors would hold half the elements
    or more (r = min(rows, cols, R)) are averaged exactly; else Q (Gaussian from the key's seed,
    kept between steps) is orthonormalised, P = orth(sum_w M_w Q), Q = sum_w M_w^T P, the
    average is P Q^T and e_w = M_w - P Q^T / W (the residuals sum to what the approximation of the
    sum left out). Orthonormal bases are taken by float64 QR: the result
    depends on the spans only, not on the basis the C++ picks."""
    qs, res, out = {}, {}, []
    for step in range(steps):
        gs = [[g.double() for g in sc.grads(shapes, step, w, seed)] for w in range(world)]
        avgs = []
        for i, (shape, key) in enumerate(zip(shapes, keys)):
            rows = shape[0] if len(shape) >= 2 else math.prod(shape)
            cols = math.prod(shape) // rows
            r = min(rows, cols, rank)
            ms = [gs[w][i].reshape(rows, cols) / world + res.get((i, w), 0) for w in range(world)]
            if 2 * r * (rows + cols) >= rows * cols:
                avgs.append(sum(ms).reshape(shape))
                continue
            if key not in qs:
                g = torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))
                qs[key] = torch.randn(cols, r, generator=g).double()
            q = torch.linalg.qr(qs[key])[0]
            p = torch.linalg.qr(sum(m @ q for m in ms))[0]
            qs[key] = sum(m.T @ p for m in ms)
            approx = p @ qs[key].T
            if error_feedback:
                for w in range(world):
                    res[(i, w)] = ms[w] - approx / world
            avgs.append(approx.reshape(shape))
        out.append(avgs)
    return out


@pytest.fixture(scope="module", params=[2, 3])
def runs(request, tmp_path_factory):
    world = request.param
    outdir = str(tmp_path_factory.mktemp(f"lowrank{world}"))
    plan = [("reference_run", {"steps": STEPS}),
            ("reference_run", {"steps": STEPS, "bucket_cap_mb": 0.0001, "seed": 1}),
            ("resume", {})]
    if world == 2:
        plan += [("versus_torch", {}), ("versus_torch", {"error_feedback": True})]
    run_ranks(sc.session, world, outdir, plan, timeout=240)
    return world, outdir


@pytest.mark.parametrize("cap,seed", [(25.0, 0), (0.0001, 1)])
def test_hook_matches_float64_reference_and_simulation(runs, cap, seed):
    world, outdir = runs
    got = load(outdir, f"reference_{cap}", world)
    for r in range(1, world):  # replicas identical
        for a, b in zip(got[0]["outs"], got[r]["outs"]):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), f"rank {r} differs"
    ref = reference(sc.SHAPES, got[0]["keys"], world, STEPS, sc.RANK, seed=seed)
    for step, (outs, sims, exp) in enumerate(zip(got[0]["outs"], got[0]["sims"], ref)):
        for i, (o, s, e) in enumerate(zip(outs, sims, exp)):
            err = (o.double() - e).norm() / e.norm()
            assert err < 2e-5, f"step {step} tensor {sc.SHAPES[i]}: relative error {err:.2e}"
            if world == 2:  # the backend's sum of two is a + b, as the simulation's
                assert torch.equal(o, s.reshape(o.shape)), f"step {step} {sc.SHAPES[i]}"
            else:  # fp32 rounding, which Gram-Schmidt may magnify element by element
                diff = (o - s.reshape(o.shape)).norm() / o.norm()
                assert diff < 2e-5, f"step {step} {sc.SHAPES[i]}: {diff:.2e} from the simulation"
    # two all-reduces per bucket: P with the uncompressed tensors, Q
    p = q = 0
    for shape in sc.SHAPES:
        rows = shape[0] if len(shape) >= 2 else math.prod(shape)
        cols, r = math.prod(shape) // rows, min(shape[0], math.prod(shape) // rows, sc.RANK)
        small = len(shape) < 2 or 2 * r * (rows + cols) >= rows * cols
        p += math.prod(shape) if small else rows * r
        q += 0 if small else cols * r
    stats = got[0]["stats"]
    assert stats["compressed_buckets"] == stats["buckets"]
    if cap == 25.0:  # one bucket after the rebuild: exactly the two all-reduces' ring bytes
        assert stats["bytes_sent"] == _ops.fp32_traffic(p, world) + _ops.fp32_traffic(q, world)


def test_resume_is_exact(runs):
    world, outdir = runs
    for got in load(outdir, "resume", world):
        for a, b in zip(got["whole"], got["resumed"]):
            assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_same_subspace_as_pytorch_powersgd(runs):
    """The same power iteration, step after step, from the same first Q, with and without error
    feedback (PyTorch keeps its error in gradient units, W times gradzip's: the same feedback)."""
    world, outdir = runs
    if world != 2:
        pytest.skip("run at W = 2")
    for ef in (0, 1):
        got = load(outdir, f"torch_{ef}", world)[0]
        assert len(got["torch"]) >= 6
        for step, (a, b) in enumerate(zip(got["torch"], got["gradzip"])):
            # the averages are the projections onto the same subspace: signs cannot differ
            err = (a - b).norm() / a.norm()
            assert err < 1e-5, f"error_feedback={ef} step {step}: relative difference {err:.2e}"


def test_simulation_is_deterministic_and_reduces_traffic():
    shapes = [(64, 48), (48,), (32, 3, 3)]
    n = sum(math.prod(s) for s in shapes)
    a, b = (SimulatedWorkers("lowrank:4", 3, min_compress_numel=0) for _ in range(2))
    for step in range(3):
        gs = [torch.randn(n, generator=torch.Generator().manual_seed(10 * step + r)) for r in range(3)]
        assert torch.equal(a.reduce(gs, shapes=shapes), b.reduce(gs, shapes=shapes))
    assert a.stats["compression_ratio"] > 3


def test_nonfinite_step_keeps_residual_and_q():
    shapes = [(40, 30)]
    sim = SimulatedWorkers("lowrank:2", 2, min_compress_numel=0)
    g = [torch.randn(1200, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    sim.reduce(g, shapes=shapes)
    before = [t.clone() for w in range(2) for st in sim._ef[w].buckets.values()
              for t in (st.residual, st.q)]
    bad = [g[0].clone(), g[1].clone()]
    bad[1][5] = float("inf")
    assert not torch.isfinite(sim.reduce(bad, shapes=shapes)).all()
    after = [t for w in range(2) for st in sim._ef[w].buckets.values() for t in (st.residual, st.q)]
    assert all(torch.equal(x, y) for x, y in zip(before, after))


def test_cost_model_counts_two_allreduces():
    from gradzip.costmodel import Codec, Link, bucket_cost, ring_allreduce

    shapes, link = [(64, 48), (48,), (32, 3, 3), (6, 6)], Link(10.0)
    # P: 64*2 + 32*2 with the uncompressed 48 + 36 appended; Q: 48*2 + 9*2
    expect = (ring_allreduce(4 * (128 + 64 + 48 + 36), 4, link)
              + ring_allreduce(4 * (96 + 18), 4, link))
    got = bucket_cost(Codec.parse("lowrank:2"), shapes, 4, link, min_compress_numel=0)
    assert got.seconds == pytest.approx(expect.seconds) and got.sent_bytes == expect.sent_bytes
    assert got.messages == expect.messages
    with pytest.raises(ValueError, match="lowrank:RANK"):
        Codec.parse("lowrank:0")


def test_convergence_harness_accepts_lowrank():
    from gradzip_converge.cli import select
    from gradzip_converge.suites import get_suite

    suite = get_suite("cpu-smoke")
    runs = select(suite.configs(), "lowrank:2", suite.base)
    assert [(c.codec, c.error_feedback) for c in runs] == [("lowrank:2", True)]
    with pytest.raises(SystemExit, match="lowrank:0"):
        select(suite.configs(), "lowrank:0", suite.base)


@pytest.mark.parametrize("spec,part", [("lowrank", "needs its rank"), ("lowrank:0", "'0'"),
                                       ("lowrank:x", "'x'"), ("lowrank:2:1", "'2:1'"),
                                       ("lowrank:-3", "'-3'")])
def test_bad_specs_raise(spec, part):
    with pytest.raises(ValueError, match=part):
        CompressionState(spec)
    with pytest.raises(ValueError, match=part):
        SimulatedWorkers(spec, 2)


def test_spec_is_canonical():
    assert CompressionState("lowrank:04").codec == "lowrank:4"
