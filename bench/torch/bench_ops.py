"""gradzip's torch ops against the PyTorch equivalents on the CPU, as ratios of medians in one run.

    python bench/torch/bench_ops.py [--sizes 1M,4M,16M,64M] [--threads N] [--reps 5]

Pairs (same input, same thread count for both libraries):
  bf16     gradzip.encode(x, "bf16")            vs  x.to(torch.bfloat16) (copy_ into a bf16 buffer)
  topk 1%  gradzip.encode(x, "topk:0.01")       vs  torch.topk(x.abs(), k) + x.gather(idx)
(gradzip and the first two torch ops write into preallocated outputs; the two int8 rows run
PyTorch's code as its hook does, allocating its temporaries)
  int8     gradzip.encode(x, "int8")            vs  the quantisation of PyTorch's
                                                    quantization_pertensor_hook (MinMaxObserver,
                                                    calculate_qparams, round/clamp/to(uint8))
  int8+EF  gradzip.encode_with_feedback(...)    vs  the same in torch ops: c = g + e, quantise,
                                                    e = c - dequantise (what a Python hook does)
Prints a Markdown table: medians in ms and the speed-up (torch median / gradzip median).
"""

import argparse
import statistics
import time

import torch
from torch.distributed.algorithms.ddp_comm_hooks import quantization_hooks as qh

import gradzip


def median_ms(fn, reps):
    fn()  # warm-up (allocator, page faults)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def torch_pertensor_quantise(x):
    obs = torch.ao.quantization.MinMaxObserver()
    obs(x)
    s, z = obs.calculate_qparams()
    return qh._quantize_per_tensor_backend(x, s, z)


def torch_int8_ef(g, e):
    c = g + e
    obs = torch.ao.quantization.MinMaxObserver()
    obs(c)
    s, z = obs.calculate_qparams()
    q = qh._quantize_per_tensor_backend(c, s, z)
    e.copy_(c - qh._dequantize_per_tensor_backend(q, s, z))
    return q


def parse_size(s):
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20}.get(s[-1], 1)
    return int(float(s[:-1] if s[-1] in "KM" else s) * mult)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1M,4M,16M,64M")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gradzip.set_num_threads(args.threads)

    print(f"CPU ops, {args.threads} thread(s) each, gradzip ISA {gradzip.cpu_isa()}, "
          f"torch {torch.__version__}, median of {args.reps}\n")
    print("| op | elements | gradzip ms | torch ms | speed-up (torch / gradzip) | gradzip GB/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for size in args.sizes.split(","):
        n = parse_size(size)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(n, generator=g)
        e = torch.randn(n, generator=g) * 0.01
        e_t = e.clone()
        k = max(1, -(-n // 100))
        reps = args.reps if n <= (16 << 20) else max(3, args.reps // 2)
        # Outputs preallocated where both libraries allow it: fresh multi-MB buffers make every
        # call pay page faults whose cost depends on glibc's mmap threshold history, not the codec.
        out = {spec: torch.empty(gradzip.encoded_bytes(n, spec), dtype=torch.uint8)
               for spec in ("bf16", "topk:0.01", "int8")}
        bf16_out = torch.empty(n, dtype=torch.bfloat16)
        topk_vals, topk_idx, picked = torch.empty(k), torch.empty(k, dtype=torch.long), torch.empty(k)

        def torch_topk():
            torch.topk(x.abs(), k, sorted=False, out=(topk_vals, topk_idx))
            return torch.gather(x, 0, topk_idx, out=picked)

        rows = [
            ("bf16 cast", lambda: gradzip.encode(x, "bf16", out=out["bf16"]),
             lambda: bf16_out.copy_(x), 4 + 2),
            ("top-k 1%", lambda: gradzip.encode(x, "topk:0.01", out=out["topk:0.01"]), torch_topk, 4),
            ("int8 (per-tensor hook quantisation)", lambda: gradzip.encode(x, "int8", out=out["int8"]),
             lambda: torch_pertensor_quantise(x), 4 + 1),
            ("int8 + error feedback",
             lambda: gradzip.encode_with_feedback(x, e, "int8", out=out["int8"]),
             lambda: torch_int8_ef(x, e_t), 4 + 4 + 4 + 1),
        ]
        for name, ours, theirs, bytes_per_elem in rows:
            t_ours = median_ms(ours, reps)
            t_theirs = median_ms(theirs, reps)
            gbs = bytes_per_elem * n / (t_ours * 1e-3) / 1e9
            print(f"| {name} | {size} | {t_ours:.2f} | {t_theirs:.2f} | {t_theirs / t_ours:.1f}x | {gbs:.1f} |",
                  flush=True)


if __name__ == "__main__":
    main()
