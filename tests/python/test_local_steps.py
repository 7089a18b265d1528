"""gradzip.local_steps: the outer loop against a float64 reference written here, its guarantees
(every replica restarts from the same bits, error feedback keeps the outer gradient's sum, an exact
resume), its errors, and the multi-rank sync equal to the simulation on real Gloo ranks."""

import copy
import math

import pytest
import torch

from dist_util import run_ranks
from gradzip.local_steps import LocalSteps, SimulatedLocalSteps, bucket_ranges

SHAPES = [(37, 5), (5,), (211,), (3, 7, 2)]  # odd sizes, several buckets with a small cap


def make_replicas(world, seed=0):
    g = torch.Generator().manual_seed(seed)
    start = [torch.randn(s, generator=g) for s in SHAPES]
    return [[torch.nn.Parameter(t.clone()) for t in start] for _ in range(world)]


def local_moves(replicas, g, scale=1e-2):
    """Stands in for each rank's inner optimizer steps: a different random move per replica."""
    with torch.no_grad():
        for params in replicas:
            for p in params:
                p.add_(torch.randn(p.shape, generator=g), alpha=scale)


def test_bucket_ranges_cover_every_parameter_once():
    assert bucket_ranges([10, 10, 10], 4 * 15) == [(0, 2), (2, 3)]
    assert bucket_ranges([100], 1) == [(0, 1)]
    assert bucket_ranges([3, 4, 5], 1 << 30) == [(0, 3)]


@pytest.mark.parametrize("momentum,nesterov", [(0.9, True), (0.5, False), (0.0, False)])
def test_lossless_outer_loop_against_float64(momentum, nesterov):
    """fp32 outer gradient, 3 replicas, H = 3: after each sync the anchor is
    anchor - lr * (avg + momentum * v) (Nesterov) or anchor - lr * v, v = momentum * v + avg,
    avg = mean over replicas of (anchor - params), computed in float64 here; every replica then
    holds the anchor."""
    world, lr, sync_every = 3, 0.7, 3
    replicas = make_replicas(world)
    outer = SimulatedLocalSteps(replicas, "fp32", sync_every=sync_every, outer_lr=lr,
                                outer_momentum=momentum, nesterov=nesterov, bucket_cap_mb=1e-3)
    assert len(outer.buckets) > 1
    anchor = [p.detach().double().clone() for p in replicas[0]]
    velocity = [torch.zeros_like(a) for a in anchor]
    g = torch.Generator().manual_seed(1)
    for step in range(1, 13):
        local_moves(replicas, g)
        if step % sync_every == 0:
            for i, a in enumerate(anchor):
                avg = sum(a - r[i].detach().double() for r in replicas) / world
                if step == sync_every or momentum == 0.0:
                    velocity[i] = avg.clone() if momentum else velocity[i]
                else:
                    velocity[i] = momentum * velocity[i] + avg
                update = avg + momentum * velocity[i] if nesterov else (
                    velocity[i] if momentum else avg)
                anchor[i] = a - lr * update
        assert outer.step() == (step % sync_every == 0)
        if step % sync_every == 0:
            for i, a in enumerate(anchor):
                for r in replicas:
                    torch.testing.assert_close(r[i].detach().double(), a, rtol=1e-5, atol=1e-6)
            assert all(torch.equal(p, q) for r in replicas[1:] for p, q in zip(r, replicas[0]))
    assert outer.syncs == 4 and outer.steps == 12


def test_compressed_sync_error_feedback_keeps_the_sum():
    """Top-k (all-gathered: the average is the sum of what each replica sent), outer_lr 1, no
    momentum: the anchor moves by exactly the averaged compressed outer gradient each sync, and
    what the syncs moved plus the replicas' residuals equals the sum of the true averaged outer
    gradients (float64), to float32 rounding."""
    world = 2
    replicas = make_replicas(world, seed=2)
    outer = SimulatedLocalSteps(replicas, "topk:0.05", sync_every=1, outer_lr=1.0,
                                outer_momentum=0.0, nesterov=False, min_compress_numel=0,
                                bucket_cap_mb=1e-3)

    def flat(params):
        return torch.cat([p.detach().double().reshape(-1) for p in params])

    start, true_sum = flat(replicas[0]), 0.0
    g = torch.Generator().manual_seed(3)
    for _ in range(6):
        anchor = flat(replicas[0])
        local_moves(replicas, g)
        true_sum = true_sum + sum(anchor - flat(r) for r in replicas) / world
        outer.step()
        assert all(torch.equal(p, q) for p, q in zip(replicas[0], replicas[1]))
    moved = start - flat(replicas[0])
    residual = sum(torch.cat([t.double() for t in outer.reduction.residuals(r)])
                   for r in range(world))
    assert outer.stats["compression_ratio"] > 3.0
    assert (moved - true_sum).abs().max() > 1e-3  # the codec did drop something ...
    torch.testing.assert_close(moved + residual, true_sum, rtol=0, atol=1e-5)  # ... and kept it


@pytest.mark.parametrize("world", [2, 3])
def test_residual_decay_against_float64(world):
    """SparseLoCo's error feedback as momentum, with top-k (fp32 values, all-gathered: the average
    is the sum of what every replica sent), outer_lr 1 and no momentum: each sync sends, per
    replica, the k largest of c = outer gradient / W + e, the anchor moves by the sum of what was
    sent, and e = beta * (c - sent), in float64 over five syncs."""
    beta, ratio = 0.8, 0.05
    replicas = make_replicas(world, seed=4)
    outer = SimulatedLocalSteps(replicas, f"topk:{ratio}", sync_every=1, outer_lr=1.0,
                                outer_momentum=0.0, nesterov=False, min_compress_numel=0,
                                residual_decay=beta)

    def flat(params):
        return torch.cat([p.detach().double().reshape(-1) for p in params])

    anchor = flat(replicas[0])
    n = anchor.numel()
    k = math.ceil(ratio * n)  # one bucket
    residuals = [torch.zeros(n, dtype=torch.float64) for _ in range(world)]
    g = torch.Generator().manual_seed(5)
    for _ in range(5):
        local_moves(replicas, g, scale=0.1)
        avg = torch.zeros(n, dtype=torch.float64)
        for r in range(world):
            c = (anchor - flat(replicas[r])) / world + residuals[r]
            sent = torch.zeros_like(c)
            keep = c.abs().argsort(descending=True)[:k]
            sent[keep] = c[keep]
            avg += sent
            residuals[r] = beta * (c - sent)
        anchor = anchor - avg
        assert outer.step()
        for r in range(world):
            torch.testing.assert_close(flat(replicas[r]), anchor, rtol=0, atol=1e-5)
            torch.testing.assert_close(torch.cat([t.double() for t in outer.reduction.residuals(r)]),
                                       residuals[r], rtol=0, atol=1e-6)
    assert residuals[0].abs().max() > 1e-2  # top-k left something to decay


def test_resume_is_exact():
    world, H = 2, 2
    first = make_replicas(world, seed=4)
    second = copy.deepcopy(first)
    a = SimulatedLocalSteps(first, "int8", sync_every=H, min_compress_numel=0)
    g = torch.Generator().manual_seed(5)
    for _ in range(5):
        local_moves(first, g)
        a.step()
    saved_state, saved_params = copy.deepcopy(a.state_dict()), copy.deepcopy(first)
    for _ in range(5):
        local_moves(first, g)
        a.step()
    resumed = make_replicas(world, seed=4)  # a new process builds the replicas afresh ...
    b = SimulatedLocalSteps(resumed, "int8", sync_every=H, min_compress_numel=0)
    with torch.no_grad():  # ... and loads them (mid-interval: they differ) and the outer state
        for r, s in zip(resumed, saved_params):
            for p, q in zip(r, s):
                p.copy_(q)
    b.load_state_dict(saved_state)
    g = torch.Generator().manual_seed(5)
    for _ in range(5):
        local_moves(second, g)  # replays the generator to where the saved run was
    for _ in range(5):
        local_moves(resumed, g)
        b.step()
    assert all(torch.equal(p, q) for r, s in zip(first, resumed) for p, q in zip(r, s))
    assert b.syncs == a.syncs == 5


def test_bad_settings_and_diverged_replicas_are_refused():
    replicas = make_replicas(2)
    with pytest.raises(ValueError, match="sync_every"):
        SimulatedLocalSteps(replicas, "int8", sync_every=0)
    with pytest.raises(ValueError, match="nesterov"):
        SimulatedLocalSteps(replicas, "int8", outer_momentum=0.0)
    with pytest.raises(ValueError, match="residual_decay"):
        SimulatedLocalSteps(replicas, "int8", residual_decay=0.0)
    with pytest.raises(ValueError, match="error_feedback"):
        SimulatedLocalSteps(replicas, "int8", residual_decay=0.9, error_feedback=False)
    with pytest.raises(ValueError, match="codec|spec"):
        SimulatedLocalSteps(replicas, "int9")
    other = make_replicas(2, seed=9)
    with pytest.raises(ValueError, match="same values"):
        SimulatedLocalSteps([replicas[0], other[1]], "int8")
    outer = SimulatedLocalSteps(replicas, "int8", sync_every=1, min_compress_numel=0)
    anchor = [a.clone() for a in outer.anchor]
    with torch.no_grad():
        replicas[1][0][0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="not finite"):
        outer.step()
    assert all(torch.equal(a, b) for a, b in zip(outer.anchor, anchor))
    state = outer.state_dict()
    with pytest.raises(ValueError, match="sync_every"):
        SimulatedLocalSteps(make_replicas(2), "int8", sync_every=3).load_state_dict(state)


def _ranks_match_the_simulation(rank, world, codec, decay):
    import torch.distributed as dist

    replicas = make_replicas(world, seed=6)
    mine = replicas[rank]
    if rank:  # the constructor broadcasts rank 0's parameters
        with torch.no_grad():
            for p in mine:
                p.add_(1.0)
    outer = LocalSteps(mine, codec, sync_every=2, bucket_cap_mb=1e-3, min_compress_numel=0,
                       residual_decay=decay)
    sim_replicas = make_replicas(world, seed=6)
    sim = SimulatedLocalSteps(sim_replicas, codec, sync_every=2, bucket_cap_mb=1e-3,
                              min_compress_numel=0, residual_decay=decay)
    g = torch.Generator().manual_seed(7)
    for _ in range(6):
        local_moves(sim_replicas, g)
        with torch.no_grad():
            for p, q in zip(mine, sim_replicas[rank]):
                p.copy_(q)
        synced = outer.step()
        assert synced == sim.step()
        if synced:
            for p, q in zip(mine, sim_replicas[0]):
                assert torch.equal(p, q), "the rank's parameters differ from the simulation's"
            flat = torch.cat([p.detach().reshape(-1) for p in mine])
            rows = [torch.empty_like(flat) for _ in range(world)]
            dist.all_gather(rows, flat)
            assert all(torch.equal(r, rows[0]) for r in rows)
    if rank == 0:  # the simulation reports rank 0's traffic
        assert outer.stats["bytes_sent"] == sim.stats["bytes_sent"] > 0


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_end_each_sync_identical_and_equal_to_the_simulation(world):
    run_ranks(_ranks_match_the_simulation, world, "int8", 1.0)


def test_ranks_with_residual_decay_equal_the_simulation():
    """The residuals the DDP state keeps decay as the simulation's: top-k, whose residual is large."""
    run_ranks(_ranks_match_the_simulation, 2, "topk:0.05", 0.8)



def _run(rank, world, path, total, save_at, saved_world):
    """``total`` steps of rank ``rank``'s replica (moves from one generator, the same on every
    rank); saves its parameters and outer state after ``save_at`` steps, or (``saved_world``)
    starts from that checkpoint, saved by ``saved_world`` ranks, instead of training them."""
    import warnings

    import torch.distributed as dist

    replicas = make_replicas(world, seed=8)
    outer = LocalSteps(replicas[rank], "int8", sync_every=2, min_compress_numel=0)
    g = torch.Generator().manual_seed(9)
    start = 0
    if saved_world:
        saved = torch.load(f"{path}.rank{min(rank, saved_world - 1)}", weights_only=False)
        for _ in range(save_at):
            local_moves(replicas, g)  # the generator where the saved run was
        with torch.no_grad():
            for p, q in zip(replicas[rank], saved["params"]):
                p.copy_(q)
        outer.load_state_dict(saved["outer"])
        start = save_at
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(start, total):
            local_moves(replicas, g)
            outer.step()
            if step + 1 == save_at and not saved_world:
                torch.save({"params": [p.detach().clone() for p in replicas[rank]],
                            "outer": outer.state_dict()}, f"{path}.rank{rank}")
    dropped = any("world size" in str(w.message) for w in caught)
    assert dropped == bool(saved_world and saved_world != world)
    flat = torch.cat([p.detach().reshape(-1) for p in replicas[rank]])
    rows = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(rows, flat)
    assert all(torch.equal(r, rows[0]) for r in rows), "the ranks differ after the last sync"
    torch.save(flat, f"{path}.final{world}-{saved_world}.rank{rank}")


def test_ranks_resume_exactly_and_restart_at_another_world_size(tmp_path):
    """2 Gloo ranks, 8 steps (a sync every 2), saved after 5 (mid-interval: the replicas differ);
    resumed from there, the ranks end bit for bit where the uninterrupted run ended; restarted
    on 3 ranks, the residuals are dropped with a warning (the anchor and outer momentum, the same
    on every rank, are kept) and the ranks end every sync identical."""
    path = str(tmp_path / "ckpt")
    run_ranks(_run, 2, path, 8, 5, 0)
    run_ranks(_run, 2, path, 8, 5, 2)
    for r in range(2):
        assert torch.equal(torch.load(f"{path}.final2-0.rank{r}"),
                           torch.load(f"{path}.final2-2.rank{r}"))
    run_ranks(_run, 3, path, 8, 5, 2)
