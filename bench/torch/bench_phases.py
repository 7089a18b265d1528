"""Where the time of one compressed bucket goes: each step of the C++ reduction of the bucket in one
piece (encode, all-to-all, the owner's sum and re-encode, all-gather, or the casts' one all-reduce
in the wire dtype, decode), from the reduction's own timeline (a collective from its start to the
return of its wait, so a step's wait includes the peer's lateness); the whole reduction in one
piece ("one piece") and as the hook runs it, in chunks of --chunk elements ("total"); four such
buckets given to it at once (its two threads overlap one bucket's encode and decode with
another's collectives: "4 buckets, per bucket"); and PyTorch's fp32 all-reduce of the same
bucket, with W Gloo ranks on this machine (loopback).

    python bench/torch/bench_phases.py [--world 2] [--numel 1049600] [--reps 20] [--chunk N]
    python bench/torch/bench_phases.py --chunks 65536,262144,1049600     # the chunk size swept
    python bench/torch/bench_phases.py --timeline int8 --chunk 262144    # one bucket's timeline

Prints a Markdown table of medians in ms (rank 0's clock, a barrier before every timed call); with
--chunks, the whole reduction's median per codec and chunk size; with --timeline, rank 0's
timeline of one bucket of that codec (the median run of --reps): every phase on the pipeline thread
that ran it, every collective from its start to the return of its wait, one line per event and a
chart (one column per --width-th of the bucket's time).
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from gradzip import wire

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


def groups(world):
    """The hook's two groups: the reduction's own, and one for its all-gathers."""
    return (dist.new_group(list(range(world)), use_local_synchronization=True),
            dist.new_group(list(range(world)), use_local_synchronization=True))


def runtime(codec, cast_sum, chunk, private, gather):
    """The hook's reduction (CompressedAllreduce), its all-gathers on `gather` where it has them."""
    two_phase = wire.allreduce_collective(wire.parse_spec(codec).kind, cast_sum) == "two_phase"
    return torch.classes.gradzip.CompressedAllreduce(
        private.group_name, codec, None, cast_sum, gather.group_name if two_phase else "", chunk)


def row_name(codec, cast_sum):
    return codec if cast_sum == "wire" else f"{codec} cast_sum={cast_sum}"


class Bucket:
    """One bucket of n floats, a weight and its bias as a Linear layer's, this rank's values x0;
    x the buffer reduced in place, refilled from x0 before each reduction."""

    def __init__(self, rank, n):
        self.numels = [n - n // 1025, n // 1025]
        self.x0 = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        self.x = self.x0.clone()

    def reduce(self, reduction, residual):
        """One whole reduction by `reduction`, waited for."""
        self.x.copy_(self.x0)
        reduction.reduce(0, self.x, self.x, self.numels, residual, None, True, []).wait()


def chunk_sweep(rank, world, args):
    """{codec row: {chunk: median ms of the whole reduction}}."""
    b = Bucket(rank, args.numel)
    residual = torch.zeros(args.numel)
    private, gather = groups(world)
    copy = timed(lambda: b.x.copy_(b.x0), args.reps)
    rows = {}
    for codec, cast_sum in CODECS:
        for chunk in args.chunks:
            red = runtime(codec, cast_sum, chunk, private, gather)
            rows.setdefault(row_name(codec, cast_sum), {})[chunk] = (
                timed(lambda: b.reduce(red, residual), args.reps) - copy)
    return rows


def timeline(rank, world, args):
    """Rank 0's events of the median of --reps reductions of one bucket, and that median (ms)."""
    b = Bucket(rank, args.numel)
    residual = torch.zeros(args.numel)
    private, gather = groups(world)
    red = runtime(args.timeline, "wire", args.chunk, private, gather)
    runs = []
    for _ in range(args.reps + 2):
        dist.barrier()
        red.set_timeline(True)
        b.reduce(red, residual)
        events = red.take_timeline()
        runs.append((max(e[5] for e in events), events))
    runs = sorted(runs[2:], key=lambda r: r[0])
    return runs[len(runs) // 2]


def print_timeline(events, total, width):
    lanes = {"issue": "issue thread", "finish": "finish thread"}
    collectives = ("all-to-all", "all-gather", "all-reduce")
    print("| lane | chunk | step | start | end |\n|---|---:|---|---:|---:|")
    for bucket, part, step, thread, t0, t1 in sorted(events, key=lambda e: e[4]):
        lane = "wire" if step in collectives else lanes[thread]
        print(f"| {lane} | {part} | {step} | {t0:.2f} | {t1:.2f} |")
    letters = {"encode": "E", "all-to-all": "A", "owner sum + re-encode": "S", "all-gather": "G",
               "all-reduce": "R", "decode": "D"}
    scale = width / total
    print(f"\nOne column = {total / width:.2f} ms; letters: E encode, A all-to-all, S owner sum + "
          "re-encode, G all-gather, R all-reduce, D decode; below a thread, the chunk it worked "
          "on; one line per chunk for its collectives in flight.\n")

    def bar(chosen):
        row, chunk = [" "] * width, [" "] * width
        for _, part, step, _, t0, t1 in chosen:
            for c in range(int(t0 * scale), max(int(t0 * scale) + 1, int(t1 * scale))):
                if c < width:
                    row[c], chunk[c] = letters[step], str(part % 10)
        return "".join(row), "".join(chunk)
    print("```")
    for thread, lane in lanes.items():
        mine = [e for e in events if e[2] not in collectives and e[3] == thread]
        if mine:
            row, chunk = bar(mine)
            print(f"{lane:>15} |{row}|\n{'':>15} |{chunk}|")
    for part in sorted({e[1] for e in events}):
        row, _ = bar([e for e in events if e[2] in collectives and e[1] == part])
        print(f"{f'chunk {part}, wire':>15} |{row}|")
    print("```")


def worker(rank, world, args):
    n = args.numel
    b = Bucket(rank, n)
    x0, x, numels = b.x0, b.x, b.numels
    rows = []
    four_x = [x0.clone() for _ in range(4)]

    def four_allreduces():
        for w in [dist.all_reduce(xi, async_op=True) for xi in four_x]:
            w.wait()
    rows.append(("allreduce (fp32, torch)", {
        "total": timed(lambda: dist.all_reduce(x), args.reps),
        "4 buckets, per bucket": timed(four_allreduces, args.reps) / 4}))
    private, gather = groups(world)
    copy = timed(lambda: x.copy_(x0), args.reps)
    for codec, cast_sum in CODECS:
        residual = torch.zeros(n)
        chunked = runtime(codec, cast_sum, args.chunk, private, gather)
        one_piece = runtime(codec, cast_sum, 2**62, private, gather)

        # Each step of the bucket in one piece, from the reduction's own timeline (a collective:
        # from its start to the return of its wait); the medians over the runs.
        one_piece.set_timeline(True)
        per_step = {}
        for _ in range(args.reps + 2):
            dist.barrier()
            b.reduce(one_piece, residual)
            for _, _, step, _, t0, t1 in one_piece.take_timeline():
                per_step.setdefault(step, []).append(t1 - t0)
        one_piece.set_timeline(False)
        phases = {step: statistics.median(d[2:]) for step, d in per_step.items()}
        phases["total"] = timed(lambda: b.reduce(chunked, residual), args.reps) - copy
        phases["one piece"] = timed(lambda: b.reduce(one_piece, residual), args.reps) - copy
        xs = [x0.clone() for _ in range(4)]
        residuals = [torch.zeros(n) for _ in xs]

        def four():
            for xi in xs:
                xi.copy_(x0)
            futures = [chunked.reduce(i, xi, xi, numels, ri, None, True, [])
                       for i, (xi, ri) in enumerate(zip(xs, residuals))]
            for f in futures:
                f.wait()
        phases["4 buckets, per bucket"] = (timed(four, args.reps) - 4 * copy) / 4
        rows.append((row_name(codec, cast_sum), phases))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--numel", type=int, default=1025 * 1024)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--chunk", type=int, default=2**21,
                    help="elements per chunk of the whole reduction (the hook's default: 2**21)")
    ap.add_argument("--chunks", type=lambda v: [int(c) for c in v.split(",")],
                    help="comma-separated chunk sizes: time the whole reduction at each")
    ap.add_argument("--timeline", metavar="CODEC", help="print one bucket's timeline for CODEC")
    ap.add_argument("--width", type=int, default=100, help="columns of the timeline's chart")
    args = ap.parse_args()
    print(f"One bucket of {args.numel} floats ({args.numel * 4 / 1e6:.1f} MB), {args.world} Gloo "
          f"ranks on loopback, median of {args.reps}, ms\n")
    if args.chunks:
        rows = loopback_ranks.run(chunk_sweep, args.world, args.threads, args)
        print("| reduction | " + " | ".join(f"chunk {c}" for c in args.chunks) + " |")
        print("|---|" + "---:|" * len(args.chunks))
        for name, by_chunk in rows.items():
            print(f"| {name} | " + " | ".join(f"{by_chunk[c]:.2f}" for c in args.chunks) + " |")
        return
    if args.timeline:
        total, events = loopback_ranks.run(timeline, args.world, args.threads, args)
        print(f"{args.timeline}, chunks of {args.chunk} elements: {total:.2f} ms\n")
        print_timeline(events, total, args.width)
        return
    rows = loopback_ranks.run(worker, args.world, args.threads, args)
    cols = ["encode", "all-to-all", "owner sum + re-encode", "all-gather", "all-reduce", "decode",
            "one piece", "total", "4 buckets, per bucket"]
    print("| reduction | " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for name, phases in rows:
        print(f"| {name} | " + " | ".join(f"{phases[c]:.2f}" if c in phases else "" for c in cols)
              + " |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
