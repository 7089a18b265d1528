"""Local steps with a compressed outer update (DiLoCo's outer loop; SparseLoCo's and INTELLECT-1's
compressed outer gradient): every rank trains its own replica for ``sync_every`` steps with its
own optimizer and no communication, then the replicas' change since the last sync is averaged,
compressed with error feedback by the same C++ reduction as the DDP hook, and an outer optimizer
(SGD with Nesterov momentum, DiLoCo's) applies it to the parameters every replica restarts from.

    model = build_model()                          # a plain module on each rank (no DDP)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    outer = gradzip.local_steps.LocalSteps(model.parameters(), "int8", sync_every=50)
    for batch in loader:                           # each rank its own shard of the data
        loss_fn(model(batch)).backward(); inner.step(); inner.zero_grad()
        outer.step()                               # every 50th call: the compressed sync

Why: a per-step codec sends something every step, so its bytes over a run are at best the run's
steps times a compressed gradient; syncing every H steps divides that by H, and the outer
gradient compresses as a gradient does (error feedback keeps its sum). What it costs: the anchor
(the parameters at the last sync, fp32) and the outer momentum, two copies of the parameters on
every rank; and the replicas drift apart between syncs (the error the outer step averages out).

The outer gradient of a rank is ``anchor - params`` (the way its local steps moved, as a
gradient); every rank receives the same compressed average (the reduction's guarantee), so the
outer step ``anchor -= outer_lr * (avg + momentum * velocity)`` (torch's Nesterov SGD on the
anchor) leaves the anchor and the velocity bitwise identical on every rank, and every replica
restarts from a copy of it. With ``outer_lr=1, outer_momentum=0`` a sync is plain averaging of
the replicas (local SGD).

``residual_decay`` (beta < 1; SparseLoCo's error feedback as momentum, beta = 0.95 there) scales
each rank's residual by beta after every sync, so that what a codec did not send decays as a
momentum does instead of waiting in full: the next sync compresses ``outer gradient / W + beta *
residual``. With a near-lossless codec (int8) the residual is small and beta changes little; with
top-k or sign it is what carries the unsent coordinates forward.

:class:`SimulatedLocalSteps` runs W replicas in one process through
:class:`gradzip.simulation.SimulatedWorkers`, equal to the multi-rank sync bit for bit where the
codec sums in gradzip (int8, sign, top-k; the casts with ``cast_sum="fp32"``).
"""
from __future__ import annotations

from typing import Iterable, List, Optional, Sequence

import torch
import torch.distributed as dist

from .wire import MIN_COMPRESS_NUMEL

__all__ = ["LocalSteps", "SimulatedLocalSteps"]

STATE_VERSION = 1
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9  # DiLoCo's outer Nesterov SGD, the defaults


def bucket_ranges(numels: Sequence[int], cap_bytes: int) -> List[tuple]:
    """(first, end) parameter index ranges of the sync's buckets: parameters in order, a bucket
    closing once it holds ``cap_bytes`` of fp32 (each bucket one compressed reduction, its own
    error-feedback residual)."""
    ranges, first, size = [], 0, 0
    for i, n in enumerate(numels):
        size += 4 * int(n)
        if size >= cap_bytes:
            ranges.append((first, i + 1))
            first, size = i + 1, 0
    if first < len(numels):
        ranges.append((first, len(numels)))
    return ranges


class _OuterLoop:
    """What every implementation of the outer loop shares: the count of inner steps, the anchor
    and its outer optimizer, the outer gradients and the outer step. Subclasses reduce."""

    def __init__(self, params: List[torch.Tensor], sync_every: int, outer_lr: float,
                 outer_momentum: float, nesterov: bool, bucket_cap_mb: float,
                 residual_decay: float, error_feedback: bool):
        if int(sync_every) < 1:
            raise ValueError(f"gradzip.local_steps: sync_every must be >= 1, got {sync_every}")
        if not outer_lr > 0.0 or not 0.0 <= outer_momentum < 1.0:
            raise ValueError("gradzip.local_steps: outer_lr must be > 0 and outer_momentum in "
                             f"[0, 1), got {outer_lr}, {outer_momentum}")
        if nesterov and outer_momentum == 0.0:
            raise ValueError("gradzip.local_steps: nesterov needs outer_momentum > 0")
        if not 0.0 < residual_decay <= 1.0:
            raise ValueError(f"gradzip.local_steps: residual_decay must be in (0, 1], got "
                             f"{residual_decay}")
        if residual_decay != 1.0 and not error_feedback:
            raise ValueError("gradzip.local_steps: residual_decay scales the error-feedback "
                             "residual; it needs error_feedback=True")
        if not params:
            raise ValueError("gradzip.local_steps: no parameters that require a gradient")
        if any(not p.is_floating_point() for p in params):
            raise TypeError("gradzip.local_steps: parameters must be floating point")
        self.sync_every = int(sync_every)
        self.residual_decay = float(residual_decay)
        self.steps = 0  # inner steps taken
        self.syncs = 0
        self.anchor = [p.detach().to(torch.float32, copy=True) for p in params]
        self.outer_optimizer = torch.optim.SGD(self.anchor, lr=outer_lr, momentum=outer_momentum,
                                               nesterov=nesterov)
        self.buckets = bucket_ranges([p.numel() for p in params], int(bucket_cap_mb * 2**20))

    def step(self) -> bool:
        """Counts one inner step (call after each ``optimizer.step()``); every ``sync_every``-th
        call syncs. Returns whether it did."""
        self.steps += 1
        if self.steps % self.sync_every:
            return False
        self.sync()
        return True

    @property
    def stats(self) -> dict:
        """The last sync's traffic (this rank's; the simulation's: rank 0's)."""
        return self.reduction.stats

    def sync(self) -> None:
        """Averages the outer gradient (compressed, with error feedback) bucket by bucket and
        takes the outer step; every replica ends it holding the same parameters."""
        last = len(self.buckets) - 1
        for i in range(len(self.buckets)):
            self._set_outer_gradient(i, self._reduce(i, i == last))
        self._outer_step(self._replicas())
        # after the outer step: a non-finite sync raised above, and its residual update is undone
        if self.residual_decay != 1.0:
            for t in self._residuals():
                t.mul_(self.residual_decay)

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "steps": self.steps, "syncs": self.syncs,
                "sync_every": self.sync_every, "anchor": [a.clone() for a in self.anchor],
                "outer_optimizer": self.outer_optimizer.state_dict(),
                "reduction": self.reduction.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"gradzip.local_steps: unsupported state version "
                             f"{state.get('version')} (this gradzip reads {STATE_VERSION})")
        if state["sync_every"] != self.sync_every:
            raise ValueError(f"gradzip.local_steps: the state was saved with sync_every="
                             f"{state['sync_every']}, this one has {self.sync_every}")
        if [tuple(a.shape) for a in state["anchor"]] != [tuple(a.shape) for a in self.anchor]:
            raise ValueError("gradzip.local_steps: the state's anchor does not match these "
                             "parameters' shapes")
        with torch.no_grad():
            for a, saved in zip(self.anchor, state["anchor"]):
                a.copy_(saved)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        self.steps, self.syncs = int(state["steps"]), int(state["syncs"])
        self.reduction.load_state_dict(state["reduction"])

    def _reduce(self, bucket: int, last: bool) -> torch.Tensor:
        """The average of the replicas' outer gradients of ``bucket`` (``last``: the sync's last
        bucket)."""
        raise NotImplementedError

    def _replicas(self) -> List[List[torch.Tensor]]:
        """The parameters of every replica this process holds."""
        raise NotImplementedError

    def _residuals(self) -> List[torch.Tensor]:
        """The error-feedback residuals of every replica this process holds."""
        raise NotImplementedError

    def _outer_gradient(self, params: List[torch.Tensor], bucket: int) -> torch.Tensor:
        first, end = self.buckets[bucket]
        return torch.cat([(a - p.detach().float()).reshape(-1)
                          for a, p in zip(self.anchor[first:end], params[first:end])])

    def _set_outer_gradient(self, bucket: int, avg: torch.Tensor) -> None:
        first, end = self.buckets[bucket]
        offset = 0
        for a in self.anchor[first:end]:
            a.grad = avg[offset:offset + a.numel()].view_as(a).clone()
            offset += a.numel()

    def _outer_step(self, replicas: List[List[torch.Tensor]]) -> None:
        """Applies the averaged outer gradient (every bucket's set) to the anchor and restarts
        every replica from it; raises, with nothing changed, if it is not finite (a replica
        diverged: its local steps, not the sync, need attention)."""
        if not all(bool(torch.isfinite(a.grad).all()) for a in self.anchor):
            for a in self.anchor:
                a.grad = None
            raise FloatingPointError(
                f"gradzip.local_steps: the averaged outer gradient of sync {self.syncs + 1} (after "
                f"step {self.steps}) is not finite: a replica's local steps diverged; the anchor "
                "and the outer momentum are unchanged")
        self.outer_optimizer.step()
        self.outer_optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for params in replicas:
                for p, a in zip(params, self.anchor):
                    p.copy_(a)
        self.syncs += 1


class _SyncBucket:
    """What compress_hook reads of a DDP GradBucket, for one bucket of the outer gradient."""

    def __init__(self, index: int, buffer: torch.Tensor, params: List[torch.Tensor],
                 last: bool):
        self._index, self._buffer, self._params, self._last = index, buffer, params, last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> List[torch.Tensor]:
        return self._params

    def is_last(self) -> bool:
        return self._last


class LocalSteps(_OuterLoop):
    """The outer loop on this rank's replica over ``process_group`` (see the module's doc).

    Args:
        params: the replica's parameters (those that require a gradient are synced; buffers such
            as BatchNorm's running statistics stay each rank's own).
        codec: the outer gradient's codec spec, as :class:`gradzip.ddp.CompressionState`'s
            (``"int8"``, ``"sign"``, ``"topk:0.02:values=fp16"``, ``"bf16"``, ``"fp32"``).
        sync_every: H, the inner steps between syncs.
        outer_lr, outer_momentum, nesterov: the outer SGD (DiLoCo's defaults: 0.7, 0.9, True).
        error_feedback: keep each rank's residual of the outer gradient across syncs.
        residual_decay: beta in (0, 1], the residual scaled by it after each sync (see the
            module's doc; 1: plain error feedback).
        cast_sum, min_compress_numel, guard_nonfinite: as CompressionState's.
        bucket_cap_mb: the outer gradient is reduced in buckets of about this size.

    The constructor broadcasts the parameters from the group's first rank (as DDP does), so every
    replica starts from the same ones. ``stats`` is the last sync's traffic (CompressionState's);
    ``state_dict()`` holds the step count, the anchor, the outer momentum and the residuals (the
    replica's parameters and the inner optimizer are saved as usual): a resume is exact, and a
    restart at another world size keeps the anchor and momentum (the same on every rank) and
    drops the residuals, as CompressionState does."""

    def __init__(self, params: Iterable[torch.Tensor], codec: str = "int8", sync_every: int = 50,
                 outer_lr: float = OUTER_LR, outer_momentum: float = OUTER_MOMENTUM, nesterov: bool = True,
                 process_group=None, error_feedback: bool = True, cast_sum: Optional[str] = None,
                 min_compress_numel: int = MIN_COMPRESS_NUMEL, bucket_cap_mb: float = 25.0,
                 guard_nonfinite: bool = True, residual_decay: float = 1.0):
        from .ddp import CompressionState  # the hook's state: its reduction, residuals and stats

        self.params = [p for p in params if p.requires_grad]
        self.process_group = process_group
        group = process_group if process_group is not None else dist.group.WORLD
        with torch.no_grad():
            for p in self.params:
                dist.broadcast(p.data, dist.get_global_rank(group, 0), group=group)
        super().__init__(self.params, sync_every, outer_lr, outer_momentum, nesterov,
                         bucket_cap_mb, residual_decay, error_feedback)
        self.reduction = CompressionState(codec, process_group, error_feedback,
                                          min_compress_numel=min_compress_numel,
                                          cast_sum=cast_sum, guard_nonfinite=guard_nonfinite)

    def _reduce(self, bucket: int, last: bool) -> torch.Tensor:
        from .ddp import compress_hook

        first, end = self.buckets[bucket]
        buf = self._outer_gradient(self.params, bucket)
        return compress_hook(self.reduction,
                             _SyncBucket(bucket, buf, self.params[first:end], last)).wait()

    def _replicas(self) -> List[List[torch.Tensor]]:
        return [self.params]

    def _residuals(self) -> List[torch.Tensor]:
        return self.reduction.residuals()


class SimulatedLocalSteps(_OuterLoop):
    """The outer loop of W replicas in one process: ``replicas[r]`` the parameters of rank r's
    replica (each trained by its own optimizer), reduced by
    :class:`gradzip.simulation.SimulatedWorkers` (its ``stats``: rank 0's traffic of the last
    sync). The replicas must start equal."""

    def __init__(self, replicas: Sequence[Iterable[torch.Tensor]], codec: str = "int8",
                 sync_every: int = 50, outer_lr: float = OUTER_LR, outer_momentum: float = OUTER_MOMENTUM,
                 nesterov: bool = True, error_feedback: bool = True,
                 cast_sum: Optional[str] = None, min_compress_numel: int = MIN_COMPRESS_NUMEL,
                 bucket_cap_mb: float = 25.0, residual_decay: float = 1.0):
        from .simulation import SimulatedWorkers

        self.replicas = [[p for p in params if p.requires_grad] for params in replicas]
        shapes = [[tuple(p.shape) for p in r] for r in self.replicas]
        if not self.replicas or any(s != shapes[0] for s in shapes):
            raise ValueError("gradzip.local_steps: the replicas must have the same parameters")
        if any(not torch.equal(p, q) for r in self.replicas[1:]
               for p, q in zip(r, self.replicas[0])):
            raise ValueError("gradzip.local_steps: the replicas must start from the same values")
        super().__init__(self.replicas[0], sync_every, outer_lr, outer_momentum, nesterov,
                         bucket_cap_mb, residual_decay, error_feedback)
        self.reduction = SimulatedWorkers(codec, len(self.replicas), error_feedback,
                                          min_compress_numel=min_compress_numel,
                                          cast_sum=cast_sum)

    def _reduce(self, bucket: int, last: bool) -> torch.Tensor:
        first, end = self.buckets[bucket]
        return self.reduction.reduce([self._outer_gradient(params, bucket)
                                      for params in self.replicas],
                                     bucket_index=bucket, is_last=last,
                                     shapes=[tuple(p.shape) for p in self.replicas[0][first:end]])

    def _replicas(self) -> List[List[torch.Tensor]]:
        return self.replicas

    def _residuals(self) -> List[torch.Tensor]:
        return [t for r in range(len(self.replicas)) for t in self.reduction.residuals(r)]
