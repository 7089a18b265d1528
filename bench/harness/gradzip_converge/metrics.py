"""Depth accuracy metrics (Eigen et al. 2014), over valid pixels only.

For one image with valid pixels i = 1..n, prediction d_i and ground truth g_i:
  abs_rel  = mean |d - g| / g            sq_rel   = mean (d - g)^2 / g
  rmse     = sqrt(mean (d - g)^2)        rmse_log = sqrt(mean (ln d - ln g)^2)
  delta_k  = fraction of pixels with max(d / g, g / d) < 1.25^k, k = 1, 2, 3
  abs_rel_med = abs_rel of s * d with s = median(g) / median(d): the error once the global scale,
             which one image cannot pin down, is taken out (Monodepth's median scaling)
A pixel is valid where the ground truth is finite and in (min_depth, max_depth] (and the optional
mask is true); 0 marks a missing value in every loader. Predictions are clamped to
[min_depth, max_depth] first, as the usual NYU/KITTI evaluation does, and s * d again. The median
of an even count is the mean of the two middle values. Set metrics average the per-image values
over images (images without a valid pixel are skipped), as BTS and AdaBins do.
"""
from __future__ import annotations

import torch

NAMES = ("abs_rel", "abs_rel_med", "sq_rel", "rmse", "rmse_log", "delta1", "delta2", "delta3")


def valid_mask(gt: torch.Tensor, min_depth: float = 1e-3, max_depth: float | None = None,
               mask: torch.Tensor | None = None) -> torch.Tensor:
    valid = torch.isfinite(gt) & (gt > min_depth)
    if max_depth is not None:
        valid &= gt <= max_depth
    if mask is not None:
        valid &= mask.bool()
    return valid


def _median(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per-row median of the valid entries of (B, N) ``x``; inf where a row has none."""
    s = torch.where(valid, x, torch.inf).sort(dim=1).values
    n = valid.sum(1, keepdim=True).clamp(min=1)
    return (0.5 * (s.gather(1, (n - 1) // 2) + s.gather(1, n // 2))).squeeze(1)


def image_metrics(pred: torch.Tensor, gt: torch.Tensor, mask: torch.Tensor | None = None,
                  min_depth: float = 1e-3, max_depth: float | None = None):
    """Per-image metrics for a batch (B, ...) -> (dict name -> (B,) float64 tensor, (B,) count)."""
    if pred.shape != gt.shape:
        raise ValueError(f"prediction {tuple(pred.shape)} and ground truth {tuple(gt.shape)} differ")
    b = gt.shape[0]
    gt = gt.reshape(b, -1).double()
    pred = pred.reshape(b, -1).double().nan_to_num(nan=min_depth)
    pred = pred.clamp(min=min_depth, max=max_depth)
    valid = valid_mask(gt, min_depth, max_depth, None if mask is None else mask.reshape(b, -1))
    n = valid.sum(1)
    g = torch.where(valid, gt, 1.0)  # placeholders keep invalid pixels finite; weighted out below
    d = torch.where(valid, pred, 1.0)
    w = valid.double()

    def mean(x):
        return (x * w).sum(1) / n.clamp(min=1)

    scale = torch.where(n > 0, _median(gt, valid) / _median(pred, valid), 1.0)
    d_med = torch.where(valid, (scale[:, None] * pred).clamp(min=min_depth, max=max_depth), 1.0)
    ratio = torch.maximum(d / g, g / d)
    out = {
        "abs_rel": mean((d - g).abs() / g),
        "abs_rel_med": mean((d_med - g).abs() / g),
        "sq_rel": mean((d - g) ** 2 / g),
        "rmse": mean((d - g) ** 2).sqrt(),
        "rmse_log": mean((d.log() - g.log()) ** 2).sqrt(),
    }
    for k in (1, 2, 3):
        out[f"delta{k}"] = mean((ratio < 1.25**k).double())
    return out, n


class MetricAccumulator:
    """Averages per-image metrics over a held-out set, batch by batch."""

    def __init__(self, min_depth: float = 1e-3, max_depth: float | None = None):
        self.min_depth, self.max_depth = min_depth, max_depth
        self.sums = dict.fromkeys(NAMES, 0.0)
        self.images = 0

    def update(self, pred, gt, mask=None) -> None:
        per_image, n = image_metrics(pred.detach(), gt, mask, self.min_depth, self.max_depth)
        keep = n > 0
        for k in NAMES:
            self.sums[k] += per_image[k][keep].sum().item()
        self.images += int(keep.sum())

    def compute(self) -> dict[str, float]:
        if self.images == 0:
            raise ValueError("no image with a valid ground-truth pixel was evaluated")
        return {k: v / self.images for k, v in self.sums.items()}
