"""FrozenVarianceAdamW under FSDP2 (``gradzip.fsdp.compress(..., optimizer=opt)``): the Adam state
of one FSDP parameter group, kept by the rank that owns each shard.

FSDP's promise is that a rank keeps 1/W of the optimizer state; so m and v are sharded as the
parameters are (FSDP's padded shard of the group, fp32). While the gradient is averaged exactly
(the warm-up, and groups too small to compress), the owner runs AdamW's update on its shard from
the exact averaged shard. At the group's first compressed step v freezes: each owner computes
``sqrt(v_hat) + eps`` of its shard, and one exact all-gather gives every rank the same bits of the
whole group's denominator, which it keeps (``denominator_dtype``), and of the whole group's
``m / denominator`` (``m_over_den``).

From then on a compressed step is the DDP hook's (FrozenVarianceAdam.apply_ / finish_) on the
whole group: each rank sends its candidate ``(1 - b1) * g / denominator + b1 * m_over_den``,
clipped to Adam's largest step, through the codec's two-phase all-reduce (error feedback on every
rank, the shard owner's re-encode of the sum with its own residual, the all-gather of the
re-encoded shards); every rank decodes the same average, which becomes ``m_over_den``, and the
owner's shard of it becomes the update (and m, in gradient units). Sending only the new part,
``(1 - b1) * g / denominator``, through a reduce-scatter (the owner adding ``b1 * m``) halves the
bytes but collapsed the depth model on the harness, with sign and with int8 alike: the codec then
compresses a heavy-tailed vector whose error the owner's momentum keeps, where the DDP form
compresses the momentum, whose coordinates a block scale fits (bench/RESULTS.md section 3).
"""

from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["ShardedAdam", "DENOMINATOR_DTYPES"]

# The whole group's frozen denominator and its momentum over it are the state a rank keeps
# unsharded (besides the error-feedback residual), both in this dtype: bf16 halves them; its
# rounding (2^-9 relative, the same bits on every rank) changes the step by far less than the
# codecs' error.
DENOMINATOR_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class ShardedAdam:
    """One FSDP parameter group's Adam state on this rank: ``m`` and ``v`` of its shard (``shard``
    elements, padding included), the whole group's frozen ``denominator`` (``world * shard``
    elements in FSDP's reduce-scatter layout; None until the group's first compressed step),
    ``m_over_den`` (the whole group's momentum over it, of the denominator's dtype, the same bits
    on every rank; None until then), ``updates`` (Adam's t) and ``exact_updates`` (the updates of
    v); ``padding``: the indices of FSDP's padding in the shard."""

    __slots__ = ("m", "v", "denominator", "m_over_den", "updates", "exact_updates", "padding")

    def __init__(self, shard: int, padding: torch.Tensor, device):
        self.m = torch.zeros(shard, dtype=torch.float32, device=device)
        self.v = torch.zeros_like(self.m)
        self.padding = padding.to(device)
        self.denominator: Optional[torch.Tensor] = None
        self.m_over_den: Optional[torch.Tensor] = None
        self.updates = self.exact_updates = 0

    def exact_(self, direction, avg: torch.Tensor) -> None:
        """AdamW on this rank's exactly averaged shard ``avg`` (fp32), which becomes the update."""
        if self.denominator is not None:
            raise RuntimeError("gradzip.fsdp: an exact step after the variance was frozen")
        avg.index_fill_(0, self.padding, 0.0)
        self.updates += 1
        self.exact_updates += 1
        direction.finish_(avg, [self.m, self.v], self.updates, self.exact_updates, False)

    def freeze_(self, direction, group: dist.ProcessGroup, dtype: torch.dtype) -> None:
        """At the group's first compressed step (and the first after loading a checkpoint that
        lacks them), on every rank together: every owner's shard of the denominator and of m over
        it, all-gathered exactly."""
        if self.denominator is None:
            self.denominator = self._gathered(direction.denominator(self.v, self.exact_updates)
                                              .to(dtype), group)
        if self.m_over_den is None:
            rank, shard = group.rank(), self.m.numel()
            own = self.m / self.denominator.narrow(0, rank * shard, shard)
            self.m_over_den = self._gathered(own.to(dtype), group)

    @staticmethod
    def _gathered(mine: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        whole = torch.empty(group.size() * mine.numel(), dtype=mine.dtype, device=mine.device)
        dist.all_gather_into_tensor(whole, mine, group=group)
        return whole

    def send_(self, direction, x: torch.Tensor) -> None:
        """This rank's candidate of its whole gradient ``x`` (fp32, FSDP's layout), in place."""
        direction.sharded_candidate_(x, self.m_over_den, self.denominator)

    def receive_(self, direction, avg: torch.Tensor, rank: int, out: torch.Tensor) -> None:
        """``avg``: the whole group's averaged candidates (fp32, FSDP's layout, its padding zero),
        the same on every rank, becomes ``m_over_den``; this rank's shard of it becomes the update,
        written into ``out`` (fp32, the shard)."""
        self.m_over_den.copy_(avg)
        self.updates += 1
        shard = self.m.numel()
        out.copy_(avg.narrow(0, rank * shard, shard))
        direction.compressed_finish_(out, self.m, self.denominator.narrow(0, rank * shard, shard),
                                     self.updates)

    def state_dict(self) -> dict:
        clone = lambda t: None if t is None else t.detach().clone()  # noqa: E731
        return {"m": clone(self.m), "v": clone(self.v), "denominator": clone(self.denominator),
                "m_over_den": clone(self.m_over_den), "updates": self.updates,
                "exact_updates": self.exact_updates}

    def load_state_dict(self, d: dict, dtype: torch.dtype) -> None:
        saved = d["denominator"]
        if d["m"].shape != self.m.shape or (saved is not None and saved.dtype != dtype):
            raise ValueError(f"gradzip.fsdp: the checkpoint's Adam state ({d['m'].numel()} "
                             f"elements, denominator {None if saved is None else saved.dtype}) is "
                             f"not this group's ({self.m.numel()} elements, {dtype})")
        self.m.copy_(d["m"])
        self.v.copy_(d["v"])
        self.denominator = None if saved is None else saved.to(self.m.device, copy=True)
        m_over_den = d.get("m_over_den")  # absent: gathered again from m at the next step
        self.m_over_den = None if m_over_den is None else m_over_den.to(self.m.device, copy=True)
        self.updates, self.exact_updates = int(d["updates"]), int(d["exact_updates"])
