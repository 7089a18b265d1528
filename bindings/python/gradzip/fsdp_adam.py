"""FrozenVarianceAdamW under FSDP2 (``gradzip.fsdp.compress(..., optimizer=opt)``): the Adam state
of one FSDP parameter group, kept by the rank that owns each shard.

FSDP's promise is that a rank keeps 1/W of the optimizer state; so m and v are sharded as the
parameters are (FSDP's padded shard of the group, fp32). While the gradient is averaged exactly
(the warm-up, and groups too small to compress), the owner runs AdamW's update on its shard from
the exact averaged shard. At the group's first compressed step v freezes: each owner computes
``sqrt(v_hat) + eps`` of its shard, and one exact all-gather gives every rank the same bits of the
whole group's denominator, which it keeps (``denominator_dtype``). From then on each rank sends
``(1 - b1) * g / denominator`` of the whole unsharded gradient (linear in g, compressed with error
feedback by the codec's reduce-scatter) and the owner adds ``b1 * m`` over its shard of the same
denominator to the average it receives (FrozenVarianceAdam.increment_ / sharded_finish_).
"""

from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["ShardedAdam", "DENOMINATOR_DTYPES"]

# The whole group's frozen denominator is the one state a rank keeps unsharded (besides the error
# feedback residual): bf16 halves it; its rounding (2^-9 relative, the same bits on every rank)
# changes the step by far less than the codecs' error.
DENOMINATOR_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class ShardedAdam:
    """One FSDP parameter group's Adam state on this rank: ``m`` and ``v`` of its shard (``shard``
    elements, padding included), the whole group's frozen ``denominator`` (``world * shard``
    elements in FSDP's reduce-scatter layout; None until the group's first compressed step),
    ``updates`` (Adam's t) and ``exact_updates`` (the updates of v); ``padding``: the indices of
    FSDP's padding in the shard."""

    __slots__ = ("m", "v", "denominator", "updates", "exact_updates", "padding")

    def __init__(self, shard: int, padding: torch.Tensor, device):
        self.m = torch.zeros(shard, dtype=torch.float32, device=device)
        self.v = torch.zeros_like(self.m)
        self.padding = padding.to(device)
        self.denominator: Optional[torch.Tensor] = None
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
        """Once, at the group's first compressed step, on every rank together: every owner's
        shard of the denominator, all-gathered."""
        if self.denominator is not None:
            return
        mine = direction.denominator(self.v, self.exact_updates).to(dtype)
        whole = torch.empty(group.size() * mine.numel(), dtype=dtype, device=mine.device)
        dist.all_gather_into_tensor(whole, mine, group=group)
        self.denominator = whole

    def send_(self, direction, x: torch.Tensor) -> None:
        """What this rank sends of its whole gradient ``x`` (fp32, FSDP's layout), in place."""
        direction.increment_(x, self.denominator)

    def receive_(self, direction, avg: torch.Tensor, rank: int) -> None:
        """This rank's shard of the averaged increments ``avg`` (fp32) becomes the update."""
        avg.index_fill_(0, self.padding, 0.0)  # a codec may decode padding to non-zero (sign)
        self.updates += 1
        shard = self.m.numel()
        direction.sharded_finish_(avg, self.m, self.denominator.narrow(0, rank * shard, shard),
                                  self.updates)

    def state_dict(self) -> dict:
        clone = lambda t: None if t is None else t.detach().clone()  # noqa: E731
        return {"m": clone(self.m), "v": clone(self.v), "denominator": clone(self.denominator),
                "updates": self.updates, "exact_updates": self.exact_updates}

    def load_state_dict(self, d: dict, dtype: torch.dtype) -> None:
        saved = d["denominator"]
        if d["m"].shape != self.m.shape or (saved is not None and saved.dtype != dtype):
            raise ValueError(f"gradzip.fsdp: the checkpoint's Adam state ({d['m'].numel()} "
                             f"elements, denominator {None if saved is None else saved.dtype}) is "
                             f"not this group's ({self.m.numel()} elements, {dtype})")
        self.m.copy_(d["m"])
        self.v.copy_(d["v"])
        self.denominator = None if saved is None else saved.to(self.m.device, copy=True)
        self.updates, self.exact_updates = int(d["updates"]), int(d["exact_updates"])
