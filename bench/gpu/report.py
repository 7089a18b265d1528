"""Markdown report of bench/gpu/check.sh from the raw JSON: GPU test summary, every kernel's time
and bandwidth against the copy baseline of the same size, the issue's targets, and PyTorch's ops.
Usage: report.py --bench bench.json --torch torch_ops.json --tests gpu_tests.json
"""
import argparse
import json
import os


def load(path):
    if not path or not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def kernels(bench):
    """{(spec, op, n): (us, GB/s)} and {n: copy GB/s} from Google Benchmark's JSON."""
    rows, copy, errors = {}, {}, []
    for b in (bench or {}).get("benchmarks", []):
        if b.get("error_occurred"):
            errors.append(f"{b['name']}: {b.get('error_message', '?')}")
            continue
        parts = b["name"].split("/")
        if parts[-1] == "manual_time":
            parts = parts[:-1]
        scale = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}[b.get("time_unit", "ns")]
        us = b["real_time"] * scale
        gbs = b.get("bytes_per_second", 0.0) / 1e9
        if parts[0] == "copy":
            copy[int(parts[1])] = (us, gbs)
        else:
            rows[(parts[0], parts[1], int(parts[2]))] = (us, gbs)
    return rows, copy, errors


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench")
    ap.add_argument("--torch")
    ap.add_argument("--tests")
    args = ap.parse_args()
    bench, torch_ops, tests = load(args.bench), load(args.torch), load(args.tests)
    out = ["# gradzip on the GPU", ""]
    if torch_ops:
        out.append(f"Device: {torch_ops.get('device')}, PyTorch {torch_ops.get('torch')}.")
    if bench:
        ctx = bench.get("context", {})
        out.append(f"Benchmark run: {ctx.get('date', '?')} on {ctx.get('host_name', '?')}.")
    out.append("")

    out.append("## GPU tests")
    if tests:
        out.append(f"{tests.get('tests', 0)} tests, {tests.get('failures', 0)} failures, "
                   f"{tests.get('errors', 0)} errors, {tests.get('disabled', 0)} disabled.")
        for suite in tests.get("testsuites", []):
            for t in suite.get("testsuite", []):
                if t.get("failures"):
                    out.append(f"- FAILED {suite['name']}.{t['name']}")
    else:
        out.append("No test results (the test binary did not run or crashed: see gpu_tests.log).")
    out.append("")

    rows, copy, errors = kernels(bench)
    out.append("## Kernels (CUDA events; GB/s over the bytes each op must move)")
    for e in errors:
        out.append(f"- ERROR {e}")
    if rows:
        out.append("| codec | op | n | time (us) | GB/s | % of copy GB/s |")
        out.append("|---|---|---:|---:|---:|---:|")
        for n in sorted(copy):
            out.append(f"| copy (D2D memcpy) | - | {n} | {copy[n][0]:.1f} | {copy[n][1]:.0f} | 100 |")
        for (spec, op, n), (us, gbs) in sorted(rows.items(), key=lambda r: (r[0][2], r[0][0], r[0][1])):
            pct = 100.0 * gbs / copy[n][1] if n in copy and copy[n][1] else float("nan")
            out.append(f"| {spec} | {op} | {n} | {us:.1f} | {gbs:.0f} | {pct:.0f} |")
    else:
        out.append("No benchmark results (see bench.log).")
    out.append("")

    torch_rows = {(r["op"], r["n"], r["ratio"]): r["ms"] for r in (torch_ops or {}).get("rows", [])}
    out.append("## Against PyTorch's ops (same GPU, same sizes)")
    pairs = [("topk_gather", 0.01, "topk:0.01", "torch.topk(x.abs(), 1%) + gather"),
             ("topk_gather", 0.001, "topk:0.001", "torch.topk(x.abs(), 0.1%) + gather"),
             ("to_bf16", None, "bf16", "x.to(torch.bfloat16)"),
             ("pertensor", None, "int8", "quantization_pertensor_hook quantisation")]
    if torch_rows and rows:
        out.append("| n | PyTorch op | PyTorch (us) | gradzip encode | gradzip (us) | speed-up |")
        out.append("|---:|---|---:|---|---:|---:|")
        for n in sorted({k[1] for k in torch_rows}):
            for op, ratio, spec, label in pairs:
                t = torch_rows.get((op, n, ratio))
                g = rows.get((spec, "encode", n))
                if t is not None and g is not None:
                    out.append(f"| {n} | {label} | {t * 1e3:.1f} | {spec} | {g[0]:.1f} | {t * 1e3 / g[0]:.1f}x |")
    else:
        out.append("Missing PyTorch or benchmark results (see torch_ops.log / bench.log).")
    out.append("")

    out.append("## Targets (n >= 64M elements)")
    for spec in ("bf16", "int8", "sign"):
        for n in sorted(n for n in copy if n >= 1 << 26):
            r = rows.get((spec, "encode_ef", n))
            if r:
                pct = 100.0 * r[1] / copy[n][1]
                out.append(f"- {spec} fused EF encode, n={n}: {pct:.0f}% of copy bandwidth "
                           f"({'PASS' if pct >= 80 else 'FAIL'}, target 80%)")
    t = torch_rows.get(("topk_gather", 1 << 26, 0.01))
    g = rows.get(("topk:0.01", "encode", 1 << 26))
    if t is not None and g is not None:
        s = t * 1e3 / g[0]
        out.append(f"- top-k 1% of 64M: {s:.1f}x torch.topk ({'PASS' if s >= 5 else 'FAIL'}, target 5x)")
    print("\n".join(out))


if __name__ == "__main__":
    main()
