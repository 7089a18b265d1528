#!/usr/bin/env python3
"""Runs gradzip_bench_cpu and prints Markdown tables of throughput as a fraction of the memcpy
floor (medians over repetitions), plus the top-k time against one fused EF pass.

    python3 bench/cpu/report.py [--bench build/cpu/bench/cpu/gradzip_bench_cpu]
                                [--repetitions 3] [--filter REGEX] [--json saved.json]

Ratio = codec bytes/s / memcpy bytes/s for the same byte count (bytes the pass must read and
write), both measured in the same run with the same threads. Plain python3, no dependencies.
"""
import argparse
import json
import subprocess
import sys
from collections import defaultdict

MODES = ["encode", "encode_ef", "decode_add"]


def run(bench, repetitions, filt, min_time):
    cmd = [bench, "--benchmark_format=json", f"--benchmark_repetitions={repetitions}",
           "--benchmark_report_aggregates_only=true", f"--benchmark_min_time={min_time}"]
    if filt:
        cmd.append(f"--benchmark_filter={filt}")
    print("running:", " ".join(cmd), file=sys.stderr)
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out)


def medians(data):
    """name (without /real_time) -> median entry."""
    res = {}
    for b in data["benchmarks"]:
        if b.get("aggregate_name", "median") != "median":
            continue
        name = b.get("run_name", b["name"]).replace("/real_time", "")
        res[name] = b
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", default="build/cpu/bench/cpu/gradzip_bench_cpu")
    ap.add_argument("--repetitions", type=int, default=3)
    ap.add_argument("--min-time", default="0.2")
    ap.add_argument("--filter", default="")
    ap.add_argument("--json", help="read a saved --benchmark_format=json output instead of running")
    ap.add_argument("--save", help="also write the raw JSON here")
    args = ap.parse_args()

    if args.json:
        with open(args.json) as f:
            data = json.load(f)
    else:
        data = run(args.bench, args.repetitions, args.filter, args.min_time)
        if args.save:
            with open(args.save, "w") as f:
                json.dump(data, f, indent=1)
    m = medians(data)
    memcpy = {int(round(b["floor_bytes"])): b["bytes_per_second"]
              for n, b in m.items() if n.startswith("memcpy/")}

    # table[mode][codec][size] = (ratio, GB/s, ms)
    table = defaultdict(lambda: defaultdict(dict))
    sizes = []
    for name, b in m.items():
        parts = name.split("/")
        if parts[0] not in MODES:
            continue
        mode, size, codec = parts[0], parts[-1], "/".join(parts[1:-1])
        if size not in sizes:
            sizes.append(size)
        copy = memcpy.get(int(round(b["floor_bytes"])))
        ratio = b["bytes_per_second"] / copy if copy else b.get("floor_ratio", float("nan"))
        table[mode][codec][size] = (ratio, b["bytes_per_second"] / 1e9, b["real_time"])
    sizes.sort(key=lambda s: int(s.rstrip("M")))

    ctx = data.get("context", {})
    threads = next((b.get("threads") for b in m.values() if "threads" in b), "?")
    isa = next((b.get("label") for b in m.values() if b.get("label")), "?")
    print(f"host: {ctx.get('host_name', '?')}, {ctx.get('num_cpus', '?')} CPUs, gradzip threads "
          f"{threads:g}, ISA {isa}, repetitions {args.repetitions}, medians\n"
          if isinstance(threads, (int, float)) else "")
    print("Cells: fraction of the memcpy floor (GB/s of bytes the pass must read + write).\n")
    for mode in MODES:
        if mode not in table:
            continue
        print(f"**{mode}**\n")
        print("| codec | " + " | ".join(sizes) + " |")
        print("|---|" + "---|" * len(sizes))
        for codec, row in table[mode].items():
            cells = [f"{row[s][0]:.2f} ({row[s][1]:.1f})" if s in row else "" for s in sizes]
            print(f"| {codec} | " + " | ".join(cells) + " |")
        print()
    print("**memcpy baseline** (GB/s, read + write): " +
          ", ".join(f"{b / 1e9:.1f}" for _, b in sorted(memcpy.items())[:1] + sorted(memcpy.items())[-1:]) +
          " (smallest / largest byte count)\n")

    ef = table.get("encode_ef", {})
    if "topk:0.01" in ef and "16M" in ef["topk:0.01"]:
        t = ef["topk:0.01"]["16M"][2]
        print("**top-k 1% of 16M (fused EF) vs one fused EF pass at 16M** (target <= 3x)\n")
        print("| pass | time ms | top-k / pass |")
        print("|---|---|---|")
        for codec in ("bf16", "int8", "sign"):
            if codec in ef and "16M" in ef[codec]:
                p = ef[codec]["16M"][2]
                print(f"| {codec} | {p:.2f} | {t / p:.2f}x |")
        print(f"| topk:0.01 | {t:.2f} | |")

    lines = {name: b for name, b in m.items()
             if name.startswith("decode_add/topk") and "line_floor_ratio" in b}
    if lines:
        print("\n**top-k decode_add against the cache lines it moves** (each 64-byte line of out "
              "holding a kept index, read and written back)\n")
        print("| codec | " + " | ".join(sizes) + " |")
        print("|---|" + "---|" * len(sizes))
        codecs = []
        for name in lines:
            c = "/".join(name.split("/")[1:-1])
            if c not in codecs:
                codecs.append(c)
        for c in codecs:
            cells = [f"{lines[f'decode_add/{c}/{s}']['line_floor_ratio']:.2f}"
                     if f"decode_add/{c}/{s}" in lines else "" for s in sizes]
            print(f"| {c} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
