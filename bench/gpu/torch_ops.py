"""PyTorch's own ops on the GPU, timed like bench_gpu.cpp (CUDA events, median), for the
comparison table of bench/gpu/check.sh:
  topk_gather  torch.topk(x.abs(), k) + x.gather(idx)  (what a top-k compressor does with torch)
  to_bf16      x.to(torch.bfloat16)
  pertensor    the local quantisation of torch's quantization_pertensor_hook: MinMaxObserver,
               calculate_qparams, the hook's FloatTensor([s, z]) and _quantize_per_tensor_backend
Writes a JSON list of {op, n, ratio, ms}.
"""
import argparse
import json
import statistics

import torch
from torch.distributed.algorithms.ddp_comm_hooks.quantization_hooks import (
    _quantize_per_tensor_backend,
)

SIZES = [1 << 20, 1 << 24, 1 << 26, 1 << 27]  # as bench_gpu.cpp kSizes


def time_ms(fn, budget_s=0.3, min_iters=5, max_iters=200):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    while len(times) < max_iters and (len(times) < min_iters or sum(times) < budget_s * 1e3):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def pertensor(x):
    obs = torch.ao.quantization.MinMaxObserver().to(x.device)
    obs(x)
    s, z = obs.calculate_qparams()
    s_and_z = torch.FloatTensor([s, z]).to(x.device)  # as the hook does
    return _quantize_per_tensor_backend(x, s_and_z[0], s_and_z[1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(1)
    rows = []
    for n in SIZES:
        x = torch.randn(n, device=dev, generator=gen)
        for ratio in (0.01, 0.001):
            k = max(1, int(-(-ratio * n // 1)))

            def topk_gather(x=x, k=k):
                _, idx = torch.topk(x.abs(), k, sorted=False)
                return x.gather(0, idx)

            rows.append({"op": "topk_gather", "n": n, "ratio": ratio, "ms": time_ms(topk_gather)})
        rows.append({"op": "to_bf16", "n": n, "ratio": None, "ms": time_ms(lambda x=x: x.to(torch.bfloat16))})
        rows.append({"op": "pertensor", "n": n, "ratio": None, "ms": time_ms(lambda x=x: pertensor(x))})
        del x
        torch.cuda.empty_cache()
        print(json.dumps(rows[-4:]), flush=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows}, f,
                  indent=1)


if __name__ == "__main__":
    main()
