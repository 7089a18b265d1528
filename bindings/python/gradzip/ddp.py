"""A DDP communication hook that compresses gradients with error feedback.

    from gradzip.ddp import CompressionState, compress_hook
    ddp_model.register_comm_hook(CompressionState("topk:0.01"), compress_hook)

A drop-in for PyTorch's hooks (``default_hooks.allreduce_hook``, ``powerSGD_hook``): the hook
returns a Future holding the bucket's averaged gradient (written in place into ``bucket.buffer()``).
The collective follows the codec (see :mod:`gradzip.collective`): two-phase all-to-all /
all-gather with an fp32 sum for fp32/fp16/bf16/int8/sign, all-gather of fixed-size payloads for
top-k. Collectives are asynchronous ``torch.distributed`` calls chained with ``then``, on whatever
backend the process group has; nothing on the hot path synchronises with the host.

:class:`SimulatedWorkers` runs the same algorithm for W workers in one process, with exactly the
same arithmetic: its result equals the multi-rank hook's bit for bit (warm-up and small buckets,
which go through a plain fp32 all-reduce whose summation order is the backend's, match to fp32
rounding).
"""

import logging
import math
from typing import List, Optional

import torch
import torch.distributed as dist

from .collective import (CodecPlan, DistExchange, NonfiniteGuard, Sequencer, StateStore, drive_async,
                         piece_cuts, reduce_bucket, run_simulated, shard_bounds, traffic)

__all__ = ["CompressionState", "compress_hook", "SimulatedWorkers"]

logger = logging.getLogger(__name__)

_FINGERPRINT_BYTES = 256
_STATE_VERSION = 2  # 2: optimizer moments added; owner residual only for optimizer directions


class _Config:
    """What every rank must agree on, and the per-step policy shared by the hook and the
    simulation: warm-up steps and small buckets go uncompressed."""

    def __init__(self, codec: str, error_feedback: bool, warmup_steps: int, min_compress_numel: int,
                 guard_nonfinite: bool, optimizer=None):
        self.plan = CodecPlan.parse(codec)
        self.direction = None
        if optimizer is not None:
            direction = getattr(optimizer, "direction", None)
            if direction is None or not hasattr(direction, "apply_"):
                raise TypeError("gradzip: optimizer must be a gradzip.optim optimizer "
                                f"(CompressedAdamW, CompressedSGD), got {type(optimizer).__name__}")
            self.direction = direction
        if warmup_steps < 0 or min_compress_numel < 0:
            raise ValueError("gradzip: warmup_steps and min_compress_numel must be >= 0")
        self.error_feedback = bool(error_feedback)
        self.warmup_steps = int(warmup_steps)
        self.min_compress_numel = int(min_compress_numel)
        self.guard_nonfinite = bool(guard_nonfinite)

    @property
    def codec(self) -> str:
        return self.plan.spec

    def describe(self, world: int) -> str:
        return (f"codec={self.plan.spec} error_feedback={int(self.error_feedback)} "
                f"warmup_steps={self.warmup_steps} min_compress_numel={self.min_compress_numel} "
                f"guard_nonfinite={int(self.guard_nonfinite)} world={world} direction="
                f"{'none' if self.direction is None else self.direction.describe()}")

    def compresses(self, step: int, n: int, world: int) -> bool:
        # n >= world: every shard of a two-phase bucket holds at least one element.
        return step >= self.warmup_steps and n >= max(self.min_compress_numel, world, 1)

    @property
    def keeps_state(self) -> bool:
        return self.error_feedback or self.direction is not None

    def bucket_state(self, store: StateStore, index: int, layout, n: int, world: int, rank: int,
                     device):
        """This rank's state of one bucket, or None when it keeps none."""
        moments = 0 if self.direction is None else self.direction.buffers
        if not self.error_feedback and not moments:
            return None
        owner_n = None
        if self.error_feedback and self.plan.two_phase and self.direction is not None:
            bounds = shard_bounds(n, world)
            owner_n = bounds[rank + 1] - bounds[rank]
        return store.get(index, layout, n, self.error_feedback, owner_n, moments, device)

    def apply_direction(self, x: torch.Tensor, st) -> None:
        """Turns this rank's gradient ``x`` into its optimizer direction, in place."""
        if self.direction is not None:
            st.updates += 1
            self.direction.apply_(x, st.moments, st.updates)


class _Stats:
    """Bytes sent/received by this rank in the last completed step, and the compression ratio
    against an uncompressed fp32 ring all-reduce of the same buckets."""

    def __init__(self):
        self.last = {"step": -1, "bytes_sent": 0, "bytes_received": 0, "raw_bytes": 0,
                     "compression_ratio": 1.0, "buckets": 0, "compressed_buckets": 0}
        self._acc = self._zero()

    @staticmethod
    def _zero():
        return {"bytes_sent": 0, "bytes_received": 0, "raw_bytes": 0, "buckets": 0,
                "compressed_buckets": 0}

    def add(self, plan, n, world, rank, compressed, cuts=()):
        sent, received = traffic(plan if compressed else None, n, world, rank, cuts)
        raw, _ = traffic(None, n, world, rank)
        a = self._acc
        a["bytes_sent"] += sent
        a["bytes_received"] += received
        a["raw_bytes"] += raw
        a["buckets"] += 1
        a["compressed_buckets"] += int(compressed)

    def end_step(self, step):
        a = self._acc
        ratio = a["raw_bytes"] / a["bytes_sent"] if a["bytes_sent"] else 1.0
        self.last = dict(a, step=step, compression_ratio=ratio)
        self._acc = self._zero()


class CompressionState:
    """State of :func:`compress_hook`, one per DDP model (like PowerSGDState).

    Args:
        codec: codec spec, e.g. ``"int8"``, ``"sign:block=1024"``, ``"topk:0.01"``, ``"bf16"``.
        process_group: the group to reduce over (None: the default group).
        error_feedback: keep per-bucket residuals (``c = g + e; e = c - decode(encode(c))``).
        warmup_steps: the first steps run uncompressed (plain fp32 all-reduce average).
        min_compress_numel: buckets with fewer elements run uncompressed (DDP's first bucket after
            the rebuild is small; headers and latency dominate there).
        guard_nonfinite: when any reduced bucket of a step holds Inf/NaN (an AMP overflow step,
            which GradScaler skips), every residual keeps its value of before the step. Costs a
            copy of the residuals per step (held until the step ends). The restore is applied at
            the next step's first hook call or by ``state_dict()``, on the device, without a host
            synchronisation.
        optimizer: a gradzip.optim optimizer (CompressedAdamW, CompressedSGD): the hook then turns
            each rank's gradient into that optimizer's direction (its moments kept here, per
            bucket, with the residuals) and averages the direction, which ``optimizer.step()``
            applies. None: the gradient itself is compressed (for torch's optimizers).

    The first hook call checks, with one small all-gather, that every rank uses the same
    configuration, and raises ``ValueError`` on all ranks naming the difference (instead of hanging
    in mismatched collectives). ``stats`` holds the last step's traffic; ``state_dict()`` /
    ``load_state_dict()`` carry the residuals and the step count. The state pickles without its
    process group (restored as the default group), as PowerSGDState does.

    Residuals are keyed by bucket index and checked against the bucket's layout (element count and
    parameter shapes, in bucket order: DDP's rebuild after the first iteration can keep a bucket's
    size and reverse its parameters). On a mismatch they restart from zero. A resumed run
    therefore reproduces the uninterrupted one exactly when its buckets have the saved layout, e.g.
    with ``find_unused_parameters=True`` (DDP never rebuilds); with a rebuild, the resumed run's
    first iterations (DDP's initial layout) start from zero residuals.

    Two-phase codecs issue their second collective from the first one's completion callback, on a
    second process group created (with ``use_local_synchronization``) at the first hook call, in
    bucket order on every rank (see ``collective.Sequencer``). Residuals are in the units of the
    gradient the hook sees: with AMP they include GradScaler's scale.
    """

    def __init__(self, codec: str, process_group=None, error_feedback: bool = True,
                 warmup_steps: int = 0, min_compress_numel: int = 4096,
                 guard_nonfinite: bool = True, optimizer=None):
        self.config = _Config(codec, error_feedback, warmup_steps, min_compress_numel, guard_nonfinite,
                              optimizer)
        self.process_group = process_group
        self.step = 0
        self._ef = StateStore()
        self._stats = _Stats()
        self._runtime = None  # DistExchange, built at the first hook call
        self._guard = NonfiniteGuard() if guard_nonfinite and self.config.keeps_state else None
        if optimizer is not None:
            optimizer.attached = True
        self._guard_step = 0  # the step whose residual updates the guard holds

    # -- public ---------------------------------------------------------------------------------
    @property
    def codec(self) -> str:
        return self.config.codec

    @property
    def stats(self) -> dict:
        return dict(self._stats.last)

    def state_dict(self) -> dict:
        self._commit()
        return {"version": _STATE_VERSION, "codec": self.config.codec, "step": self.step,
                "error_feedback": self.config.error_feedback, "residuals": self._ef.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"gradzip: unsupported CompressionState version {state.get('version')}")
        if state["codec"] != self.config.codec:
            raise ValueError(f"gradzip: checkpoint was saved with codec {state['codec']!r}, "
                             f"this state uses {self.config.codec!r}")
        self._commit()
        self.step = int(state["step"])
        self._ef.load_state_dict(state["residuals"])

    # -- pickling without the process group (PowerSGD, PR #79334) -------------------------------
    def __getstate__(self):
        self._commit()
        d = dict(self.__dict__)
        d["process_group"] = None
        d["_runtime"] = None
        return d

    def __setstate__(self, d):
        self.__dict__.update(d)
        logger.info("gradzip: CompressionState unpickled; process_group set to the default group")

    # -- internals --------------------------------------------------------------------------------
    def _commit(self) -> None:
        """Settles the residual updates of the finished step (all its buckets are reduced: DDP
        waited for their futures before the next forward)."""
        if self._guard is not None:
            self._guard.commit()
            self._guard_step = self.step

    def _group(self):
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def _setup(self, device) -> DistExchange:
        if self._runtime is None:
            group = self._group()
            self._check_config(group, device)
            group2 = None
            if self.config.plan.two_phase and group.size() > 1:
                # Second collectives of two-phase buckets go on their own group (see Sequencer).
                group2 = dist.new_group(dist.get_process_group_ranks(group),
                                        backend=dist.get_backend(group),
                                        use_local_synchronization=True)
            self._runtime = DistExchange(group, group2, Sequencer())
        return self._runtime

    def _check_config(self, group, device) -> None:
        """All-gathers a fixed-size description of the configuration (once, synchronously) and
        fails on every rank if they differ."""
        world = group.size()
        text = self.config.describe(world).encode()[:_FINGERPRINT_BYTES]
        mine = torch.zeros(_FINGERPRINT_BYTES, dtype=torch.uint8)
        mine[:len(text)] = torch.tensor(list(text), dtype=torch.uint8)
        mine = mine.to(device)
        rows = torch.empty((world, _FINGERPRINT_BYTES), dtype=torch.uint8, device=device)
        dist.all_gather(list(rows.unbind(0)), mine, group=group)
        rows = rows.cpu()
        descs = [bytes(r.tolist()).rstrip(b"\0").decode(errors="replace") for r in rows]
        if len(set(descs)) != 1:
            listing = "; ".join(f"rank {i}: {d}" for i, d in enumerate(descs))
            raise ValueError("gradzip.ddp: ranks are configured differently, refusing to reduce "
                             f"(every rank must use the same CompressionState settings): {listing}")


def _bucket_layout(bucket, n: int):
    params = bucket.parameters() if hasattr(bucket, "parameters") else []
    return (n, tuple(tuple(p.shape) for p in params))


def _layout_numels(layout):
    """Element counts of a bucket's tensors, in buffer order, from its layout (one tensor if the
    shapes are unknown)."""
    n, shapes = layout
    numels = [math.prod(s) for s in shapes]
    return numels if sum(numels) == n else [n]


def _allreduce_average(tensor: torch.Tensor, group) -> torch.futures.Future[torch.Tensor]:
    """PyTorch's allreduce_hook: divide first (no overflow), sum; fp32."""
    tensor.div_(group.size())
    return dist.all_reduce(tensor, group=group, async_op=True).get_future().then(
        lambda fut: fut.value()[0])


def compress_hook(state: "CompressionState",
                  bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: averages ``bucket`` across ``state``'s process group with the
    state's codec and error feedback. Register with
    ``ddp_model.register_comm_hook(state, compress_hook)``. Returns a Future of the bucket buffer,
    reduced in place (DDP does not divide by the world size once a hook is registered: this does)."""
    buf = bucket.buffer()
    exchange = state._setup(buf.device)
    group = exchange.group
    world, rank = group.size(), group.rank()
    n = buf.numel()
    cfg = state.config
    compressed = cfg.compresses(state.step, n, world) and world > 1
    layout = _bucket_layout(bucket, n)
    cuts = piece_cuts(cfg.plan, _layout_numels(layout))
    state._stats.add(cfg.plan, n, world, rank, compressed, cuts)
    guard = state._guard
    if guard is not None and state._guard_step != state.step:
        state._commit()  # first bucket of a new step: the previous step is complete

    st = cfg.bucket_state(state._ef, bucket.index(), layout, n, world, rank, buf.device)
    # bf16/fp16 buckets are upcast for the codecs and the direction (the state is fp32)
    keep = buf.dtype == torch.float32 or (not compressed and cfg.direction is None)
    x = buf if keep else buf.float()
    if guard is not None and st is not None:
        guard.save(st.tensors(), st.backups())  # before any update: an overflow step undoes all
    cfg.apply_direction(x, st)
    if not compressed:
        fut = _allreduce_average(x, group)
        if guard is not None:  # an overflow in an uncompressed bucket also voids the step
            def flag(f):
                guard.flag(f.value())
                return f.value()
            fut = fut.then(flag)
    else:
        result = torch.futures.Future(devices=[buf.device]) if buf.is_cuda else torch.futures.Future()
        ticket = exchange.sequencer.reserve() if cfg.plan.two_phase else None
        drive_async(reduce_bucket(cfg.plan, world, rank, x, st, x, guard, cuts), exchange, result,
                    ticket)
        fut = result
    if x is not buf:
        fut = fut.then(lambda f: buf.copy_(f.value()))

    if bucket.is_last():
        state._stats.end_step(state.step)
        state.step += 1
    return fut


class SimulatedWorkers:
    """W workers in one process, each with its own error-feedback state, reduced with exactly the
    arithmetic of :func:`compress_hook` (the same algorithm code; the collectives done in memory).

        sim = SimulatedWorkers("int8", world_size=4)
        avg = sim.reduce([g0, g1, g2, g3])   # what every rank's bucket holds after the hook

    Each call reduces one bucket (``bucket_index``, default 0); ``is_last=True`` (the default) ends
    the step, as DDP's last bucket does: the step count advances, ``stats`` is updated and, with
    ``guard_nonfinite``, the residual updates of the step are kept or (if any bucket of the step was
    not finite) undone. Compressed buckets equal the multi-rank hook bit for bit; warm-up steps and
    buckets below ``min_compress_numel`` (a plain fp32 all-reduce on real ranks, whose summation
    order is the backend's) are summed here in rank order of ``g / W``: equal to fp32 rounding.
    """

    def __init__(self, codec: str, world_size: int, error_feedback: bool = True,
                 warmup_steps: int = 0, min_compress_numel: int = 4096, guard_nonfinite: bool = True,
                 optimizer=None):
        if int(world_size) < 1:
            raise ValueError(f"gradzip: world_size must be >= 1, got {world_size}")
        self.config = _Config(codec, error_feedback, warmup_steps, min_compress_numel, guard_nonfinite,
                              optimizer)
        self.world_size = int(world_size)
        self.step = 0
        self._ef = [StateStore() for _ in range(self.world_size)]
        self._stats = _Stats()
        use_guard = self.config.guard_nonfinite and self.config.keeps_state
        self._guards = [NonfiniteGuard() if use_guard else None for _ in range(self.world_size)]
        if optimizer is not None:
            optimizer.attached = True

    @property
    def codec(self) -> str:
        return self.config.codec

    @property
    def stats(self) -> dict:
        """Rank 0's traffic in the last step, as ``CompressionState.stats``."""
        return dict(self._stats.last)

    def residuals(self, rank: int = 0) -> List[torch.Tensor]:
        """The error-feedback residuals a worker holds (worker and owner, every bucket)."""
        return [t for st in self._ef[rank].buckets.values()
                for t in (st.residual, st.owner_residual) if t is not None]

    def reduce(self, grads: List[torch.Tensor], bucket_index=0, is_last: bool = True,
               numels: Optional[List[int]] = None) -> torch.Tensor:
        """``numels``: the element counts of the tensors the bucket holds, in order (as DDP's
        ``bucket.parameters()``); block-scaled codecs restart their blocks at each boundary."""
        world = self.world_size
        if len(grads) != world:
            raise ValueError(f"gradzip: expected {world} gradients, got {len(grads)}")
        cfg = self.config
        # a copy where the direction is computed in place: the caller's gradients stay as they are
        flats = [g.detach().reshape(-1).to(torch.float32, copy=cfg.direction is not None)
                 .contiguous() for g in grads]
        n = flats[0].numel()
        if any(f.numel() != n or f.device != flats[0].device for f in flats):
            raise ValueError("gradzip: all gradients must have the same numel and device")
        numels = [n] if numels is None else [int(m) for m in numels]
        if sum(numels) != n or any(m < 1 for m in numels):
            raise ValueError(f"gradzip: numels {numels} do not partition the {n} elements")
        layout = (n, tuple((m,) for m in numels) if len(numels) > 1 else ())
        cuts = piece_cuts(cfg.plan, numels)
        compressed = cfg.compresses(self.step, n, world) and world > 1
        self._stats.add(cfg.plan, n, world, 0, compressed, cuts)
        states = [cfg.bucket_state(self._ef[r], bucket_index, layout, n, world, r, flats[r].device)
                  for r in range(world)]
        for r in range(world):
            if self._guards[r] is not None and states[r] is not None:
                self._guards[r].save(states[r].tensors(), states[r].backups())
            cfg.apply_direction(flats[r], states[r])
        if not compressed:
            out = torch.zeros_like(flats[0])
            for f in flats:
                out += f / world
            for g in self._guards:
                if g is not None:
                    g.flag(out)
        else:
            outs = [torch.empty_like(f) for f in flats]
            run_simulated([reduce_bucket(cfg.plan, world, r, flats[r], states[r], outs[r],
                                         self._guards[r], cuts) for r in range(world)])
            out = outs[0]
        if is_last:
            for g in self._guards:
                if g is not None:
                    g.commit()
            self._stats.end_step(self.step)
            self.step += 1
        return out

    def state_dict(self) -> dict:
        return {"version": _STATE_VERSION, "codec": self.config.codec, "step": self.step,
                "world_size": self.world_size,
                "workers": [store.state_dict() for store in self._ef]}

    def load_state_dict(self, state: dict) -> None:
        if state.get("codec") != self.config.codec or state.get("world_size") != self.world_size:
            raise ValueError("gradzip: SimulatedWorkers checkpoint is for codec "
                             f"{state.get('codec')!r} x {state.get('world_size')}, this is "
                             f"{self.config.codec!r} x {self.world_size}")
        self.step = int(state["step"])
        for store, d in zip(self._ef, state["workers"]):
            store.load_state_dict(d)
