"""Runs a function on W real Gloo ranks (spawned processes on a free loopback port), with a
timeout so that a hang fails the test instead of blocking the suite."""

import datetime
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, fn, world, port, args):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)  # 2 cores shared by up to 3 ranks
    import gradzip

    gradzip.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        fn(rank, world, *args)
        # Gloo tears a group down while a peer may still be receiving the last collective's
        # data unless every rank is past it: finish together, as a training script should.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world: int, *args, timeout: float = 150.0) -> None:
    """fn(rank, world, *args) on `world` Gloo ranks; raises if a rank fails or time runs out."""
    ctx = mp.spawn(_entry, args=(fn, world, free_port(), args), nprocs=world, join=False)
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"ranks did not finish within {timeout} s (hang?)")
