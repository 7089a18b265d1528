"""Optimizers made for compression: what gets compressed (with error feedback) and averaged is
something linear in each rank's gradient, so that error feedback's guarantee holds, and the
optimizer's state is one state, bitwise identical on every rank.

Why: error feedback keeps the *sum* of what was sent equal to the sum of what should have been
sent, up to one bounded residual. That guarantee survives a linear update (``p -= lr * avg``) but
not Adam applied to a compressed gradient: Adam divides each coordinate by the root of its second
moment, so the residual's step-to-step swings (the quantisation error of 1-bit and top-k codecs is
as large as the gradient) become full-size steps and inflate the second moment. Normalising each
rank's gradient by its own second moment before compressing (each rank's own Adam direction)
avoids that but leaves every rank with a different, noisier state. The systems that reach parity
at 30x (1-bit Adam, 0/1 Adam) instead freeze the variance after an uncompressed warm-up and
compress the momentum, which is then linear in the gradient.

``FrozenVarianceAdamW`` keeps one Adam state, identical on every rank: while the compression warms
up (``CompressionState(warmup_steps=N)``, N >= 1; about the learning rate's warm-up) the gradient
is averaged exactly and m, v are updated from the average, as AdamW does; from then on v stays
frozen at its value at the end of the warm-up and each rank sends its candidate momentum over the
frozen denominator, ``(b1 * m + (1 - b1) * g) / (sqrt(v_hat) + eps)`` (linear in g, clipped to
Adam's largest step), whose compressed average becomes m. Buckets too small to compress keep
running exact AdamW. Every rank updates m and v from the same averaged bits, so they stay bitwise
identical.

``refresh_until`` (0/1 Adam's variance schedule) shortens the uncompressed warm-up: after it, the
variance is refreshed on exact steps at gaps that double every ``refreshes_per_doubling``
refreshes (0/1 Adam's ``var_update_scaler``) until ``refresh_until`` (its freeze step), each
refresh an AdamW step on the exact average (or the warm-up codec's, e.g. ``warmup_codec="int8"``,
whose two-phase average is the same on every rank); the steps between compress the momentum over
the latest denominator. With a 4-step warm-up and a refresh every doubling gap from 4 refreshes on,
a 600-step run has 33 uncompressed steps instead of 60.

``CompressedSGD`` is SGD with momentum with momentum correction, as Deep Gradient Compression:
each rank accumulates its own velocity and the velocity is compressed. DGC's two other pieces for
top-k are options: ``momentum_masking`` (a coordinate this rank's top-k has just sent restarts its
velocity from zero: what was sent already carried its accumulated momentum, and the stale velocity
would push the same coordinate again) and ``local_clip_norm`` (each rank clips its gradient before
it enters the velocity, so that the residual accumulated over the steps a coordinate waits stays
bounded).

    opt = gradzip.optim.FrozenVarianceAdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    state = gradzip.ddp.CompressionState("sign", warmup_steps=60, optimizer=opt)
    ddp_model.register_comm_hook(state, gradzip.ddp.compress_hook)
    loss.backward(); opt.step(); opt.zero_grad()          # p -= lr * (update + wd * p)

The hook (or ``SimulatedWorkers(..., optimizer=opt)``) computes what the optimizer sends around
the collective, and keeps the moments with the residuals, in ``CompressionState.state_dict()``.
Under FSDP2, ``gradzip.fsdp.compress(model, codec, warmup_steps=N, optimizer=opt)`` does it for
FrozenVarianceAdamW with the moments sharded (:mod:`gradzip.fsdp_adam`): each rank sends
``(1 - b1) * g`` over the frozen denominator and the shard's owner adds ``b1 * m``.
``opt.step()`` then applies the averaged update with decoupled weight decay; ``opt.state_dict()``
holds only the hyper-parameters (schedulers work as usual). :func:`compresses_direction` says
which codec wants which optimizer; docs/guide.md has the table.

With an uncompressed codec, CompressedSGD equals ``torch.optim.SGD`` with momentum and decoupled
weight decay, and FrozenVarianceAdamW equals ``torch.optim.AdamW`` through its warm-up.

Not for fp16 AMP: ``GradScaler.unscale_`` would divide the updates (which carry no loss scale)
by the scale. Use bf16 autocast. Bias correction counts the hook calls of a bucket, including a
non-finite step whose moments are restored.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch.distributed.tensor import DTensor

__all__ = ["MomentumDirection", "FrozenVarianceAdam", "CompressedSGD", "FrozenVarianceAdamW",
           "compresses_direction"]

# Where a gradzip.optim optimizer beats compressing the gradient for torch's own, by codec family
# and optimizer (tests/python/test_error_feedback.py and the convergence harness measure it): the
# ~30x codecs under AdamW (FrozenVarianceAdamW: AdamW on a compressed gradient lets the residual's
# swings through the second moment) and top-k under SGD with momentum (CompressedSGD, momentum
# correction, as Deep Gradient Compression). Everywhere else the gradient is compressed and the
# usual torch optimizer runs. Not in the list on purpose: sign with CompressedSGD trains well
# without error feedback (scaled sign of the velocity, like Signum) but error feedback makes it
# worse there.
_DIRECTION_RECIPES = {("sign", "adamw"), ("topk", "adamw"), ("topk", "sgd")}


def compresses_direction(codec: str, optimizer: str) -> bool:
    """True where the recommended recipe for ``codec`` (a spec) with ``optimizer`` ("sgd" for SGD
    with momentum, "adamw") is a gradzip.optim optimizer (CompressedSGD; FrozenVarianceAdamW,
    with an uncompressed warm-up), False where compress_hook compresses the gradient for torch's
    own optimizer."""
    if optimizer not in ("sgd", "adamw"):
        raise ValueError(f"gradzip.optim: optimizer must be 'sgd' or 'adamw', got {optimizer!r}")
    return (codec.split(":", 1)[0], optimizer) in _DIRECTION_RECIPES


class _Direction:
    """What the hook does around the collective for a gradzip.optim optimizer, on one rank and
    one bucket: ``apply_`` turns the rank's gradient into what it sends, before the compressor;
    ``finish_`` turns the average into what ``opt.step()`` applies (``p -= lr * (x + wd * p)``).
    ``moments``: this rank's ``buffers`` state tensors of the bucket; ``t``: 1-based count of the
    updates they have seen; ``exact_updates``: how many of them (this one included) averaged the
    gradient exactly, uncompressed (the variance's updates, for FrozenVarianceAdam);
    ``compressed``: whether this step's bucket is compressed; ``world``: the number of ranks;
    ``sent``: where ``masks_sent`` is True and the bucket went through top-k with error feedback,
    a bool tensor of the coordinates this rank's top-k sent (else None)."""

    buffers = 0
    needs_warmup = False  # True: CompressionState's warmup_steps must be >= 1
    _written = None  # the squared norm of what the hook left in the gradients this step
    # True: the moments are computed from the average alone, so they are the same on every rank
    # and stay valid at another world size (an elastic restart keeps them).
    moments_shared = False
    masks_sent = False  # True: finish_ wants the coordinates this rank's top-k sent

    def apply_(self, g: torch.Tensor, moments: list, t: int, exact_updates: int,
               compressed: bool, world: int) -> torch.Tensor:
        return g

    def finish_(self, avg: torch.Tensor, moments: list, t: int, exact_updates: int,
                compressed: bool, sent=None) -> torch.Tensor:
        return avg

    def refresh_steps(self, warmup_steps: int) -> frozenset:
        """The steps after the warm-up that average the gradient exactly too (none)."""
        return frozenset()

    def begin_step_(self) -> None:
        """The hook's first bucket of a step: what an earlier step left unapplied is forgotten."""
        self._written = None

    def wrote_(self, update: torch.Tensor) -> None:
        """The hook left ``update`` (one bucket's, as the gradients will hold it) for step()."""
        sq = torch.linalg.vector_norm(update, dtype=torch.float32).square()
        self._written = sq if self._written is None else self._written + sq

    def take_written_(self) -> Optional[torch.Tensor]:
        written, self._written = self._written, None
        return written


class MomentumDirection(_Direction):
    """``g <- u = momentum * u + g`` (Nesterov: ``g + momentum * u``) with this rank's velocity.

    On compressed steps only (uncompressed ones are exactly SGD with momentum):
    ``local_clip_norm`` clips each rank's gradient of a bucket to an L2 norm of
    ``local_clip_norm / sqrt(world)`` before it enters the velocity (DGC's local clipping; the hook
    sees one bucket at a time, so the threshold is per bucket); ``momentum_masking`` zeroes the
    velocity where this rank's top-k sent (DGC's momentum factor masking)."""

    buffers = 1

    def __init__(self, momentum: float = 0.9, nesterov: bool = False,
                 momentum_masking: bool = False, local_clip_norm: float | None = None):
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"gradzip.optim: momentum must be in [0, 1), got {momentum}")
        if local_clip_norm is not None and not local_clip_norm > 0.0:
            raise ValueError(f"gradzip.optim: local_clip_norm must be > 0 (or None), got "
                             f"{local_clip_norm}")
        self.momentum, self.nesterov = float(momentum), bool(nesterov)
        self.masks_sent = bool(momentum_masking)
        self.local_clip_norm = None if local_clip_norm is None else float(local_clip_norm)

    def apply_(self, g: torch.Tensor, moments: list, t: int, exact_updates: int,
               compressed: bool, world: int) -> torch.Tensor:
        (u,) = moments
        if compressed and self.local_clip_norm is not None:
            bound = self.local_clip_norm / world ** 0.5
            norm = float(torch.linalg.vector_norm(g))
            if norm > bound:  # a NaN norm passes through: the non-finite guard sees it
                g.mul_(bound / norm)
        u.mul_(self.momentum).add_(g)
        return g.add_(u, alpha=self.momentum) if self.nesterov else g.copy_(u)

    def finish_(self, avg: torch.Tensor, moments: list, t: int, exact_updates: int,
                compressed: bool, sent=None) -> torch.Tensor:
        if sent is not None:
            moments[0].masked_fill_(sent, 0.0)
        return avg

    def describe(self) -> str:
        return (f"momentum({self.momentum!r} nesterov={int(self.nesterov)} "
                f"masking={int(self.masks_sent)} local_clip_norm={self.local_clip_norm!r})")


class FrozenVarianceAdam(_Direction):
    """One Adam state of the averaged gradient, the same on every rank; past the warm-up, the
    momentum is what is compressed and the variance is frozen (see the module's doc).

    What a rank sends once compressing is its candidate momentum preconditioned by the frozen
    denominator, ``(b1 * m + (1 - b1) * g) / (sqrt(v_hat) + eps)``: still linear in g (v no longer
    changes), and O(1) in every coordinate, as the step it becomes. Sent in gradient units, a block
    scale set by the block's large coordinates lands on a coordinate whose variance is tiny and,
    divided by sqrt(v), becomes a step thousands of times too large (on the harness, sign diverged
    to NaN within 20 steps of the freeze)."""

    buffers = 2
    needs_warmup = True  # v is measured on exactly averaged gradients before it freezes
    moments_shared = True  # m and v are the average's (finish_), identical on every rank

    def __init__(self, betas=(0.9, 0.999), eps: float = 1e-8, refresh_until: int = 0,
                 refreshes_per_doubling: int = 16):
        b1, b2 = float(betas[0]), float(betas[1])
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"gradzip.optim: betas must be in [0, 1), got {betas}")
        if not eps > 0.0:
            raise ValueError(f"gradzip.optim: eps must be > 0, got {eps}")
        if int(refresh_until) < 0 or int(refreshes_per_doubling) < 1:
            raise ValueError("gradzip.optim: refresh_until must be >= 0 and refreshes_per_doubling "
                             f">= 1, got {refresh_until}, {refreshes_per_doubling}")
        self.betas, self.eps = (b1, b2), float(eps)
        self.refresh_until, self.refreshes_per_doubling = int(refresh_until), \
            int(refreshes_per_doubling)
        self._refreshes = None  # (warmup_steps, frozenset of refresh steps), built on first use

    def refresh_steps(self, warmup_steps: int) -> frozenset:
        """0/1 Adam's variance schedule after the warm-up: the steps whose gradient is averaged
        exactly to update the variance, from the warm-up's end, at gaps that double every
        ``refreshes_per_doubling`` refreshes (1, 1, ..., 2, 2, ..., 4, ...), before
        ``refresh_until`` (0: none, the variance frozen at the warm-up's end)."""
        if self._refreshes is None or self._refreshes[0] != warmup_steps:
            steps, step, gap, j = [], warmup_steps, 1, 0
            while step < self.refresh_until:
                steps.append(step)
                step += gap
                j += 1
                if j % self.refreshes_per_doubling == 0:
                    gap *= 2
            self._refreshes = (warmup_steps, frozenset(steps))
        return self._refreshes[1]

    def denominator(self, v: torch.Tensor, variance_updates: int) -> torch.Tensor:
        # A variance no exact step has updated (a bucket first seen after the warm-up) counts as
        # one update: v = 0, the denominator is eps and the step bound caps what is sent.
        bias = 1.0 - self.betas[1] ** max(variance_updates, 1)
        return torch.div(v, bias).sqrt_().add_(self.eps)

    @property
    def step_bound(self) -> float:
        """The largest step, in learning rates, that Adam takes on one coordinate: a first
        gradient after a run of zeros, (1 - b1) / sqrt(1 - b2). With v frozen a coordinate whose
        gradient grew past its warm-up variance (a unit behind a ReLU that rarely fires: v = 0)
        would step its gradient / eps; Adam's v would have grown with it, so each rank's candidate
        is clipped there (the harness diverged within 10 steps of the freeze without it)."""
        b1, b2 = self.betas
        return (1.0 - b1) / (1.0 - b2) ** 0.5

    def apply_(self, g: torch.Tensor, moments: list, t: int, exact_updates: int,
               compressed: bool, world: int) -> torch.Tensor:
        if compressed:  # this rank's candidate momentum, preconditioned: linear in its gradient
            m, v = moments
            b1 = self.betas[0]
            g.mul_(1.0 - b1).add_(m, alpha=b1)
            g.div_(self.denominator(v, exact_updates))
            g.clamp_(-self.step_bound, self.step_bound)
        return g

    def sharded_candidate_(self, g: torch.Tensor, m_over_den: torch.Tensor,
                           denominator: torch.Tensor) -> torch.Tensor:
        """Under FSDP (gradzip.fsdp): :meth:`apply_`'s candidate of a whole parameter group, in
        place, from its gradient ``g``, the group's frozen ``denominator`` and ``m_over_den``, the
        group's momentum over it as the last compressed average left it on every rank:
        ``(1 - b1) * g / denominator + b1 * m_over_den``, clipped to step_bound."""
        b1 = self.betas[0]
        g.mul_(1.0 - b1).div_(denominator).add_(m_over_den, alpha=b1)
        return g.clamp_(-self.step_bound, self.step_bound)

    def compressed_finish_(self, avg: torch.Tensor, m: torch.Tensor, denominator: torch.Tensor,
                           t: int) -> torch.Tensor:
        """A compressed step's end, in place: ``avg``, the averaged candidates (the momentum over
        the frozen ``denominator``), becomes the update; m keeps it in gradient units."""
        m.copy_(avg).mul_(denominator)
        return avg.div_(1.0 - self.betas[0] ** t)

    def finish_(self, avg: torch.Tensor, moments: list, t: int, exact_updates: int,
                compressed: bool, sent=None) -> torch.Tensor:
        m, v = moments
        b1, b2 = self.betas
        if compressed:  # avg: the averaged momentum over the frozen denominator
            return self.compressed_finish_(avg, m, self.denominator(v, exact_updates), t)
        m.mul_(b1).add_(avg, alpha=1.0 - b1)  # AdamW on the exact average
        v.mul_(b2).addcmul_(avg, avg, value=1.0 - b2)  # (its bias: the exact updates it has seen)
        torch.div(v, 1.0 - b2 ** exact_updates, out=avg).sqrt_().add_(self.eps)
        return avg.reciprocal_().mul_(m).div_(1.0 - b1 ** t)

    def describe(self) -> str:
        return (f"frozen_variance_adam(betas={self.betas[0]!r},{self.betas[1]!r} eps={self.eps!r} "
                f"refresh_until={self.refresh_until} "
                f"refreshes_per_doubling={self.refreshes_per_doubling})")


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: FSDP2's sharded parameters and gradients are DTensors, and the
    update written for them (gradzip.fsdp) is this rank's shard's, as the check compares it."""
    return t.to_local() if isinstance(t, DTensor) else t


class _AppliesDirection(torch.optim.Optimizer):
    """``p -= lr * (p.grad + weight_decay * p)``, where ``p.grad`` holds the averaged direction
    written by a CompressionState or SimulatedWorkers that was given this optimizer."""

    def __init__(self, params: Iterable, defaults: dict, direction):
        if defaults["lr"] < 0.0 or defaults["weight_decay"] < 0.0:
            raise ValueError("gradzip.optim: lr and weight_decay must be >= 0")
        super().__init__(params, defaults)
        self.direction = direction
        self.attached = False  # set by the hook's state: without it p.grad is a plain gradient
        self._deferred = None  # a CUDA step's check, read at the next step (no host sync)
        self._checked = 0

    def _check_gradients(self, grads: list) -> None:
        """Raises unless the gradients hold what the hook left in them this step: anything that
        edits them in between (clip_grad_norm_, GradScaler.unscale_) would change the update
        silently. Compared by their norm (a scale of 1 +- 1e-3 passes: it changes the update by
        no more). On CUDA the comparison is read at the next step, after the first two steps."""
        name = f"gradzip.optim.{type(self).__name__}"
        written = self.direction.take_written_()
        if written is None:
            raise RuntimeError(
                f"{name}.step(): no compression hook reduced the gradients since the last step "
                "(a backward pass under DDP's no_sync(), or gradients set by hand?); p.grad must "
                "hold what CompressionState's hook (or SimulatedWorkers) computed for this "
                "optimizer (a CompressionState loaded from a pickle: state.attach(optimizer))")
        have = (torch.stack(torch._foreach_norm(grads)).float().square().sum() if grads
                else torch.zeros_like(written))
        have = have.to(written.device)
        deferred, self._deferred = self._deferred, None
        if deferred is not None:
            self._raise_if_edited(*deferred)
        if written.device.type == "cuda" and self._checked >= 2:
            self._deferred = (have, written)
        else:
            self._raise_if_edited(have, written)
        self._checked += 1

    def _raise_if_edited(self, have: torch.Tensor, written: torch.Tensor) -> None:
        # a non-finite update (an overflow step) is compared as such: NaN to NaN
        if bool(torch.isclose(have.sqrt(), written.sqrt(), rtol=1e-3, atol=1e-12,
                              equal_nan=True)):
            return
        raise RuntimeError(
            f"gradzip.optim.{type(self).__name__}.step(): p.grad was changed after the "
            f"compression hook wrote it (norm {float(have.sqrt()):.6g}, the hook wrote "
            f"{float(written.sqrt()):.6g}). With CompressionState(optimizer=...), p.grad holds "
            "this optimizer's update, not the gradient: torch.nn.utils.clip_grad_norm_ (or "
            "accelerator.clip_grad_norm_), GradScaler.unscale_ / scaler.step, or anything else "
            "that edits gradients between backward() and step() would change the update. Clip "
            "with CompressionState(..., max_grad_norm=C) instead (each rank's gradient, before "
            "it is compressed; state.grad_norm is its norm for logging; gradzip.fsdp has no "
            "such clip yet) and remove the clip from the loop; for mixed precision use bf16 "
            "autocast without a GradScaler")

    @torch.no_grad()
    def step(self, closure=None):
        if not self.attached:
            raise RuntimeError(
                f"gradzip.optim.{type(self).__name__}: no compression state computes its "
                "direction; pass it as CompressionState(..., optimizer=opt) (DDP), "
                "gradzip.fsdp.compress(..., optimizer=opt) (FSDP2) or "
                "SimulatedWorkers(..., optimizer=opt) before stepping")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_gradients([_local(p.grad) for group in self.param_groups
                               for p in group["params"] if p.grad is not None])
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                p, grad = _local(p), _local(p.grad)
                if wd:
                    p.mul_(1.0 - lr * wd)
                p.add_(grad.to(p.dtype), alpha=-lr)
        return loss


class FrozenVarianceAdamW(_AppliesDirection):
    """AdamW with one state on every rank whose momentum is compressed once the compression's
    warm-up (``CompressionState(warmup_steps=N)``, N >= 1) has measured the variance, which then
    stays frozen; decoupled weight decay. ``betas`` and ``eps`` are the same for every parameter
    group (the hook updates the moments per bucket, across groups)."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, refresh_until: int = 0,
                 refreshes_per_doubling: int = 16):
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay},
                         FrozenVarianceAdam(betas, eps, refresh_until, refreshes_per_doubling))


class CompressedSGD(_AppliesDirection):
    """SGD with momentum, the velocity kept per rank and compressed (momentum correction);
    decoupled weight decay (``p -= lr * wd * p``). ``momentum_masking`` and ``local_clip_norm``:
    Deep Gradient Compression's momentum factor masking (top-k with error feedback) and local
    gradient clipping, on compressed steps (see MomentumDirection). Masking is on by default: on
    the harness's SGD suite, top-k's momentum correction with error feedback and without masking
    trained worse than without error feedback on every seed (bench/RESULTS.md §3); the clipping
    threshold depends on the model's gradient scale, so it has none."""

    def __init__(self, params, lr: float = 1e-2, momentum: float = 0.9,
                 weight_decay: float = 0.0, nesterov: bool = False,
                 momentum_masking: bool = True, local_clip_norm: float | None = None):
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay},
                         MomentumDirection(momentum, nesterov, momentum_masking, local_clip_norm))
