"""A DDP communication hook that compresses gradients with error feedback.

    from gradzip.ddp import CompressionState, compress_hook
    ddp_model.register_comm_hook(CompressionState("topk:0.01"), compress_hook)

A drop-in for PyTorch's hooks (``default_hooks.allreduce_hook``, ``powerSGD_hook``): the hook
returns a Future holding the bucket's averaged gradient (written in place into ``bucket.buffer()``).
The reduction is C++ (``torch.classes.gradzip.CompressedAllreduce`` over the state's
``c10d::ProcessGroup``, see bindings/torch/bucket_reduction.hpp): one all-reduce (SUM) of the
16-bit payload for fp16/bf16 (``cast_sum="wire"``, the default), two-phase all-to-all /
all-gather with an fp32 sum for int8/sign/fp32 and for the casts with ``cast_sum="fp32"``,
all-gather of fixed-size payloads for top-k, two fp32 all-reduces of low-rank factors for
``lowrank:R`` (bindings/torch/lowrank_reduction.hpp). This module keeps the policy (warm-up, small buckets,
the optimizer direction) and the state (:mod:`gradzip.collective`).

:class:`SimulatedWorkers` runs the same C++ phases for W workers in one process, the collectives
done in memory: its result equals the multi-rank hook's bit for bit, except where the backend
sums: the casts' one all-reduce (``cast_sum="wire"``; equal to the wire dtype's rounding of a
W-term sum, see collective.run_simulated) and warm-up and small buckets (a plain fp32 all-reduce;
equal to fp32 rounding).
"""

import logging
import math
import os
import warnings
from typing import List, Optional

import torch
import torch.distributed as dist

from . import _ops  # noqa: F401  (loads the extension that defines torch.classes.gradzip)
from ._groups import gather_group_name, reducing_group, require_same_config
from .collective import (CodecPlan, StateStore, TrafficStats, layout_exact, layout_numels,
                         layout_rows, param_offsets, run_simulated, run_simulated_lowrank,
                         shard_bounds)
from .wire import MIN_COMPRESS_NUMEL

__all__ = ["CompressionState", "compress_hook", "SimulatedWorkers"]

logger = logging.getLogger(__name__)

# 3: state kept per bucket but described per parameter (key and shape), so that it survives a
#    re-bucketing; owner residuals carry their shard offset.
_STATE_VERSION = 3


class _Config:
    """What every rank must agree on, and the per-step policy shared by the hook, the
    simulation and gradzip.fsdp: warm-up steps and small buckets go uncompressed."""

    def __init__(self, codec: str, error_feedback: bool, warmup_steps: int, min_compress_numel: int,
                 guard_nonfinite: bool, optimizer=None, cast_sum: Optional[str] = None,
                 warmup_codec: Optional[str] = None, uncompressed_numel: int = 0):
        self.direction = None
        if optimizer is not None:
            direction = getattr(optimizer, "direction", None)
            if direction is None or not hasattr(direction, "apply_"):
                raise TypeError("gradzip: optimizer must be a gradzip.optim optimizer "
                                f"(FrozenVarianceAdamW, CompressedSGD), got "
                                f"{type(optimizer).__name__}")
            self.direction = direction
        if warmup_steps < 0 or min_compress_numel < 0 or uncompressed_numel < 0:
            raise ValueError("gradzip: warmup_steps, min_compress_numel and uncompressed_numel "
                             "must be >= 0")
        if self.direction is not None and self.direction.needs_warmup and warmup_steps < 1:
            raise ValueError(f"gradzip: {type(optimizer).__name__} measures the variance on the "
                             "uncompressed warm-up steps before it freezes it: warmup_steps must "
                             "be >= 1 (about the learning rate's warm-up)")
        self.error_feedback = bool(error_feedback)
        # The owner residual exists only where one rank forms the sum in fp32 (the two-phase path).
        if cast_sum is None:
            cast_sum = "fp32" if self.wants_owner_residual else "wire"
        self.plan = CodecPlan.parse(codec, cast_sum)
        if self.wants_owner_residual and self.plan.wire_sum:
            raise ValueError(f"gradzip: {type(optimizer).__name__} with error feedback keeps the "
                             f"residual of the summed {self.plan.kind}, which needs the two-phase "
                             "fp32 sum: cast_sum='wire' sums in the wire dtype inside the backend; "
                             "use cast_sum='fp32' (or leave it unset)")
        self.warmup_steps = int(warmup_steps)
        # The warm-up's transport: the gradient itself (no error feedback: the warm-up is there to
        # see exact averages, and a 16-bit rounding of the average is far below its noise), summed
        # as the codec sums it; None: the plain fp32 all-reduce.
        self.warmup_plan = None if warmup_codec is None else CodecPlan.parse(warmup_codec)
        if self.warmup_plan is not None and self.warmup_steps < 1:
            raise ValueError(f"gradzip: warmup_codec={warmup_codec!r} needs warmup_steps >= 1")
        if self.warmup_plan is not None and self.warmup_plan.lowrank_rank:
            raise ValueError("gradzip: warmup_codec must encode the gradient itself (fp16, bf16, "
                             f"int8, ...), not {self.warmup_plan.spec}")
        self.min_compress_numel = int(min_compress_numel)
        self.uncompressed_numel = int(uncompressed_numel)
        self.guard_nonfinite = bool(guard_nonfinite)

    @property
    def codec(self) -> str:
        return self.plan.spec

    def describe(self, world: int) -> str:
        return (f"codec={self.plan.spec} cast_sum={self.plan.cast_sum} "
                f"error_feedback={int(self.error_feedback)} "
                f"warmup_steps={self.warmup_steps} warmup_codec="
                f"{'fp32' if self.warmup_plan is None else self.warmup_plan.spec} "
                f"min_compress_numel={self.min_compress_numel} "
                f"uncompressed_numel={self.uncompressed_numel} "
                f"guard_nonfinite={int(self.guard_nonfinite)} world={world} direction="
                f"{'none' if self.direction is None else self.direction.describe()}")

    def compresses(self, step: int, n: int, world: int) -> bool:
        """Past the warm-up and big enough: the codec carries the bucket, with error feedback and
        the optimizer's compressed direction."""
        return world > 1 and step >= self.warmup_steps and self._big_enough(n, world)

    def _big_enough(self, n: int, world: int) -> bool:
        # n >= world: every shard of a two-phase bucket holds at least one element.
        return n >= max(self.min_compress_numel, world, 1)

    def transport(self, step: int, n: int, world: int) -> Optional[CodecPlan]:
        """The codec that carries a bucket of ``n`` elements at ``step``: the codec once
        compressing, the warm-up codec (if any) during the warm-up, else None (an fp32 all-reduce
        of the average)."""
        if self.compresses(step, n, world):
            return self.plan
        if self.warmup_plan is not None and world > 1 and self._big_enough(n, world):
            return self.warmup_plan
        return None

    def exact(self, layout) -> List[bool]:
        """Per tensor of the bucket (collective.layout_numels), whether it travels in fp32."""
        return layout_exact(layout, self.uncompressed_numel)

    @property
    def wants_owner_residual(self) -> bool:
        """The owner's second residual on the reduced shard of a two-phase bucket: measured to help
        only where an optimizer direction is compressed (on raw gradients it compounds the two
        errors)."""
        return self.error_feedback and self.direction is not None

    @property
    def keeps_state(self) -> bool:
        return self.error_feedback or self.direction is not None or self.plan.lowrank_rank > 0

    def new_guard(self):
        """A C++ NonfiniteGuard where there is state to protect, else None."""
        return torch.classes.gradzip.NonfiniteGuard() if self.guard_nonfinite and self.keeps_state \
            else None

    def bucket_state(self, store: StateStore, index: int, layout, world: int, rank: int, device):
        """This rank's state of one bucket, or None when it keeps none."""
        moments = 0 if self.direction is None else self.direction.buffers
        q_rank = self.plan.lowrank_rank  # lowrank keeps its Q factors with or without feedback
        if not self.error_feedback and not moments and not q_rank:
            return None
        owner = None
        if self.wants_owner_residual and self.plan.two_phase:
            bounds = shard_bounds(layout[0], world)
            owner = (bounds[rank], bounds[rank + 1] - bounds[rank])
        return store.get(index, layout, self.error_feedback, owner, moments, device, q_rank)

    def apply_direction(self, x: torch.Tensor, st, compressed: bool) -> None:
        """Turns this rank's gradient ``x`` into what it sends for the optimizer, in place."""
        if self.direction is not None:
            st.updates += 1
            self.direction.apply_(x, st.moments, st.updates, self.warmup_steps, compressed)

    def finish_direction(self, avg: torch.Tensor, st, compressed: bool) -> None:
        """Turns the average ``avg`` into what the optimizer applies, in place (after
        apply_direction of the same step)."""
        if self.direction is not None:
            self.direction.finish_(avg, st.moments, st.updates, self.warmup_steps, compressed)


def _saved(st) -> list:
    return [] if st is None else [t for t in st.tensors() if t is not None]


class _ReducerState:
    """What the DDP hook's and FSDP's states share: the settings, the step count, the traffic
    counters, the C++ reduction (built at the first call), the non-finite guard, settling a
    finished step, and pickling without the C++ objects."""

    def __init__(self, config: _Config):
        self.config = config
        self.step = 0
        self._stats = TrafficStats()
        self._runtime = None  # torch.classes.gradzip.CompressedAllreduce, built at the first call
        self._guard = config.new_guard()
        self._guard_step = 0  # the step whose residual updates the guard holds

    @property
    def codec(self) -> str:
        return self.config.codec

    @property
    def stats(self) -> dict:
        return dict(self._stats.last)

    def _commit(self) -> None:
        """Settles the finished step (all of its reductions are complete: DDP waited for their
        futures before the next forward, FSDP's reduce-scatter is synchronous): restores the
        residuals if a reduced piece was not finite, and raises a decode error the device has
        reported."""
        if self._guard is not None:
            self._guard.commit()
        self._guard_step = self.step
        if self._runtime is not None:
            self._runtime.check_errors()

    def __getstate__(self):
        self._commit()
        d = dict(self.__dict__)
        d["_runtime"] = None
        d["_guard"] = None  # C++ objects; the guard holds nothing between steps after a commit
        return d

    def __setstate__(self, d):
        self.__dict__.update(d)
        self._guard = self.config.new_guard()
        self._guard_step = self.step


class CompressionState(_ReducerState):
    """State of :func:`compress_hook`, one per DDP model (like PowerSGDState).

    Args:
        codec: codec spec, e.g. ``"int8"``, ``"sign:block=1024"``, ``"topk:0.01"``, ``"bf16"``,
            ``"lowrank:4"`` (PowerSGD's rank-4 approximation of each matrix, warm-started; its Q
            factors are kept with the residuals).
        process_group: the group to reduce over (None: the default group).
        error_feedback: keep residuals (``c = g + e; e = c - decode(encode(c))``).
        warmup_steps: the first steps run uncompressed (plain all-reduce average, or
            ``warmup_codec``'s).
        warmup_codec: a codec spec (e.g. ``"bf16"``) that carries the warm-up steps' buckets,
            without error feedback and with the optimizer's uncompressed direction (for
            FrozenVarianceAdamW: the averaged gradient), summed as that codec sums (bf16: one
            all-reduce in bf16); half the warm-up's bytes for a 16-bit rounding of the average.
            None (default): the fp32 all-reduce.
        min_compress_numel: buckets with fewer elements run uncompressed (DDP's first bucket after
            the rebuild is small; headers and latency dominate there).
        guard_nonfinite: when any reduced bucket of a step holds Inf/NaN (an AMP overflow step,
            which GradScaler skips), every residual keeps its value of before the step. Costs a
            copy of the residuals per step (held until the step ends). The restore is applied at
            the next step's first hook call or by ``state_dict()``, on the device, without a host
            synchronisation.
        optimizer: a gradzip.optim optimizer (FrozenVarianceAdamW, which needs
            ``warmup_steps >= 1``; CompressedSGD): the hook then computes what
            that optimizer sends around the collective (its moments kept here, with the residuals)
            and leaves in the bucket what ``optimizer.step()`` applies. None: the gradient itself
            is compressed (for torch's optimizers).
        cast_sum: where fp16/bf16 buckets are summed. ``"wire"``: each rank encodes its whole
            bucket (error feedback into its residual) and one all-reduce (SUM) of the 16-bit
            payloads runs in the backend, in the wire dtype; one collective, but the sum is rounded
            in the backend's order (replicas stay identical: every rank gets the backend's
            result), and no owner residual exists. ``"fp32"``: the two-phase exchange (all-to-all,
            fp32 sum by each shard's owner in rank order, all-gather): fp32 accumulation in a fixed
            order, bitwise identical on every backend and equal to :class:`SimulatedWorkers` bit
            for bit. None (default): ``"wire"``, or ``"fp32"`` with ``optimizer`` and error
            feedback, whose owner residual needs the fp32 sum (``"wire"`` there is a ValueError).
            Other codecs are not affected.
        uncompressed_numel: inside compressed int8/sign buckets, the 1-D tensors (biases, norms)
            and those of fewer elements travel uncompressed, in fp32, in the same exchange: their
            average is the exact fp32 sum (in rank order) and they keep no residual. 0 (default):
            every tensor is compressed. Other codecs are not affected.

    The first hook call checks, with one small all-gather, that every rank uses the same
    configuration, and raises ``ValueError`` on all ranks naming the difference (instead of hanging
    in mismatched collectives). ``stats`` holds the last step's traffic; ``state_dict()`` /
    ``load_state_dict()`` carry the residuals, moments and the step count. The state pickles without
    its process group (restored as the default group), as PowerSGDState does.

    State is kept per bucket and described per parameter: parameters are numbered in the order the
    hook first sees them (the same in every process that builds the same model and DDP
    configuration). When DDP rebuilds its buckets after the first iteration, or a checkpoint of
    another bucket layout is loaded, each parameter's residuals and moments move with it. A resumed
    run whose first iteration puts in one bucket the parameters that the checkpoint holds in several
    reduces them as the saved buckets, as the uninterrupted run did, so resume is exact.

    Collectives run in C++: on CUDA tensors on the state's process group, enqueued on the current
    stream at the hook call, without
    host synchronisation (a corrupt message makes the bucket NaN on the device and raises at the
    next step's first hook call or ``state_dict()``); on CPU tensors on one thread of the state's
    own, bucket after bucket, overlapping the backward pass, on a process group of its own (same
    ranks and backend, created at the first hook call), since DDP issues collectives of its own
    meanwhile. Residuals are in the units of the gradient the hook sees: with AMP they include
    GradScaler's scale.
    """

    def __init__(self, codec: str, process_group=None, error_feedback: bool = True,
                 warmup_steps: int = 0, min_compress_numel: int = MIN_COMPRESS_NUMEL,
                 guard_nonfinite: bool = True, optimizer=None, cast_sum: Optional[str] = None,
                 warmup_codec: Optional[str] = None, uncompressed_numel: int = 0):
        super().__init__(_Config(codec, error_feedback, warmup_steps, min_compress_numel,
                                 guard_nonfinite, optimizer, cast_sum, warmup_codec,
                                 uncompressed_numel))
        self.process_group = process_group
        self._ef = StateStore()
        self._keys = _ParameterKeys()
        self._resumed_step = None  # the step a checkpoint was loaded at (see _reduce_as_saved)
        self._world = self._rank = None  # known at the first hook call
        self._warmup_runtime = None  # the warm-up codec's CompressedAllreduce, if any
        self._saved_world = None  # the world size a loaded checkpoint was saved at, if known
        if optimizer is not None:
            optimizer.attached = True

    # -- public ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        self._commit()
        return {"version": _STATE_VERSION, "codec": self.config.codec, "step": self.step,
                "error_feedback": self.config.error_feedback, "world_size": self._world,
                "residuals": self._ef.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"gradzip: unsupported CompressionState version {state.get('version')}"
                             f" (this gradzip reads version {_STATE_VERSION})")
        if state["codec"] != self.config.codec:
            raise ValueError(f"gradzip: checkpoint was saved with codec {state['codec']!r}, "
                             f"this state uses {self.config.codec!r}")
        self._commit()
        self.step = int(state["step"])
        self._ef.load_state_dict(state["residuals"])
        self._resumed_step = self.step
        self._saved_world = state.get("world_size")

    # -- pickling without the process group (as PowerSGDState) ----------------------------------
    def __getstate__(self):
        d = super().__getstate__()
        d["process_group"] = None
        d["_warmup_runtime"] = None
        return d

    def __setstate__(self, d):
        super().__setstate__(d)
        # An unpickled state is a checkpoint: resumed as load_state_dict resumes one, on a model
        # whose parameters it numbers afresh from the first iteration it sees.
        self._keys = _ParameterKeys()
        self._resumed_step = self.step
        self._saved_world = d.get("_world")
        logger.info("gradzip: CompressionState unpickled; process_group set to the default group")

    # -- internals --------------------------------------------------------------------------------
    def _group(self):
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def _setup(self, device):
        if self._runtime is None:
            group = self._group()
            require_same_config(self.config.describe(group.size()), group, device, "gradzip.ddp")
            name = reducing_group(group, device).group_name
            plan, warm = self.config.plan, self.config.warmup_plan
            self._runtime = torch.classes.gradzip.CompressedAllreduce(
                name, self.config.codec, self._guard, plan.cast_sum,
                gather_group_name(group, device, plan))
            if warm is not None and self.step < self.config.warmup_steps:
                self._warmup_runtime = torch.classes.gradzip.CompressedAllreduce(
                    name, warm.spec, self._guard, warm.cast_sum,
                    gather_group_name(group, device, warm))
            self._world, self._rank = group.size(), group.rank()
            self._drop_state_of_another_world()
        return self._runtime

    def _drop_state_of_another_world(self) -> None:
        """A checkpoint saved at another world size (an elastic restart with fewer or more ranks)
        continues from zero residuals: they are per rank (this rank's share of the average, its
        shard of a bucket), and with another number of ranks they have no counterpart. Optimizer
        moments computed from the average (FrozenVarianceAdamW's) are the same on every rank and
        are kept (a frozen variance dropped past the warm-up would stay zero), as are lowrank's Q
        factors (the warm start, identical on every rank); per-rank moments (CompressedSGD's
        velocity) go with the residuals. The step count is kept."""
        saved, self._saved_world = self._saved_world, None
        if saved is None or saved == self._world:
            return
        direction = self.config.direction
        shared = direction is not None and direction.moments_shared
        if self._ef.buckets:
            kept = [name for name, keeps in (("the optimizer moments", shared),
                                             ("the Q factors", self.config.plan.lowrank_rank))
                    if keeps]
            what = ("its residuals are dropped (they are per rank; "
                    f"{' and '.join(kept)}, the same on every rank, are kept)" if kept else
                    "its residuals and optimizer moments are dropped (they are per rank)")
            warnings.warn(f"gradzip: the CompressionState checkpoint was saved with world size "
                          f"{saved}, this process group has {self._world} ranks: {what}; "
                          f"training continues from zero residuals at step {self.step}",
                          stacklevel=3)
        self._ef.drop_rank_state(keep_moments=shared)
        self._resumed_step = None

    def _reduce(self, index, bucket_view, x, layout, st):
        """Enqueues one reduction of ``x`` (the bucket's float32 values) in C++; returns its Future."""
        cfg, numels, n = self.config, layout_numels(layout), layout[0]
        rows, exact = layout_rows(layout), cfg.exact(layout)
        compressed = cfg.compresses(self.step, n, self._world)
        plan = cfg.transport(self.step, n, self._world)
        self._stats.add(plan, numels, self._world, self._rank, rows, exact)
        if self._guard is not None and st is not None:
            # Before any update (an overflow step undoes all): the moments the direction updates
            # here; the C++ reduction saves the residuals and Q factors it updates itself.
            self._guard.save(st.moments)
        cfg.apply_direction(x, st, compressed)
        if cfg.plan.lowrank_rank and compressed:
            fut = self._runtime_of_step().reduce_lowrank(index, bucket_view, x, numels, rows,
                                                         st.residual, st.q)
        else:
            # Residuals belong to the codec's steps only: a warm-up codec sends without feedback.
            residuals = ((st.residual, st.owner_residual) if st is not None and compressed
                         else (None,) * 2)
            fut = self._runtime_of_step().reduce(index, bucket_view, x, numels, *residuals,
                                                 plan is not None, exact)
        if cfg.direction is None:
            return fut

        def finish(f):
            out = f.value()[0]
            avg = out if out.dtype == torch.float32 else out.float()
            cfg.finish_direction(avg, st, compressed)
            if avg is not out:
                out.copy_(avg)
            return [out]

        return fut.then(finish)

    def _runtime_of_step(self):
        """The warm-up codec's reduction for every bucket of a warm-up step (those it does not
        compress too: one object's thread issues a step's collectives, in order), else the codec's.
        Steps never overlap (DDP waits for a step's Futures before the next backward pass)."""
        if self._warmup_runtime is not None and self.step < self.config.warmup_steps:
            return self._warmup_runtime
        self._warmup_runtime = None  # the warm-up is over: its buffers go
        return self._runtime


class _ParameterKeys:
    """Numbers parameters in the order the hook first sees them. The numbering is rebuilt in each
    new process (an unpickled state sees the model again from DDP's first iteration)."""

    def __init__(self):
        self._pid, self._keys = os.getpid(), {}

    def layout(self, bucket, n: int):
        if self._pid != os.getpid():
            self._pid, self._keys = os.getpid(), {}
        params = bucket.parameters() if hasattr(bucket, "parameters") else []
        keys = [self._keys.setdefault(id(p), len(self._keys)) for p in params]
        return (n, tuple((k, tuple(p.shape)) for k, p in zip(keys, params)))


def compress_hook(state: "CompressionState",
                  bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: averages ``bucket`` across ``state``'s process group with the
    state's codec and error feedback. Register with
    ``ddp_model.register_comm_hook(state, compress_hook)``. Returns a Future of the bucket buffer,
    reduced in place (DDP does not divide by the world size once a hook is registered: this does)."""
    buf = bucket.buffer()
    state._setup(buf.device)
    if state._guard_step != state.step:
        state._commit()  # first bucket of a new step: the previous step is complete
    # DDP gives a sparse gradient (nn.Embedding(sparse=True)) a bucket of its own
    dense = buf.layout == torch.strided
    fut = _reduce_dense(state, bucket, buf) if dense else _reduce_sparse(state, buf)
    if bucket.is_last():
        state._stats.end_step(state.step)
        state.step += 1
    # DDP reads a Python value from the hook's Future (as allreduce_hook's `then`).
    return fut.then(lambda f: f.value()[0])


def _reduce_dense(state, bucket, buf):
    cfg, world, rank = state.config, state._world, state._rank
    layout = state._keys.layout(bucket, buf.numel())
    resuming = cfg.keeps_state and state._resumed_step == state.step
    cover = state._ef.covering(layout) if resuming else None
    if cover is not None:
        return _reduce_as_saved(state, buf, layout, cover)
    encoded = cfg.transport(state.step, buf.numel(), world) is not None
    st = cfg.bucket_state(state._ef, bucket.index(), layout, world, rank, buf.device)
    # bf16/fp16 buckets are upcast for the codecs and the direction (the state is fp32)
    keep = buf.dtype == torch.float32 or (not encoded and cfg.direction is None)
    x = buf if keep else buf.float()
    return state._reduce(bucket.index(), buf, x, layout, st)


def _reduce_sparse(state, buf):
    """A sparse gradient is averaged as DDP averages it without a hook (divided by the world size,
    then the backend's sparse all-reduce on the state's group): uncompressed, no residual, the same
    bits as plain DDP. The codecs and an optimizer direction need dense tensors."""
    if state.config.direction is not None:
        raise ValueError("gradzip: CompressionState(optimizer=...) computes the optimizer direction "
                         "of dense gradients; this model has sparse gradients (an nn.Embedding or "
                         "EmbeddingBag with sparse=True): use sparse=False, or torch's optimizer "
                         "without optimizer=")
    group = state._group()
    return dist.all_reduce(buf / group.size(), group=group, async_op=True).get_future()


def _reduce_as_saved(state, buf, layout, cover):
    """Reduces ``buf`` as the stored buckets ``cover`` that hold its parameters (a resumed run's
    first iteration), each on a gathered copy, and scatters the averages back."""
    cfg, world, rank = state.config, state._world, state._rank
    x = buf.float() if buf.dtype != torch.float32 else buf
    where = param_offsets(layout)
    parts, futs = [], []
    for i in cover:
        saved = state._ef.buckets[i].layout
        index = torch.cat([torch.arange(where[k][0], where[k][0] + where[k][1]) for k, _ in saved[1]])
        index = index.to(buf.device)
        part = x.index_select(0, index)
        st = cfg.bucket_state(state._ef, i, saved, world, rank, buf.device)
        futs.append(state._reduce(i, part, part, saved, st))
        parts.append((index, part))

    def scatter(_):
        for index, part in parts:
            x.index_copy_(0, index, part)
        if x is not buf:
            buf.copy_(x)
        return [buf]

    return torch.futures.collect_all(futs).then(scatter)


class SimulatedWorkers:
    """W workers in one process, each with its own error-feedback state, reduced with exactly the
    arithmetic of :func:`compress_hook` (the same C++ phases; the collectives done in memory).

        sim = SimulatedWorkers("int8", world_size=4)
        avg = sim.reduce([g0, g1, g2, g3])   # what every rank's bucket holds after the hook

    Each call reduces one bucket (``bucket_index``, default 0); ``is_last=True`` (the default) ends
    the step, as DDP's last bucket does: the step count advances, ``stats`` is updated and, with
    ``guard_nonfinite``, the residual updates of the step are kept or (if any bucket of the step was
    not finite) undone. Compressed buckets equal the multi-rank hook bit for bit where gradzip sums
    (every codec, and fp16/bf16 with ``cast_sum="fp32"``). fp16/bf16 with ``cast_sum="wire"`` (the
    default) are summed by the backend in the wire dtype, in its own order: simulated here as the
    fp32 sum in rank order rounded once to the wire dtype, equal to the hook to the wire dtype's
    rounding of a W-term sum (the residuals equal it bit for bit). Warm-up steps and buckets below
    ``min_compress_numel`` (a plain fp32 all-reduce on real ranks, whose summation order is the
    backend's) are summed here in rank order of ``g / W``: equal to fp32 rounding. ``lowrank:R``
    (give the tensors' ``shapes=``) sums its two all-reduces in rank order: equal to the hook bit
    for bit at W = 2, to fp32 rounding above.
    """

    def __init__(self, codec: str, world_size: int, error_feedback: bool = True,
                 warmup_steps: int = 0, min_compress_numel: int = MIN_COMPRESS_NUMEL,
                 guard_nonfinite: bool = True, optimizer=None, cast_sum: Optional[str] = None,
                 warmup_codec: Optional[str] = None, uncompressed_numel: int = 0):
        if int(world_size) < 1:
            raise ValueError(f"gradzip: world_size must be >= 1, got {world_size}")
        self.config = _Config(codec, error_feedback, warmup_steps, min_compress_numel, guard_nonfinite,
                              optimizer, cast_sum, warmup_codec, uncompressed_numel)
        self.world_size = int(world_size)
        self.step = 0
        self._ef = [StateStore() for _ in range(self.world_size)]
        self._stats = TrafficStats()
        self._guards = [self.config.new_guard() for _ in range(self.world_size)]
        self._reductions = {}  # (bucket_index, numels, exact, device) -> a BucketReduction per rank
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
               numels: Optional[List[int]] = None, keys: Optional[list] = None,
               shapes: Optional[list] = None) -> torch.Tensor:
        """``numels``: the element counts of the tensors the bucket holds, in order (as DDP's
        ``bucket.parameters()``); block-scaled codecs restart their blocks at each boundary.
        ``shapes``: their shapes instead (lowrank views each as a matrix of ``shape[0]`` rows;
        ``uncompressed_numel`` needs them; tensors given by ``numels`` count as 1-D). ``keys``: one
        hashable per tensor naming its parameter, for buckets whose parameters move (the state
        follows the parameter, as in the hook); default ``(bucket_index, i)``."""
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
        if shapes is None:
            shapes = [(n,)] if numels is None else [(int(m),) for m in numels]
        elif numels is None:
            shapes = [tuple(int(d) for d in s) for s in shapes]
        else:
            raise ValueError("gradzip: give numels or shapes, not both")
        if sum(math.prod(s) for s in shapes) != n or any(d < 0 for s in shapes for d in s):
            raise ValueError(f"gradzip: tensors of shapes {shapes} do not partition the {n} "
                             "elements")
        keys = [(bucket_index, i) for i in range(len(shapes))] if keys is None else list(keys)
        if len(keys) != len(shapes) or len(set(keys)) != len(keys):
            raise ValueError(f"gradzip: keys must name each of the {len(shapes)} tensors once")
        layout = (n, tuple(zip(keys, shapes)))
        numels, exact = layout_numels(layout), cfg.exact(layout)  # as the hook
        rows = layout_rows(layout)
        compressed = cfg.compresses(self.step, n, world)
        plan = cfg.transport(self.step, n, world)
        self._stats.add(plan, numels, world, 0, rows, exact)
        states = [cfg.bucket_state(self._ef[r], bucket_index, layout, world, r, flats[r].device)
                  for r in range(world)]
        for r in range(world):
            if self._guards[r] is not None:
                self._guards[r].save(_saved(states[r]))
            cfg.apply_direction(flats[r], states[r], compressed)
        if plan is None:
            out = torch.zeros_like(flats[0])
            for f in flats:
                out += f / world
            # each rank's own copy where the optimizer finishes it in place
            outs = [out] * world if cfg.direction is None else [out] + [
                out.clone() for _ in range(world - 1)]
        elif compressed and cfg.plan.lowrank_rank:
            outs = [f.clone() for f in flats]  # reduced in place; flats may be the caller's grads
            run_simulated_lowrank(self._lowrank_reductions(bucket_index, numels, rows, flats[0]),
                                  outs, states)
        else:
            outs = [torch.empty_like(f) for f in flats]
            run_simulated(self._bucket_reductions(plan, bucket_index, numels, exact, flats[0]),
                          flats, states if compressed else [None] * world, outs)
        for o, st in zip(outs, states):
            cfg.finish_direction(o, st, compressed)
        for g, o in zip(self._guards, outs):
            if g is not None:
                g.flag(o)
        if is_last:
            for g in self._guards:
                if g is not None:
                    g.commit()
            self._stats.end_step(self.step)
            self.step += 1
        return outs[0]

    def _bucket_reductions(self, plan, index, numels, exact, like):
        key = (plan, index, tuple(numels), tuple(exact), like.device)
        if key not in self._reductions:
            self._reductions[key] = [
                torch.classes.gradzip.BucketReduction(plan.spec, self.world_size, r, list(numels),
                                                      like, plan.cast_sum, list(exact))
                for r in range(self.world_size)]
        return self._reductions[key]

    def _lowrank_reductions(self, index, numels, rows, like):
        key = (index, tuple(numels), tuple(rows), like.device)
        if key not in self._reductions:
            self._reductions[key] = [
                torch.classes.gradzip.LowRankReduction(self.config.plan.lowrank_rank,
                                                       self.world_size, list(numels), list(rows),
                                                       like)
                for _ in range(self.world_size)]
        return self._reductions[key]

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
