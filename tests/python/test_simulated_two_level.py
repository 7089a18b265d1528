"""SimulatedWorkers with a node layout (ranks_per_node): the two-level reduction in one process.
Bit for bit against the multi-rank hook in test_two_level.py; here, against float64 written in the
test: fp32 is the mean; top-k's sent sums plus the residuals the nodes hold telescope to T times
the mean; an overflow anywhere undoes every shard's updates; exact resume; refusals."""

import pickle

import pytest
import torch

from gradzip.simulation import SimulatedWorkers


def grads(world, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) * (1 + r) for r in range(world)]


def node_residuals(sim, n):
    """Each node's residual of the whole bucket (its local ranks' shards, in order), float64."""
    r = sim.ranks_per_node
    return [torch.cat([sim.residuals(node * r + local)[0] for local in range(r)])[:n].double()
            for node in range(sim.world_size // r)]


@pytest.mark.parametrize("world,r,n", [(4, 2, 1001), (6, 3, 997), (6, 2, 130)])
def test_fp32_is_the_mean(world, r, n):
    sim = SimulatedWorkers("fp32", world, ranks_per_node=r, min_compress_numel=32)
    gs = grads(world, n)
    out = sim.reduce(gs, numels=[n - 7, 7])
    torch.testing.assert_close(out.double(), torch.stack(gs).double().mean(0), rtol=1e-6,
                               atol=1e-7)


@pytest.mark.parametrize("world,r", [(4, 2), (6, 3)])
def test_topk_sent_sums_and_node_residuals_telescope(world, r):
    """Top-k all-gathers its messages (decoded sums exact): over T steps the outputs plus what the
    nodes' residuals hold equal T x the float64 mean of every rank's gradient."""
    n, steps = 1503, 12
    sim = SimulatedWorkers("topk:0.05", world, ranks_per_node=r, min_compress_numel=32)
    total = torch.zeros(n, dtype=torch.float64)
    mean_sum = torch.zeros(n, dtype=torch.float64)
    for s in range(steps):
        gs = grads(world, n, seed=s)
        total += sim.reduce(gs, numels=[1000, 503]).double()
        mean_sum += torch.stack(gs).double().mean(0)
    held = sum(node_residuals(sim, n))
    assert held.abs().max() > 0.1  # the residuals hold what is not sent yet
    torch.testing.assert_close(total + held, mean_sum, rtol=0, atol=1e-4 * steps)


def test_an_overflow_anywhere_undoes_every_shards_updates():
    world, r = 4, 2
    sim = SimulatedWorkers("int8:block=32", world, ranks_per_node=r, min_compress_numel=32)
    sim.reduce(grads(world, 200, seed=1), bucket_index=0, is_last=False)
    sim.reduce(grads(world, 90, seed=2), bucket_index=1)
    before = [[t.clone() for t in sim.residuals(k)] for k in range(world)]
    sim.reduce(grads(world, 200, seed=3), bucket_index=0, is_last=False)  # finite
    bad = grads(world, 90, seed=4)
    bad[3][5] = float("inf")  # node 1, local rank 1: shard 0 of bucket 1 is finite
    assert not torch.isfinite(sim.reduce(bad, bucket_index=1)).all()
    assert sim.step == 2
    for k in range(world):
        for a, b in zip(before[k], sim.residuals(k)):
            assert torch.equal(a, b), f"rank {k}: a residual kept the overflow step's update"
    assert torch.isfinite(sim.reduce(grads(world, 200, seed=5), bucket_index=0)).all()


@pytest.mark.parametrize("codec", ["int8", "sign", "topk:0.1"])
def test_state_dict_resumes_exactly(codec):
    world, r, n = 4, 2, 777
    a = SimulatedWorkers(codec, world, ranks_per_node=r, warmup_steps=1,
                          min_compress_numel=32)
    for s in range(3):
        a.reduce(grads(world, n, seed=s))
    snap = pickle.loads(pickle.dumps(a.state_dict()))
    b = SimulatedWorkers(codec, world, ranks_per_node=r, warmup_steps=1,
                          min_compress_numel=32)
    b.load_state_dict(snap)
    for s in range(3, 6):
        assert torch.equal(a.reduce(grads(world, n, seed=s)), b.reduce(grads(world, n, seed=s)))
    with pytest.raises(ValueError, match="per node"):
        SimulatedWorkers(codec, world, warmup_steps=1).load_state_dict(snap)


def test_stats_are_the_inter_node_reduction_of_one_shard():
    two = SimulatedWorkers("int8", 4, ranks_per_node=2, min_compress_numel=32)
    two.reduce(grads(4, 2000))
    # the 2 nodes' reduction of a 1000-element shard
    flat = SimulatedWorkers("int8", 2, min_compress_numel=32)
    flat.reduce(grads(2, 1000))
    assert two.stats == flat.stats


def test_refused_layouts_and_settings():
    from gradzip.optim import FrozenVarianceAdamW
    with pytest.raises(ValueError, match="divide"):
        SimulatedWorkers("int8", 6, ranks_per_node=4)
    with pytest.raises(ValueError, match="divide"):
        SimulatedWorkers("int8", 4, ranks_per_node=0)
    with pytest.raises(ValueError, match="matrices"):
        SimulatedWorkers("lowrank:2", 4, ranks_per_node=2)
    opt = FrozenVarianceAdamW([torch.nn.Parameter(torch.zeros(3))], lr=1e-3)
    with pytest.raises(ValueError, match="one state"):
        SimulatedWorkers("sign", 4, ranks_per_node=2, optimizer=opt, warmup_steps=1)
