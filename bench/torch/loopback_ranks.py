"""W Gloo ranks on this machine's loopback for the bench/torch benchmarks: spawns them, sets each
rank's threads (the machine's cores shared out) and collects what rank 0 reports."""

import datetime
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank, fn, world, port, threads, args, queue):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import gradzip

    per_rank = max(1, threads // world)
    torch.set_num_threads(per_rank)
    gradzip.set_num_threads(per_rank)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    out = fn(rank, world, args)
    if rank == 0:
        queue.put(out)
    dist.barrier()
    dist.destroy_process_group()


def run(fn, world: int, threads: int, args):
    """fn(rank, world, args) on `world` ranks; returns what rank 0's call returned."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_entry, args=(fn, world, port, threads, args, queue), nprocs=world)
    return queue.get()
