"""The two-level reduction (gradzip.two_level) on real multi-process Gloo, 2 nodes x 2 ranks and
3 nodes x 2 ranks: bitwise-identical replicas; fp32 equal to the float64 average of every rank's
gradient; top-k's sent sum plus the residuals left equal to the float64 sum of the averages
(error feedback's invariant, from the raw gradients); every compressed shard equal bit for bit to
the flat reduction of the nodes' averages (SimulatedWorkers over N workers); exact resume from a
checkpoint and from a pickle; a node layout that does not divide the world refused on every rank."""

import math
import os

import pytest
import torch

import two_level_scenarios as sc
from dist_util import run_ranks
from gradzip.simulation import SimulatedWorkers
from gradzip.two_level import TwoLevelState, shard_layout

R = 2  # ranks per node: a sum of two is the same in any order, so the node average is reproducible
CODECS = ["fp32", "int8", "sign:block=64", "topk:0.1", "bf16"]
TRAIN = [(c.replace(":", "_").replace(".", ""), {"codec": c, "ranks_per_node": R, "steps": 4})
         for c in CODECS]
TRAIN.append(("int8_uncompressed", {"codec": "int8", "ranks_per_node": R, "steps": 4,
                                    "uncompressed_numel": 300}))
RESUME = [(c.replace(":", "_").replace(".", ""), {"codec": c, "ranks_per_node": R})
          for c in ("int8", "topk:0.1")]

OVERFLOW = ["int8", "topk:0.1"]


@pytest.fixture(scope="module", params=[4, 6], ids=lambda w: f"{w // R}x{R}")
def session(request, tmp_path_factory):
    world = request.param
    outdir = tmp_path_factory.mktemp(f"two_level{world}")
    plan = [("train", (TRAIN,)), ("checkpoint_resume", (RESUME,)), ("overflow", (OVERFLOW, R)),
            ("bad_layout", (4,))]  # last: it leaves a DDP mid-backward
    run_ranks(sc.session, world, str(outdir), plan, timeout=420)
    return world, outdir


def load(outdir, name, world):
    return [torch.load(os.path.join(outdir, f"{name}_{r}.pt"), weights_only=False)
            for r in range(world)]


def sorted_records(runs):
    # records arrive in completion order, which differs between ranks: order by (step, bucket)
    return [sorted(run["records"], key=lambda rec: rec[0][:2]) for run in runs]


@pytest.mark.parametrize("name,cfg", TRAIN, ids=[n for n, _ in TRAIN])
def test_replicas_identical_and_shards_equal_flat_reduction(session, name, cfg):
    world, outdir = session
    runs = load(outdir, name, world)
    for r in range(1, world):
        for a, b in zip(runs[0]["params"], runs[r]["params"]):
            assert torch.equal(a, b), f"{name}: replica {r} differs from replica 0"
    recs = sorted_records(runs)
    nodes = world // R
    # the simulation's node layout: one flat reduction over the N nodes per local rank (its
    # shards), fed the nodes' averages
    sim = SimulatedWorkers(cfg["codec"], world, min_compress_numel=32, warmup_steps=1,
                           uncompressed_numel=cfg.get("uncompressed_numel", 0), ranks_per_node=R)
    for k, (key, _, out0, params) in enumerate(recs[0]):
        step, index, shapes = key
        for r in range(1, world):
            assert recs[r][k][0] == key
            assert torch.equal(recs[r][k][2], out0), f"{name}: rank {r} bucket {index} differs"
        inputs = torch.stack([recs[r][k][1] for r in range(world)])
        mean = inputs.double().mean(0)
        if step == 0 or cfg["codec"] == "fp32":  # uncompressed: the average to fp32 rounding
            torch.testing.assert_close(out0.double(), mean, rtol=1e-5, atol=1e-7)
            continue
        sim.step = step
        expected = sim.reduce(list(inputs), bucket_index=index, shapes=shapes, keys=params)
        if cfg["codec"] == "bf16":
            # summed in bf16 by Gloo: |payload| <= (1 + u) |node average| / N, each sum, Gloo's
            # and the simulation's, within (N - 1) u of the payloads' magnitude
            node_avg = inputs.view(nodes, R, -1).sum(1) / R
            err = (out0.double() - expected.double()).abs()
            u = 2.0 ** -8
            assert (err <= 2.1 * (nodes - 1) * u * node_avg.double().abs().sum(0) / nodes
                    + nodes * 2.0 ** -24).all()
        else:
            assert torch.equal(out0, expected), f"{name}: step {step} bucket {index}"


def test_topk_error_feedback_invariant_in_float64(session):
    """Top-k all-gathers what each node's rank sends: over the compressed steps, the averages the
    hook returned plus what the nodes' residuals hold equal the sum of the true averages of every
    rank's gradient, computed here in float64 from the raw gradients."""
    world, outdir = session
    runs = load(outdir, "topk_01", world)
    recs = sorted_records(runs)
    param_of_key = runs[0]["param_of_key"]
    shapes = {}
    sent, true = {}, {}
    for k, (key, _, out0, params) in enumerate(recs[0]):
        step, _, bucket_shapes = key
        if step == 0:  # uncompressed, before any residual
            continue
        mean = torch.stack([recs[r][k][1] for r in range(world)]).double().mean(0)
        off = 0
        for pk, shape in zip(params, bucket_shapes):
            m = math.prod(shape)
            shapes[pk] = m
            sent[pk] = sent.get(pk, 0) + out0[off:off + m].double()
            true[pk] = true.get(pk, 0) + mean[off:off + m]
            off += m
    assert sent, "no compressed step recorded"
    left = {pk: torch.zeros(m, dtype=torch.float64) for pk, m in shapes.items()}
    for run in runs:  # every node's residual pieces, summed over the nodes
        for piece_key, values in run["pieces"].items():
            pk, start = piece_key
            if pk == "padding":
                continue
            left[pk][start:start + values.numel()] += values.double()
    for pk in sent:
        torch.testing.assert_close(sent[pk] + left[pk], true[pk], rtol=1e-5, atol=1e-6,
                                   msg=f"parameter {param_of_key[pk]}")
    assert any(float(v.abs().max()) > 0 for v in left.values()), "top-k left nothing behind?"


@pytest.mark.parametrize("name", [n for n, _ in RESUME])
def test_checkpoint_and_pickle_resume_exactly(session, name):
    world, outdir = session
    for run in load(outdir, f"resume_{name}", world):
        for how in ("state_dict", "pickle"):
            for a, b in zip(run["uninterrupted"], run[how]):
                assert torch.equal(a, b), f"{name}: resumed from {how} differs"


@pytest.mark.parametrize("codec", OVERFLOW)
def test_inf_gradient_on_one_rank_skips_the_step_everywhere_and_keeps_residuals(session, codec):
    """An AMP overflow on one rank of one node: every rank's bucket holds the non-finite average
    (the all-gather spreads the node's shard), GradScaler skips the step on every rank, and every
    rank's residuals stay as they were before it (the guard decides on the whole bucket)."""
    world, outdir = session
    runs = load(outdir, f"overflow_two_level_{codec}", world)
    for run in runs:
        log = run["log"]
        assert [e["finite"] for e in log] == [True, True, False, True, True]
        assert log[2]["params_unchanged"] and log[2]["residuals_unchanged"]
        assert log[2]["scale_after"] < log[2]["scale_before"]
        assert all(e["residuals_finite"] for e in log)
        assert not log[3]["params_unchanged"]
    for r in range(1, world):
        for a, b in zip(runs[0]["params"], runs[r]["params"]):
            assert torch.equal(a, b)


def test_layout_that_does_not_divide_the_world_is_refused(session):
    world, outdir = session
    errors = load(outdir, "bad_layout", world)
    if world % 4 == 0:
        pytest.skip("4 ranks per node divide this world")
    assert all(e is not None and "does not divide" in e for e in errors), errors


def test_stats_count_the_inter_node_reduction(session):
    world, outdir = session
    stats = load(outdir, "int8", world)[0]["stats"]
    assert stats["bytes_sent"] > 0 and stats["compression_ratio"] > 2.0, stats


def test_unsupported_settings_are_refused_at_construction():
    from gradzip.optim import FrozenVarianceAdamW
    opt = FrozenVarianceAdamW([torch.nn.Parameter(torch.zeros(3))], lr=1e-3)
    with pytest.raises(ValueError, match="one state"):
        TwoLevelState("sign", ranks_per_node=2, optimizer=opt, warmup_steps=1)
    with pytest.raises(ValueError, match="matrices"):
        TwoLevelState("lowrank:2", ranks_per_node=2)
    with pytest.raises(TypeError, match="process_group"):
        TwoLevelState("int8", ranks_per_node=2, process_group=None)
    with pytest.raises(ValueError, match=">= 1"):
        TwoLevelState("int8", ranks_per_node=0)


def test_shard_layout_cuts_parameters_and_pads():
    layout = (10, ((0, (2, 3)), (1, (4,))))  # a 2x3 weight and a bias, 10 elements
    assert shard_layout(layout, 0, 4) == (4, (((0, 0), (1, 4)),))
    assert shard_layout(layout, 1, 4) == (4, (((0, 4), (1, 2)), ((1, 0), (2,))))
    assert shard_layout(layout, 2, 4) == (4, (((1, 2), (2,)), (("padding", 10), (2,))))
    assert shard_layout((7, ()), 1, 4) == (4, ())
