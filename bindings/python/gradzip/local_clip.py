"""Gradient clipping where it is correct under a compressed optimizer direction: on each rank's own
gradient, bucket by bucket, before it enters the optimizer's momentum and the compressor (as 1-bit
Adam and Deep Gradient Compression clip).

``torch.nn.utils.clip_grad_norm_`` after ``backward()`` cannot work there: with
``CompressionState(optimizer=...)`` the hook leaves the optimizer's update in ``p.grad``, not the
gradient. ``CompressionState(..., max_grad_norm=C)`` clips instead, with the guarantee
clip_grad_norm_ gives: the rank's gradient, all buckets together, has a norm of at most C, so the
average over the ranks has too. It clips more often than clip_grad_norm_ on the average would
(one rank's gradient is noisier than the average), and ``grad_norm`` reports the rank's norm
before clipping, for logging.

The hook sees one bucket at a time, before the others exist, so the whole norm is not known when
a bucket is sent. Each bucket is given its share of C from the previous step: bucket b is scaled
by min(1, C * s_b / |g_b|), where s_b^2 is b's part of the previous step's squared norm (mixed
with a little of its part of the elements, so that a bucket silent last step is not held at zero).
The shares add up to one, so the whole norm stays within C; where the buckets' parts of the norm
change little from step to step, every bucket gets clip_grad_norm_'s coefficient min(1, C / |g|).
Computed on the device, without a host synchronisation.
"""
from __future__ import annotations

from typing import Optional

import torch

# The part of a bucket's share that comes from its element count rather than its norm last step.
_SIZE_WEIGHT = 0.05


def checked_max_norm(max_norm: Optional[float]) -> Optional[float]:
    """``max_norm`` as a float, or None; anything but a positive number is a ValueError."""
    if max_norm is not None and not float(max_norm) > 0.0:
        raise ValueError(f"gradzip: max_grad_norm must be > 0 (or None), got {max_norm}")
    return None if max_norm is None else float(max_norm)


class LocalGradClip:
    """One rank's clipping (``max_norm`` None: only measures ``grad_norm``). ``total_numel``:
    the elements of all buckets together (the optimizer's parameters)."""

    def __init__(self, max_norm: Optional[float], total_numel: int):
        self.max_norm = checked_max_norm(max_norm)
        self.total_numel = max(int(total_numel), 1)
        self._last: dict = {}  # bucket layout -> its squared norm at the previous step
        self._last_total = None
        self._this: dict = {}
        self.grad_norm: Optional[torch.Tensor] = None  # the previous step's, before clipping

    def clip_(self, x: torch.Tensor, layout) -> None:
        """Measures one bucket's gradient ``x`` (the flat values of the bucket ``layout``
        describes) and, with ``max_norm``, scales it in place to its share."""
        sq = torch.linalg.vector_norm(x, dtype=torch.float32).square()
        self._this[layout] = sq
        if self.max_norm is None:
            return
        size_share = x.numel() / self.total_numel
        last = self._last.get(layout)
        if last is None or self._last_total is None:
            share = torch.tensor(size_share, device=x.device)
        else:
            share = (1.0 - _SIZE_WEIGHT) * last / self._last_total.clamp_min(1e-30) \
                + _SIZE_WEIGHT * size_share
        coef = (self.max_norm * share.sqrt() / sq.sqrt().clamp_min(1e-30)).clamp_max(1.0)
        x.mul_(coef.to(x.dtype))

    def end_step(self) -> None:
        """The step's buckets are all measured: their norms become the next step's shares. A step
        whose norm is not finite (an AMP overflow, which the step skips) keeps the shares it had
        (or, on the first step, the element counts' shares)."""
        if not self._this:
            return
        total = torch.stack(list(self._this.values())).sum()
        self.grad_norm = total.sqrt()
        finite = torch.isfinite(total)
        before_total = self._last_total if self._last_total is not None else torch.ones_like(total)
        for layout, sq in self._this.items():
            before = self._last.get(layout)
            if before is None:  # the element count's share of the norm kept
                before = before_total * (layout[0] / self.total_numel)
            self._this[layout] = torch.where(finite, sq, before)
        self._last_total = torch.where(finite, total, before_total)
        self._last, self._this = self._this, {}

    def state_dict(self) -> dict:
        return {"last": dict(self._last), "last_total": self._last_total}

    def load_state_dict(self, d: dict) -> None:
        self._last, self._last_total, self._this = dict(d["last"]), d["last_total"], {}
        self.grad_norm = None if self._last_total is None else self._last_total.sqrt()
