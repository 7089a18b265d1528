"""What each spawned rank runs in test_lowrank.py: the lowrank:R hook on real Gloo ranks, the
gradients set to known random data (loss = sum(p * c), so p.grad = c), each rank's results saved
to ``outdir`` for the test process to check."""

import os

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel as DDP

from gradzip.ddp import CompressionState, compress_hook
from gradzip.simulation import SimulatedWorkers

# odd shapes: compressed matrices (conv-like 4-D, 3-D, rectangular) and tensors sent uncompressed
# (1-D, a row vector, and matrices where two rank-2 factors would hold half of their elements)
SHAPES = [(7, 13), (5,), (3, 4, 5), (8, 3, 3, 3), (6, 6), (33, 17), (1, 40), (20, 1, 3),
          (40, 30), (9, 11, 2)]
RANK = 2


class Linear(torch.nn.Module):
    """One parameter per shape; the loss sum(p * c) makes p.grad equal to c."""

    def __init__(self, shapes):
        super().__init__()
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(s)) for s in shapes])

    def forward(self, cs):
        return sum((p * c).sum() for p, c in zip(self.ps, cs))


def grads(shapes, step, rank, seed=0):
    """The gradients rank ``rank`` feeds at ``step``: reproducible in any process."""
    g = torch.Generator().manual_seed(1_000_003 * seed + 1009 * step + rank)
    return [torch.randn(s, generator=g) * (1 + i) for i, s in enumerate(shapes)]


def _ddp(shapes, state, hook, bucket_cap_mb=25.0):
    ddp = DDP(Linear(shapes), bucket_cap_mb=bucket_cap_mb)
    ddp.register_comm_hook(state, hook)
    return ddp


def _step(ddp, cs):
    ddp.zero_grad(set_to_none=False)
    ddp(cs).backward()
    return [p.grad.detach().clone() for p in ddp.module.ps]


def _keys(state, ddp):
    """The hook's key of each parameter (its Q's seed), in the model's order."""
    return [state._keys._keys[id(p)] for p in ddp.module.ps]


def reference_run(rank, world, outdir, steps, error_feedback=True, bucket_cap_mb=25.0, seed=0):
    """The hook over ``steps`` steps (the averages every rank holds), and SimulatedWorkers fed with
    every rank's gradients in one bucket, keyed as the hook keys its parameters."""
    state = CompressionState(f"lowrank:{RANK}", error_feedback=error_feedback, min_compress_numel=0)
    ddp = _ddp(SHAPES, state, compress_hook, bucket_cap_mb)
    sim = SimulatedWorkers(f"lowrank:{RANK}", world, error_feedback=error_feedback,
                           min_compress_numel=0)
    outs, sims = [], []
    for step in range(steps):
        outs.append(_step(ddp, grads(SHAPES, step, rank, seed)))
        every = [torch.cat([g.reshape(-1) for g in grads(SHAPES, step, r, seed)])
                 for r in range(world)]
        flat = sim.reduce(every, shapes=SHAPES, keys=_keys(state, ddp))
        sims.append(list(flat.split([g.numel() for g in outs[-1]])))
    torch.save({"outs": outs, "sims": sims, "keys": _keys(state, ddp), "stats": state.stats},
               os.path.join(outdir, f"reference_{bucket_cap_mb}_{rank}.pt"))


def resume(rank, world, outdir, steps=6, cut=3):
    """An uninterrupted run against one that stops at ``cut``, saves the state and goes on in a
    fresh model and CompressionState loaded from it."""
    state = CompressionState(f"lowrank:{RANK}", min_compress_numel=0)
    ddp = _ddp(SHAPES, state, compress_hook, bucket_cap_mb=0.001)
    whole, saved = [], None
    for step in range(steps):
        if step == cut:
            saved = state.state_dict()
        whole.append(_step(ddp, grads(SHAPES, step, rank, seed=7)))
    state2 = CompressionState(f"lowrank:{RANK}", min_compress_numel=0)
    state2.load_state_dict(saved)
    ddp2 = _ddp(SHAPES, state2, compress_hook, bucket_cap_mb=0.001)
    resumed = [_step(ddp2, grads(SHAPES, step, rank, seed=7)) for step in range(cut, steps)]
    torch.save({"whole": whole[cut:], "resumed": resumed}, os.path.join(outdir, f"resume_{rank}.pt"))


# PyTorch's PowerSGD on one matrix with a clear spectral gap, the same on both sides
TORCH_SHAPE = (33, 40)
TORCH_START = 2  # PyTorch's minimum start_powerSGD_iter with warm start / error feedback


def fixed_grad(rank):
    g = torch.Generator().manual_seed(11)
    u = torch.linalg.qr(torch.randn(TORCH_SHAPE[0], 6, generator=g))[0]
    v = torch.linalg.qr(torch.randn(TORCH_SHAPE[1], 6, generator=g))[0]
    s = torch.tensor([10.0, 6.0, 1.0, 0.5, 0.2, 0.1])
    noise = torch.randn(TORCH_SHAPE, generator=torch.Generator().manual_seed(100 + rank))
    return (u * s) @ v.T + 0.01 * noise


def torch_initial_q(rank_r=RANK):
    """The Q PyTorch's hook draws for its first compressed bucket (PowerSGDState(random_seed=0)):
    np.random.RandomState(0).randint(1e9) seeds torch's generator, then randn(1, cols, r)."""
    import numpy as np

    seed = np.random.RandomState(0).randint(1_000_000_000)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.randn(1, TORCH_SHAPE[1], rank_r)


def versus_torch(rank, world, outdir, steps=8, error_feedback=False):
    """gradzip's lowrank:2 and PyTorch's powerSGD_hook (rank 2, same warm start, same first Q)
    on the same fixed gradients: the averages of every step."""
    g = [fixed_grad(rank)]
    ps = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=RANK,
                            start_powerSGD_iter=TORCH_START, use_error_feedback=error_feedback,
                            warm_start=True, min_compression_rate=2)
    theirs = _ddp([TORCH_SHAPE], ps, psgd.powerSGD_hook)
    state = CompressionState(f"lowrank:{RANK}", error_feedback=error_feedback,
                             warmup_steps=TORCH_START, min_compress_numel=0)
    ours = _ddp([TORCH_SHAPE], state, compress_hook)
    a, b = [], []
    for step in range(steps):
        if step == TORCH_START:  # our Q, made at step 0, becomes PyTorch's first one
            (st,) = state._ef.buckets.values()
            st.q.copy_(torch_initial_q().reshape(-1))
        a.append(_step(theirs, g)[0])
        b.append(_step(ours, g)[0])
    torch.save({"torch": a, "gradzip": b},
               os.path.join(outdir, f"torch_{int(error_feedback)}_{rank}.pt"))


def session(rank, world, outdir, plan):
    """Several scenarios in one set of processes (spawning ranks costs seconds each)."""
    for name, kwargs in plan:
        globals()[name](rank, world, outdir, **kwargs)
        dist.barrier()
