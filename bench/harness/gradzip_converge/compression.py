"""Gradient aggregation for the simulated-worker mode: W gradients in, their (compressed) mean out.

All arithmetic is gradzip.simulation.SimulatedWorkers, which runs the code of ``compress_hook`` for W
ranks in one process (each worker with its own error-feedback residuals). This module only adapts
it to the trainer:

* the flat model gradient is cut into buckets the way DDP cuts it (parameters in reverse order,
  1 MiB first bucket, then ``bucket_cap_mb``), and each bucket is reduced with its own bucket index, so
  per-bucket scales, top-k selections and residuals are those W DDP ranks would have;
* the uncompressed baseline ("fp32", also spelled "none") is the hook's own uncompressed path,
  a plain fp32 all-reduce average (what DDP does without a hook): every bucket is marked too small
  to compress. Its traffic is that of a ring all-reduce.

The compiled extension is imported lazily, so the rest of the harness works without it.
"""
from __future__ import annotations

import math

import torch

from gradzip.costmodel import FIRST_BUCKET_BYTES, ddp_buckets
# CompressionState's default: tiny buckets stay uncompressed
from gradzip.wire import MIN_COMPRESS_NUMEL

BASELINE = "fp32"
NEVER_COMPRESS = 1 << 62  # a min_compress_numel no bucket reaches: the baseline runs


def canonical_codec(codec: str) -> str:
    return BASELINE if codec in ("none", "fp32") else codec


def baseline_or_codec(codec: str, error_feedback: bool) -> dict:
    """The reduction's error_feedback and min_compress_numel: the baseline keeps no state and
    compresses no bucket (a plain fp32 all-reduce), a codec its defaults."""
    baseline = canonical_codec(codec) == BASELINE
    return {"error_feedback": error_feedback and not baseline,
            "min_compress_numel": NEVER_COMPRESS if baseline else MIN_COMPRESS_NUMEL}


def bucket_bounds(numels: list[int], cap_bytes: int,
                  first_cap_bytes: int = FIRST_BUCKET_BYTES) -> list[tuple[int, int]]:
    """(start, end) element ranges of the buckets of a flat fp32 gradient laid out in parameter
    order, cut as DDP's reducer cuts them (gradzip.costmodel.ddp_buckets). Returned in
    bucket-index order."""
    bounds, end = [], sum(numels)
    for bucket in ddp_buckets([(n,) for n in numels], cap_bytes, first_cap_bytes):
        size = sum(shape[0] for shape in bucket)
        bounds.append((end - size, end))
        end -= size
    return bounds


def fp32_step_bytes(numels: list[int], workers: int, bucket_cap_mb: float = 25.0) -> int:
    """What one worker sends in a step of the uncompressed baseline: an fp32 ring all-reduce of
    each of DDP's buckets (the ``raw_bytes`` every run's ratio is taken against)."""
    from gradzip import _ops  # compiled extension: imported only here

    return sum(_ops.fp32_traffic(b - a, workers)
               for a, b in bucket_bounds(numels, int(bucket_cap_mb * 2**20)))


# RunConfig.residual_dtype's names of CompressionState's residual_dtype
RESIDUAL_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Reducer:
    """Averages W flat fp32 gradients bucket by bucket; keeps the last step's traffic.

    ``optimizer``: a gradzip.optim optimizer, whose direction is then computed around the
    collective (the reduce returns what that optimizer's step applies). ``param_shapes``: the
    parameters' shapes (instead of ``param_numels``), which lowrank (matrices) and
    ``uncompressed_numel`` (as CompressionState's) need. ``warmup_steps``: the first steps are
    averaged uncompressed, or in ``warmup_codec`` (and counted as such in the bytes).
    ``max_grad_norm``: with ``optimizer``, each worker's gradient clipped (SimulatedWorkers').
    ``cast_sum``: SimulatedWorkers' (None: its default). ``residual_dtype``: "fp32", or "bf16"
    (the compact residual). ``ranks_per_node``: R > 1, the two-level reduction of workers / R
    nodes (SimulatedWorkers'); the fp32 baseline stays flat (the same average)."""

    def __init__(self, codec: str, workers: int, error_feedback: bool = True,
                 param_numels: list[int] | None = None, bucket_cap_mb: float = 25.0,
                 first_bucket_bytes: int = FIRST_BUCKET_BYTES, warmup_steps: int = 0,
                 optimizer=None, param_shapes: list[tuple] | None = None,
                 warmup_codec: str | None = None, uncompressed_numel: int = 0,
                 max_grad_norm: float | None = None, cast_sum: str | None = None,
                 residual_dtype: str = "fp32", ranks_per_node: int = 1):
        from gradzip.simulation import SimulatedWorkers  # compiled extension: imported only here

        self.codec = canonical_codec(codec)
        self.workers = workers
        self.error_feedback = error_feedback
        if param_shapes is not None:
            param_numels = [math.prod(s) for s in param_shapes]
        self.param_numels = param_numels
        self.param_shapes = param_shapes
        self.cap_bytes = int(bucket_cap_mb * 2**20)
        self.first_bucket_bytes = first_bucket_bytes
        self._sim = SimulatedWorkers(self.codec, workers,
                                     **baseline_or_codec(self.codec, error_feedback),
                                     warmup_steps=warmup_steps,
                                     optimizer=optimizer, warmup_codec=warmup_codec,
                                     uncompressed_numel=uncompressed_numel,
                                     max_grad_norm=max_grad_norm, cast_sum=cast_sum,
                                     residual_dtype=RESIDUAL_DTYPES[residual_dtype],
                                     ranks_per_node=(1 if self.codec == BASELINE
                                                     else ranks_per_node))
        self.bytes_per_step = 0  # bytes one worker sent in the last step
        self.raw_bytes_per_step = 0  # what an uncompressed fp32 ring all-reduce would send

    def reduce(self, grads: list[torch.Tensor]) -> torch.Tensor:
        if len(grads) != self.workers:
            raise ValueError(f"expected {self.workers} gradients, got {len(grads)}")
        n = grads[0].numel()
        numels = self.param_numels or [n]
        shapes = self.param_shapes or [(m,) for m in numels]
        if sum(numels) != n:
            raise ValueError(f"gradients hold {n} elements, the parameters {sum(numels)}")
        out = torch.empty_like(grads[0])
        bounds = bucket_bounds(numels, self.cap_bytes, self.first_bucket_bytes)
        starts = [0]
        for m in numels:
            starts.append(starts[-1] + m)
        for i, (a, b) in enumerate(bounds):
            # the bucket's tensors (buckets are cut at tensor boundaries), for per-tensor blocks
            inside = [shapes[j] for j in range(len(numels)) if a <= starts[j] < b]
            # one step = every bucket; the last one ends it (step count, warm-up, the guard)
            out[a:b] = self._sim.reduce([g[a:b] for g in grads], bucket_index=i,
                                        is_last=i == len(bounds) - 1, shapes=inside)
        stats = self._sim.stats  # the step's traffic, summed over its buckets
        self.bytes_per_step, self.raw_bytes_per_step = stats["bytes_sent"], stats["raw_bytes"]
        return out

    def state_dict(self) -> dict:
        return self._sim.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self._sim.load_state_dict(sd)
