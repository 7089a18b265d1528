"""Scale-invariant log loss (SILog; Eigen et al. 2014, in the form BTS and AdaBins train with).

With g_i = ln d_i - ln t_i over the valid pixels of the batch:
  SILog = alpha * sqrt(mean(g^2) - lam * mean(g)^2)
lam = 1 would ignore the global scale entirely; 0.85 keeps a little of it so metric depth is
learned; alpha = 10 brings the value into a range where usual learning rates work.
"""
from __future__ import annotations

import torch

from .metrics import valid_mask


def silog_loss(pred: torch.Tensor, gt: torch.Tensor, mask: torch.Tensor | None = None,
               lam: float = 0.85, alpha: float = 10.0, min_depth: float = 1e-3) -> torch.Tensor:
    valid = valid_mask(gt, min_depth, None, mask)
    if not bool(valid.any()):
        raise ValueError("SILog: the batch has no valid ground-truth pixel")
    g = pred.float()[valid].clamp(min=min_depth).log() - gt.float()[valid].log()
    var = (g * g).mean() - lam * g.mean() ** 2
    return alpha * var.clamp(min=1e-12).sqrt()
