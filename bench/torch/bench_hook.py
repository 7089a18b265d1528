"""The DDP hook's per-bucket overhead against PyTorch's allreduce_hook, on the same model, with W
Gloo ranks on this machine (loopback: bandwidth is plentiful, so this measures the hook's own cost,
not the bytes it saves).

    python bench/torch/bench_hook.py [--world 2] [--steps 12] [--width 1024] [--layers 6]

Prints a Markdown table: median backward time per step, buckets per step, the difference to
allreduce_hook per bucket, and the bytes each rank sent per step.
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import loopback_ranks

CODECS = ["allreduce_hook", "fp32", "bf16", "int8", "sign", "topk:0.01"]


def worker(rank, world, args):
    from gradzip.ddp import CompressionState, compress_hook

    results = []
    for codec in CODECS:
        torch.manual_seed(0)
        layers = []
        for _ in range(args.layers):
            layers += [nn.Linear(args.width, args.width), nn.ReLU()]
        model = nn.Sequential(*layers)
        ddp = DDP(model, bucket_cap_mb=args.bucket_mb)
        buckets = []
        if codec == "allreduce_hook":
            def hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
                buckets.append(bucket.index())
                return allreduce_hook(state, bucket)
            ddp.register_comm_hook(None, hook)
            state = None
        else:
            state = CompressionState(codec)

            def hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
                buckets.append(bucket.index())
                return compress_hook(state, bucket)
            ddp.register_comm_hook(state, hook)
        x = torch.randn(32, args.width)
        times = []
        for step in range(args.steps):
            out = ddp(x).square().mean()
            buckets.clear()
            dist.barrier()
            t0 = time.perf_counter()
            out.backward()
            times.append(time.perf_counter() - t0)
        sent = state.stats["bytes_sent"] if state is not None else \
            2 * (world - 1) * 4 * sum(p.numel() for p in model.parameters()) // world
        results.append((codec, statistics.median(times[2:]) * 1e3, len(buckets), sent))
        del ddp
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--bucket-mb", type=float, default=4.0)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    results = loopback_ranks.run(worker, args.world, args.threads, args)
    params = args.layers * (args.width * args.width + args.width)
    base = results[0][1]
    print(f"DDP backward, {args.world} Gloo ranks on loopback, MLP {args.layers}x{args.width} "
          f"({params / 1e6:.1f}M params), bucket_cap_mb={args.bucket_mb}, median of "
          f"{args.steps - 2} steps\n")
    print("| hook | ms / step | buckets | overhead vs allreduce_hook per bucket, ms | bytes sent / step / rank |")
    print("|---|---:|---:|---:|---:|")
    for codec, ms, nb, sent in results:
        over = (ms - base) / max(nb, 1)
        print(f"| {codec} | {ms:.1f} | {nb} | {over:+.2f} | {sent / 1e6:.2f} MB |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
