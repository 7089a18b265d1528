#!/usr/bin/env python3
"""Two builds of gradzip_bench_cpu side by side: runs them alternately (before, after, before, ...)
on the same benchmarks and prints the median time of each with the speed-up, so that a change is
judged against the machine's state at the same moment, not against a table from another day.

    python3 bench/cpu/compare.py --before OLD/gradzip_bench_cpu --after build/cpu/bench/cpu/gradzip_bench_cpu
                                 [--filter REGEX] [--rounds 3] [--min-time 0.1]

Build the "before" binary from another commit in a worktree, e.g.
    git worktree add --detach ../gz-before COMMIT && cmake -S ../gz-before -B ../gz-before/build -G Ninja \\
        -DGRADZIP_CUDA=OFF -DGRADZIP_BUILD_TESTS=OFF && cmake --build ../gz-before/build --target gradzip_bench_cpu
Plain python3, no dependencies.
"""
import argparse
import statistics
import sys
from collections import defaultdict

from report import medians, run  # the same invocation and JSON reading as report.py


def times(binary, filt, min_time):
    """name -> real time (ms) of one run of every benchmark the filter selects."""
    return {name: b["real_time"] for name, b in medians(run(binary, 1, filt, min_time)).items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", required=True)
    ap.add_argument("--filter", default="^(encode|encode_ef|decode_add)/")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--min-time", default="0.1")
    args = ap.parse_args()
    measured = defaultdict(lambda: defaultdict(list))
    for r in range(args.rounds):
        for label, binary in (("before", args.before), ("after", args.after)):
            print(f"round {r + 1}/{args.rounds}: {label}", file=sys.stderr)
            for name, t in times(binary, args.filter, args.min_time).items():
                measured[name][label].append(t)
    print("| benchmark | before ms | after ms | speed-up |")
    print("|---|---:|---:|---:|")
    for name, d in measured.items():
        if not d["before"] or not d["after"]:
            continue
        before, after = statistics.median(d["before"]), statistics.median(d["after"])
        print(f"| {name} | {before:.3f} | {after:.3f} | {before / after:.2f}x |")


if __name__ == "__main__":
    main()
