"""gradzip.fsdp on real multi-process Gloo (CPU), world sizes 2 and 3: FSDP2 models whose shards
FSDP pads, step-0 gradients against uncompressed FSDP2 (default policy, bf16 and fp16 reduce
dtypes, a divide factor), identical full parameters on every rank after SGD-with-momentum and AdamW steps,
non-finite gradients kept visible, exact resume, async reduce-scatter, mismatched ranks; lowrank:R
against test_lowrank's float64 reference of the whole average, each rank holding its rows."""

import math

import pytest
import torch

import fsdp_scenarios as sc
import lowrank_scenarios as lr
from dist_util import run_ranks
from gradzip.costmodel import Codec, Link, bucket_cost
from gradzip.simulation import SimulatedWorkers
from gradzip.fsdp import FSDPCompressionState
from test_lowrank import reference
from fsdp_scenarios import load

LOWRANK = f"lowrank:{lr.RANK}"
STEP0 = ["fp32", "bf16", "fp16", "int8", "int8:block=64", "sign:block=64", "topk:1", "topk:0.1",
         LOWRANK]
# relative error of a codec's step-0 sharded gradient against uncompressed FSDP2, per tensor
BOUND = {"fp32": 1e-6, "topk:1": 1e-6, "bf16": 2e-2, "fp16": 2e-2, "int8": 5e-2, "int8:block=64": 5e-2}
# "+compact": the residuals in bfloat16 (residual_dtype)
TRAIN = ["bf16", "int8", "sign:block=64", "topk:0.1", LOWRANK, "int8+compact", "topk:0.1+compact"]
NONFINITE = ["bf16", "int8", "sign:block=64", "topk:0.1", LOWRANK, "sign:block=64+compact"]
RESUME = ["int8", "topk:0.1", LOWRANK, "int8+compact"]
LOWRANK_STEPS = 3
MISMATCH = ["int8", "sign"]
PARAM = [None, "bf16", "int8:block=64"]
UNCOMPRESSED = ["int8", "sign:block=64"]


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def session(request, tmp_path_factory):
    """One set of W spawned Gloo ranks runs every scenario; the tests check what they recorded."""
    world = request.param
    outdir = tmp_path_factory.mktemp(f"fsdp{world}")
    plan = [("step0", (STEP0,)), ("train", ([None] + TRAIN,)), ("nonfinite", (NONFINITE,)),
            ("resume", (RESUME,)), ("async_call", (["int8", LOWRANK],)), ("param_gather", (PARAM,)),
            ("uncompressed", (UNCOMPRESSED,)), ("lowrank", (LOWRANK_STEPS,)),
            ("mismatched", (MISMATCH,))]  # last: it leaves a backward pass unfinished
    run_ranks(sc.session, world, str(outdir), plan, timeout=300)
    return world, outdir


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("policy", ["default", "reduce_bf16", "reduce_fp16", "divide_1"])
def test_step0_gradients_match_uncompressed_fsdp(session, policy):
    world, outdir = session
    for r, run in enumerate(load(outdir, "step0", world)):
        ref = run[(policy, None)]
        for codec in STEP0:
            got = run[(policy, codec)]
            assert [g.shape for g in got] == [g.shape for g in ref]
            assert [g.dtype for g in got] == [g.dtype for g in ref]
            for i, (g, e) in enumerate(zip(got, ref)):
                assert torch.isfinite(g).all()
                if codec == LOWRANK:  # a whole matrix's estimate: see test_lowrank_step0_policies
                    continue
                err = rel(g, e)
                # a 16-bit reduce dtype rounds FSDP's own result and ours: compare at its precision
                bound = max(BOUND.get(codec, 0.0), {"reduce_bf16": 8e-3, "reduce_fp16": 1e-3}.get(policy, 0.0))
                if codec in BOUND:
                    assert err <= bound, f"rank {r} {policy} {codec} tensor {i}: {err:.3g}"
                else:  # 1-bit and 10 % top-k: a coarse estimate, but of this gradient
                    assert err < 1.0, f"rank {r} {policy} {codec} tensor {i}: {err:.3g}"
            stats = run[(policy, codec, "stats")]
            assert stats["compressed_buckets"] == stats["buckets"] == 3  # one per Linear
            # against FSDP's own reduce-scatter in its reduce dtype: a 16-bit cast saves nothing
            # over a bf16 one (headers aside)
            low = 0.9 if policy.startswith("reduce_") and codec in ("bf16", "fp16") else 1.5
            if codec not in ("fp32", "topk:1"):
                assert stats["compression_ratio"] > low, (codec, stats)


def test_lowrank_step0_policies(session):
    """lowrank's step-0 average, stacked from every rank's shards (the projection of the whole
    matrix onto P's span: never farther from the exact one than the exact one's norm, where a
    shard's rows may be), under each of FSDP's policies: FSDP's scaling kept (a divide factor of 1
    is W times the average), a 16-bit reduce dtype to its precision."""
    world, outdir = session
    runs = load(outdir, "step0", world)

    def stacked(key):
        return [torch.cat([run[key][i] for run in runs]) for i in range(len(runs[0][key]))]

    base = stacked(("default", LOWRANK))
    for i, (b, e) in enumerate(zip(base, stacked(("default", None)))):
        assert rel(b, e) < (1e-6 if b.dim() == 1 else 1.0), i  # biases: the exact average
    for policy, factor, bound in [("reduce_bf16", 1, 1e-2), ("reduce_fp16", 1, 2e-3),
                                  ("divide_1", world, 1e-6)]:
        for i, (g, b) in enumerate(zip(stacked((policy, LOWRANK)), base)):
            assert rel(g, b * factor) < bound, f"{policy} tensor {i}: {rel(g, b * factor):.3g}"


def test_biases_sent_uncompressed(session):
    """uncompressed_numel=1: the biases' sharded gradients are FSDP's fp32 ones (to the
    backend's summation order; equal at W = 2), where compressed they are not; the weights stay
    compressed, and the stats count the fp32 bytes."""
    world, outdir = session
    for run in load(outdir, "uncompressed", world):
        ref = run[None]
        for codec in UNCOMPRESSED:
            compressed_differs = []
            for i, e in enumerate(ref):
                exact, compressed = run[(codec, 1)][i], run[(codec, 0)][i]
                if e.dim() == 1:
                    assert rel(exact, e) <= 1e-5 and (world > 2 or torch.equal(exact, e)), (codec, i)
                    compressed_differs.append(rel(compressed, e) > 1e-4)
                else:
                    assert 1e-4 < rel(exact, e) < 1.0, (codec, i)
            # the 200-element biases are compressed without the option (the 7-element one travels
            # in fp32 anyway: each rank's part is shorter than a piece)
            assert compressed_differs == [True, True, False], codec
            sent = [run[(codec, u, "stats")]["bytes_sent"] for u in (0, 1)]
            assert sent[1] > sent[0], (codec, sent)


def check_parameters_identical_after_training(runs, codecs):
    """The "train" scenario's records: every rank's full parameters finite and equal to rank 0's,
    and each of ``codecs`` away from the uncompressed run's."""
    for key, base in runs[0].items():
        for p in base["params"]:
            assert torch.isfinite(p).all(), key
        for r in range(1, len(runs)):
            for a, b in zip(base["params"], runs[r][key]["params"]):
                assert torch.equal(a, b), f"{key}: rank {r}'s parameters differ from rank 0's"
    # compression changes the trajectory (the test would pass without it otherwise)
    for codec in codecs:
        assert not torch.equal(runs[0][(codec, "adamw")]["params"][0],
                               runs[0][(None, "adamw")]["params"][0])


def check_nonfinite_visible_and_residuals_restored(runs):
    """The "nonfinite" scenario's records: the overflow step's gradient non-finite on every rank,
    its residual updates undone, the finite steps' kept, every residual finite."""
    for r, run in enumerate(runs):
        for codec, log in run.items():
            assert log[0]["grads_finite"] and log[2]["grads_finite"], (r, codec, log)
            assert not log[1]["grads_finite"], f"{codec}: rank {r} lost the non-finite gradient"
            assert log[1]["residuals_restored"], f"{codec}: rank {r} kept the overflow step's residual"
            assert not log[2]["residuals_restored"]  # a finite step does update them
            assert all(step["residuals_finite"] for step in log), (r, codec, log)


def check_resume_exact(runs):
    """The "resume" scenario's records: each rank's shards after a resume at step 2 equal the
    uninterrupted run's, and the checkpoint held a residual."""
    for r, run in enumerate(runs):
        for codec, res in run.items():
            assert res["saved_step"] == 2 and res["residual_norm"] > 0
            for a, b in zip(res["uninterrupted"], res["resumed"]):
                assert torch.equal(a, b), f"{codec}: rank {r} diverged after resume"


def test_parameters_identical_on_every_rank_after_training(session):
    world, outdir = session
    check_parameters_identical_after_training(load(outdir, "train", world), TRAIN)


def test_nonfinite_gradient_stays_visible_and_residuals_are_restored(session):
    world, outdir = session
    check_nonfinite_visible_and_residuals_restored(load(outdir, "nonfinite", world))


def test_resume_from_state_dict_equals_uninterrupted_run(session):
    world, outdir = session
    check_resume_exact(load(outdir, "resume", world))


def test_async_reduce_scatter_completes_at_wait(session):
    world, outdir = session
    for run in load(outdir, "async", world):
        for codec, res in run.items():
            assert torch.isfinite(res["async"]).all(), codec
            assert torch.equal(res["async"], res["sync"]), codec


def test_ranks_configured_differently_fail_with_value_error(session):
    world, outdir = session
    for r in range(world):
        with open(outdir / f"mismatch_{r}.txt") as f:
            msg = f.read()
        assert "configured differently" in msg, msg
        assert "int8" in msg and "sign" in msg and "rank 1" in msg


def int8_bound(exact: torch.Tensor, world: int, block: int) -> torch.Tensor:
    """Per element, half a quantisation step of its int8 block, in float64: FSDP's shard j of a
    parameter is rows [j r, (j + 1) r) with r = ceil(rows / W), zero-padded, and its blocks of
    ``block`` elements restart at each shard; a block's step is its largest |x| / 127."""
    rows = exact.shape[0]
    r = -(-rows // world)
    flat = torch.zeros(world * r, *exact.shape[1:], dtype=torch.float64)
    flat[:rows] = exact.double()
    shards = flat.reshape(world, -1)
    pad = (-shards.shape[1]) % block
    blocks = torch.nn.functional.pad(shards, (0, pad)).reshape(world, -1, block)
    step = blocks.abs().amax(dim=2, keepdim=True) / 127.0
    half = (step / 2).expand_as(blocks).reshape(world, -1)[:, :shards.shape[1]]
    return half.reshape(world * r, *exact.shape[1:])[:rows]


def test_parameter_all_gather_in_a_codec(session):
    """Every rank's forward sees the same unsharded parameters: bf16-rounded (torch's rounding) or
    within half an int8 step of the exact ones, blocks restarting at each shard; FSDP's own
    gather is untouched without a codec and for parameters already gathered in bf16; the bytes
    fall as the codec says; training goes on with the replicas equal."""
    world, outdir = session
    runs = load(outdir, "param_gather", world)
    for r, run in enumerate(runs):
        for codec in PARAM:
            res = run[(codec, codec)]
            for got, exact in zip(res["seen"], res["exact"]):
                if codec is None:
                    assert torch.equal(got, exact)
                elif codec == "bf16":
                    assert torch.equal(got, exact.to(torch.bfloat16).float())
                else:
                    err = (got.double() - exact.double()).abs()
                    assert (err <= int8_bound(exact, world, 64) * (1 + 1e-5) + 1e-30).all(), r
                    assert not torch.equal(got, exact)
            for a, b in zip(res["seen"], runs[0][(codec, codec)]["seen"]):
                assert torch.equal(a, b), f"rank {r} {codec}: ranks saw different parameters"
            for a, b in zip(res["final"], runs[0][(codec, codec)]["final"]):
                assert torch.equal(a, b) and torch.isfinite(a).all()
            t = res["traffic"]
            if codec is None:
                assert t["bytes_sent"] == t["raw_bytes"] == 0
            else:
                low, high = {"bf16": (1.9, 2.0), "int8:block=64": (3.0, 4.0)}[codec]
                assert low <= t["compression_ratio"] <= high, (codec, t)
        ours, theirs = run[("bf16_params", "int8:block=64")], run[("bf16_params", None)]
        for a, b in zip(ours["seen"], theirs["seen"]):
            assert torch.equal(a, b)
        assert ours["traffic"]["compression_ratio"] == 1.0 and ours["traffic"]["bytes_sent"] > 0
        assert "param_codec" in run["refused"] and "sign" in run["refused"]


def lowrank_compressed(shape, rank=lr.RANK) -> bool:
    """Whether lowrank approximates a tensor: two rank-r factors of its (shape[0], -1) matrix hold
    under half of its elements (1-D tensors never)."""
    if len(shape) < 2:
        return False
    rows, cols = shape[0], math.prod(shape) // shape[0]
    r = min(rows, cols, rank)
    return 2 * r * (rows + cols) < rows * cols


def test_lowrank_shards_are_rows_of_the_float64_average(session):
    """Stacked in rank order, the ranks' sharded gradients (FSDP's dim-0 chunks, padding left out)
    are the whole average of test_lowrank's float64 power iteration (each Q seeded by the
    parameter's name, error feedback), step after step; at W = 2 the DDP hook's reduction
    (SimulatedWorkers) bit for bit."""
    world, outdir = session
    runs = load(outdir, "lowrank", world)
    names = runs[0]["names"]
    assert all(run["names"] == names for run in runs)
    ref = reference(lr.SHAPES, names, world, LOWRANK_STEPS, lr.RANK)
    sim = SimulatedWorkers(LOWRANK, world, min_compress_numel=0)
    for step in range(LOWRANK_STEPS):
        every = [torch.cat([g.reshape(-1) for g in lr.grads(lr.SHAPES, step, r)])
                 for r in range(world)]
        sims = sim.reduce(every, shapes=lr.SHAPES, keys=names).split(
            [math.prod(s) for s in lr.SHAPES])
        for i, shape in enumerate(lr.SHAPES):
            rows = -(-shape[0] // world)
            shards = [run["grads"][step][i] for run in runs]
            assert [s.shape[0] for s in shards] == [
                max(0, min(rows, shape[0] - r * rows)) for r in range(world)]
            got = torch.cat(shards)
            err = rel(got, ref[step][i])
            assert err < 2e-5, f"step {step} {shape}: relative error {err:.2e}"
            if world == 2:
                assert torch.equal(got, sims[i].reshape(shape)), f"step {step} {shape}"


def test_lowrank_error_feedback_and_q_over_steps(session):
    """Each rank's residual after each step is M - P Q^T / W of its own M = g / W + its previous
    residual (P Q^T: the reference's average; tensors sent uncompressed keep none), on the
    unsharded gradient; the Q factors are the same on every rank."""
    world, outdir = session
    runs = load(outdir, "lowrank", world)
    ref = reference(lr.SHAPES, runs[0]["names"], world, LOWRANK_STEPS, lr.RANK)
    for w, run in enumerate(runs):
        e = [torch.zeros(s, dtype=torch.float64) for s in lr.SHAPES]
        for step in range(LOWRANK_STEPS):
            saved = run["state"][step]
            residuals = torch.cat([saved[k]["residual"] for k in sorted(saved)]).split(
                [math.prod(s) for s in lr.SHAPES])
            for i, (shape, g) in enumerate(zip(lr.SHAPES, lr.grads(lr.SHAPES, step, w))):
                m = g.double() / world + e[i]
                if lowrank_compressed(shape):
                    e[i] = m - ref[step][i] / world
                got = residuals[i].double().reshape(shape)
                assert (got - e[i]).norm() <= 1e-5 * m.norm(), f"rank {w} step {step} {shape}"
            for k, d in saved.items():
                assert torch.equal(d["q"], runs[0]["state"][step][k]["q"]), (w, step, k)
        assert any(lowrank_compressed(s) and e[i].norm() > 0 for i, s in enumerate(lr.SHAPES))


def test_lowrank_counts_its_two_allreduces(session):
    """Per parameter group, the two fp32 all-reduces of the DDP hook's bucket of the same
    parameters (P with the uncompressed tensors, then Q): what gradzip.costmodel counts."""
    world, outdir = session
    stats = load(outdir, "lowrank", world)[0]["stats"]
    assert stats["compressed_buckets"] == stats["buckets"] == len(sc.LOWRANK_GROUPS)
    codec = Codec.parse(LOWRANK)
    expect = sum(bucket_cost(codec, shapes, world, Link(10.0), min_compress_numel=0).sent_bytes
                 for shapes in sc.LOWRANK_GROUPS)
    # the model counts fractional bytes per ring step; the stats whole bytes per all-reduce
    assert stats["bytes_sent"] == pytest.approx(expect, abs=2 * len(sc.LOWRANK_GROUPS))
    assert stats["bytes_received"] == stats["bytes_sent"]
    assert stats["compression_ratio"] > 1.5


def test_lowrank_needs_dim0_shards(session):
    world, outdir = session
    for run in load(outdir, "lowrank", world):
        msg = run["refused"]
        assert "dim 0" in msg and "blocks.2.ps.1" in msg, msg


@pytest.mark.parametrize("spec,part", [("lowrank", "needs its rank"), ("lowrank:0", "'0'"),
                                       ("lowrank:x", "'x'"), ("lowrank:2:1", "'2:1'")])
def test_bad_lowrank_specs_raise(spec, part):
    with pytest.raises(ValueError, match=part):
        FSDPCompressionState(spec)
