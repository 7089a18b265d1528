"""The harness's simulated W-worker reduction equals real DDP ranks running compress_hook on the
same gradients, bit for bit, over several steps with error feedback; and its bucketing and
traffic accounting."""
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from dist_util import run_ranks
from gradzip_converge.compression import Reducer, baseline_or_codec, bucket_bounds
from gradzip.wire import MIN_COMPRESS_NUMEL

N = 20011  # one parameter, odd size: one DDP bucket, shards of unequal size
STEPS = 3
CODECS = ["fp32", "bf16", "int8", "sign", "topk:0.01"]


def step_grad(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(N, generator=g) * (1 + step)


class Dot(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.p = torch.nn.Parameter(torch.zeros(N))

    def forward(self, g):
        return (self.p * g).sum()  # d/dp = g: the rank's gradient is exactly g


def _ddp_ranks(rank, world, codec, out_dir):
    from gradzip.ddp import CompressionState, compress_hook

    ddp = DDP(Dot())
    p = ddp.module.p
    state = CompressionState(codec, **baseline_or_codec(codec, error_feedback=True))
    ddp.register_comm_hook(state, compress_hook)
    results = []
    for step in range(STEPS):
        p.grad = None
        ddp(step_grad(step, rank)).backward()
        results.append((p.grad.clone(), state.stats["bytes_sent"]))
    torch.save(results, f"{out_dir}/rank{rank}.pt")


@pytest.mark.parametrize("codec", CODECS)
def test_simulated_workers_equal_ddp_hook(tmp_path, codec):
    world = 2
    run_ranks(_ddp_ranks, world, codec, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    reducer = Reducer(codec, world, error_feedback=True, param_numels=[N])
    for step in range(STEPS):
        sim = reducer.reduce([step_grad(step, r) for r in range(world)])
        for r in range(world):
            grad, sent = ranks[r][step]
            assert torch.equal(grad, sim), (codec, step, r)
        assert reducer.bytes_per_step == ranks[0][step][1]
    if codec == "fp32":
        assert reducer.bytes_per_step == reducer.raw_bytes_per_step == 2 * (world - 1) * N * 4 // world
    else:
        assert reducer.bytes_per_step < reducer.raw_bytes_per_step


def test_buckets_follow_ddp_order_and_cap():
    # 4-byte elements, filled from the last parameter backwards, closed once at or over the cap
    assert bucket_bounds([3, 4, 5, 6], 40, 40) == [(7, 18), (0, 7)]
    assert bucket_bounds([3, 4, 5, 6], 40, 16) == [(12, 18), (0, 12)]  # small first bucket
    assert bucket_bounds([3, 4, 5, 6], 1 << 20) == [(0, 18)]
    assert bucket_bounds([30, 2], 40, 4) == [(30, 32), (0, 30)]
    assert torch.distributed._DEFAULT_FIRST_BUCKET_BYTES == 1 << 20  # what bucket_bounds assumes


def test_bucketed_reduction_matches_per_bucket_simulation():
    from gradzip.simulation import SimulatedWorkers

    numels = [3000, 5000, 7001, 100]
    gs = [torch.randn(sum(numels), generator=torch.Generator().manual_seed(r)) for r in range(3)]
    red = Reducer("int8", 3, param_numels=numels, bucket_cap_mb=4000 * 4 / 2**20,
                  first_bucket_bytes=4 * 7000)
    out = red.reduce(gs)
    bounds = bucket_bounds(numels, red.cap_bytes, red.first_bucket_bytes)
    assert bounds == [(8000, 15101), (3000, 8000), (0, 3000)]
    inside = [[7001, 100], [5000], [3000]]  # the tensors of each bucket: int8 blocks restart there
    sent = 0
    for i, (a, b) in enumerate(bounds):
        ref = SimulatedWorkers("int8", 3, min_compress_numel=MIN_COMPRESS_NUMEL)
        assert torch.equal(out[a:b], ref.reduce([g[a:b] for g in gs], bucket_index=i,
                                                numels=inside[i]))
        sent += ref.stats["bytes_sent"]
    assert red.bytes_per_step == sent
    with pytest.raises(ValueError, match="expected 3"):
        red.reduce(gs[:2])
    with pytest.raises(ValueError, match="parameters"):
        red.reduce([g[:-1] for g in gs])


def test_uncompressed_tensors_per_run():
    """``--uncompressed-numel N`` reaches the simulated reduction (the bias travels in fp32: its
    average is the fp32 sum of g / 2, its bytes counted) and names the run."""
    from dataclasses import replace

    from gradzip_converge.cli import overrides, parse_args
    from gradzip_converge.training import RunConfig

    shapes = [(100, 50), (70,)]  # a bias of 64 elements or more: compressed without the option
    gs = [torch.randn(5070, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    plain = Reducer("int8", 2, param_shapes=shapes)
    exact = Reducer("int8", 2, param_shapes=shapes, uncompressed_numel=1)
    out, ref = exact.reduce(gs), plain.reduce(gs)
    assert torch.equal(out[5000:], gs[0][5000:] * 0.5 + gs[1][5000:] * 0.5)
    assert not torch.equal(ref[5000:], out[5000:])
    assert exact.bytes_per_step > plain.bytes_per_step
    cfg = replace(RunConfig(), **overrides(parse_args(["--uncompressed-numel", "4096"])))
    assert cfg.uncompressed_numel == 4096 and replace(cfg, codec="int8").name == "int8+u4096"


def test_two_level_runs_reduce_each_bucket_as_the_simulated_node_layout():
    """ranks_per_node: every bucket of a step through SimulatedWorkers' two-level reduction (one
    simulation, the step ended by the last bucket); the fp32 baseline stays the flat average."""
    from gradzip.simulation import SimulatedWorkers

    numels = [30000, 50000, 70001, 100]  # shards above MIN_COMPRESS_NUMEL
    red = Reducer("int8", 4, param_numels=numels, bucket_cap_mb=40000 * 4 / 2**20,
                  first_bucket_bytes=4 * 70000, ranks_per_node=2)
    ref = SimulatedWorkers("int8", 4, min_compress_numel=MIN_COMPRESS_NUMEL, ranks_per_node=2)
    bounds = bucket_bounds(numels, red.cap_bytes, red.first_bucket_bytes)
    inside = [[70001, 100], [50000], [30000]]
    for step in range(2):
        gs = [torch.randn(sum(numels), generator=torch.Generator().manual_seed(10 * step + r))
              for r in range(4)]
        out = red.reduce(gs)
        for i, (a, b) in enumerate(bounds):
            assert torch.equal(out[a:b], ref.reduce([g[a:b] for g in gs], bucket_index=i,
                                                    numels=inside[i],
                                                    is_last=i == len(bounds) - 1))
        assert red.bytes_per_step == ref.stats["bytes_sent"]
    flat = Reducer("int8", 4, param_numels=numels, bucket_cap_mb=40000 * 4 / 2**20,
                   first_bucket_bytes=4 * 70000)
    flat.reduce(gs)
    # a rank sends its half of the bucket to one other node, not 3/4 of it to three other ranks
    assert red.bytes_per_step < flat.bytes_per_step / 2
    base = Reducer("fp32", 4, param_numels=numels, ranks_per_node=2)
    assert base._sim.ranks_per_node == 1
