"""Where the time of one compressed bucket goes: each phase of the C++ reduction (encode, all-to-all,
the owner's sum and re-encode, all-gather, or the casts' one all-reduce in the wire dtype, decode)
timed on its own, the whole reduction as the hook runs it (CompressedAllreduce; "phases in a row":
the same calls from Python, one after the other), four such buckets given to it at once (its two
threads overlap one bucket's encode and decode with another's collectives: "4 buckets, per
bucket"), and PyTorch's fp32 all-reduce of the same bucket, with W Gloo ranks on this machine
(loopback).

    python bench/torch/bench_phases.py [--world 2] [--numel 1049600] [--reps 20]

Prints a Markdown table of medians in ms (rank 0's clock, a barrier before every timed call).
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import loopback_ranks

# (codec, cast_sum): the casts on their default one all-reduce, and bf16 on the two-phase fp32 sum
CODECS = [("fp32", "wire"), ("bf16", "wire"), ("bf16", "fp32"), ("int8", "wire"), ("sign", "wire"),
          ("topk:0.01", "wire")]


def timed(fn, reps):
    out = []
    for _ in range(reps + 2):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out[2:]) * 1e3


def worker(rank, world, args):
    n = args.numel
    numels = [n - n // 1025, n // 1025]  # a weight and its bias, as a Linear layer's bucket
    g = torch.Generator().manual_seed(rank)
    x0 = torch.randn(n, generator=g)
    x = x0.clone()
    rows = []
    four_x = [x0.clone() for _ in range(4)]

    def four_allreduces():
        for w in [dist.all_reduce(xi, async_op=True) for xi in four_x]:
            w.wait()
    rows.append(("allreduce (fp32, torch)", {
        "total": timed(lambda: dist.all_reduce(x), args.reps),
        "4 buckets, per bucket": timed(four_allreduces, args.reps) / 4}))
    private = dist.new_group(list(range(world)), use_local_synchronization=True)
    gather = dist.new_group(list(range(world)), use_local_synchronization=True)
    for codec, cast_sum in CODECS:
        red = torch.classes.gradzip.BucketReduction(codec, world, rank, numels, x, cast_sum)
        residual = torch.zeros(n)
        phases = {"encode": timed(lambda: red.encode(x, residual), args.reps)}
        payload = red.payload()
        if red.wire_sum():
            phases["all-reduce"] = timed(lambda: dist.all_reduce(payload), args.reps)
        if red.two_phase():
            send, recv = red.send(), red.recv()
            splits = red.send_splits()
            recv_splits = [recv.numel() // world] * world
            phases["all-to-all"] = timed(
                lambda: dist.all_to_all_single(recv, send, recv_splits, splits), args.reps)
            phases["owner sum + re-encode"] = timed(lambda: red.reduce_owner(None), args.reps)
        gathered, gather_in = red.gathered(), red.gather_in()
        if not red.wire_sum():
            phases["all-gather"] = timed(lambda: dist.all_gather_into_tensor(gathered, gather_in),
                                         args.reps)
        phases["decode"] = timed(lambda: red.decode(x), args.reps)
        def in_a_row():
            x.copy_(x0)
            red.encode(x, residual)
            if red.wire_sum():
                dist.all_reduce(payload)
                red.decode(x)
                return
            if red.two_phase():
                dist.all_to_all_single(recv, send, recv_splits, splits)
                red.reduce_owner(None)
            dist.all_gather_into_tensor(gathered, gather_in)
            red.decode(x)
        runtime = torch.classes.gradzip.CompressedAllreduce(
            private.group_name, codec, None, cast_sum, gather.group_name if red.two_phase() else "")

        def whole():
            x.copy_(x0)
            runtime.reduce(0, x, x, numels, residual, None, True, []).wait()
        copy = timed(lambda: x.copy_(x0), args.reps)
        phases["phases in a row"] = timed(in_a_row, args.reps) - copy
        phases["total"] = timed(whole, args.reps) - copy
        xs = [x0.clone() for _ in range(4)]
        residuals = [torch.zeros(n) for _ in xs]

        def four():
            for xi in xs:
                xi.copy_(x0)
            futures = [runtime.reduce(i, xi, xi, numels, ri, None, True, [])
                       for i, (xi, ri) in enumerate(zip(xs, residuals))]
            for f in futures:
                f.wait()
        phases["4 buckets, per bucket"] = (timed(four, args.reps) - 4 * copy) / 4
        rows.append((codec if cast_sum == "wire" else f"{codec} cast_sum={cast_sum}", phases))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--numel", type=int, default=1025 * 1024)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    rows = loopback_ranks.run(worker, args.world, args.threads, args)
    cols = ["encode", "all-to-all", "owner sum + re-encode", "all-gather", "all-reduce", "decode",
            "phases in a row", "total", "4 buckets, per bucket"]
    print(f"One bucket of {args.numel} floats ({args.numel * 4 / 1e6:.1f} MB), {args.world} Gloo "
          f"ranks on loopback, median of {args.reps}, ms\n")
    print("| reduction | " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for name, phases in rows:
        print(f"| {name} | " + " | ".join(f"{phases[c]:.2f}" if c in phases else "" for c in cols)
              + " |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
