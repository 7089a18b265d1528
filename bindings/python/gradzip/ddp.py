"""A DDP communication hook that compresses gradients with error feedback.

    from gradzip.ddp import CompressionState, compress_hook
    ddp_model.register_comm_hook(CompressionState("topk:0.01"), compress_hook)

A drop-in for PyTorch's hooks (``default_hooks.allreduce_hook``, ``powerSGD_hook``): the hook
returns a Future holding the bucket's averaged gradient (written in place into ``bucket.buffer()``).
The reduction is C++ (``torch.classes.gradzip.CompressedAllreduce`` over the state's
``c10d::ProcessGroup``, see bindings/torch/bucket_reduction.hpp): one all-reduce (SUM) in the wire
dtype for fp32/fp16/bf16 (``cast_sum="wire"``, the default), two-phase all-to-all / all-gather
with an fp32 sum for int8/sign and for the casts with ``cast_sum="fp32"``, all-gather of
fixed-size payloads for top-k, two fp32 all-reduces of low-rank factors for ``lowrank:R``
(bindings/torch/lowrank_reduction.hpp). This module keeps the hook, its state object and its
resume; the policy is :mod:`gradzip.reducer`'s, the per-bucket state :mod:`gradzip.bucket_state`'s,
and :class:`gradzip.simulation.SimulatedWorkers` runs the same C++ phases for W workers in one
process.
"""

import logging
import os
import warnings
from typing import Optional

import torch
import torch.distributed as dist

from . import _ops  # noqa: F401  (loads the extension that defines torch.classes.gradzip)
from ._groups import gather_group_name, reducing_group, require_same_config
from .bucket_state import StateStore, param_offsets
from .reducer import STATE_VERSION, ReducerConfig, ReducerState
from .wire import MIN_COMPRESS_NUMEL

__all__ = ["CompressionState", "compress_hook"]

logger = logging.getLogger(__name__)



class CompressionState(ReducerState):
    """State of :func:`compress_hook`, one per DDP model (like PowerSGDState).

    Args:
        codec: codec spec, e.g. ``"int8"``, ``"sign:block=1024"``, ``"topk:0.01"``, ``"bf16"``,
            ``"lowrank:4"`` (PowerSGD's rank-4 approximation of each matrix, warm-started; its Q
            factors are kept with the residuals).
        process_group: the group to reduce over (None: the default group).
        error_feedback: keep residuals (``c = g + e; e = c - decode(encode(c))``); fp32 keeps
            none, being lossless (its residual would stay zero).
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
        cast_sum: where fp16/bf16 (and top-k) buckets are summed. ``"wire"``: each rank encodes its whole
            bucket (error feedback into its residual) and one all-reduce (SUM) of the 16-bit
            payloads runs in the backend, in the wire dtype; one collective, but the sum is rounded
            in the backend's order (replicas stay identical: every rank gets the backend's
            result), and no owner residual exists. ``"fp32"``: the two-phase exchange (all-to-all,
            fp32 sum by each shard's owner in rank order, all-gather): fp32 accumulation in a fixed
            order, bitwise identical on every backend and equal to :class:`gradzip.simulation.SimulatedWorkers` bit
            for bit. None (default): ``"wire"``, or ``"fp32"`` with ``optimizer`` and error
            feedback, whose owner residual needs the fp32 sum (``"wire"`` there is a ValueError).
            Top-k: ``"wire"`` (the default) all-gathers every rank's k pairs, so a rank receives
            (W - 1) k of them (more than fp32's ring all-reduce past W ~ 130 at 1 %) and the
            average holds up to W k nonzeros; ``"fp32"`` takes the two-phase exchange, whose shard
            owners keep the top-k of the summed shard (and an owner residual of the rest): about
            2 k pairs per rank whatever W, and k nonzeros, the same on every rank. int8 and sign
            are not affected.
        max_grad_norm: with ``optimizer``, clips each rank's gradient to this norm before it
            enters the optimizer's momentum and the compressor, bucket by bucket (each bucket its
            share of the norm, from the previous step: see :mod:`gradzip.local_clip`); the
            average's norm stays within it too. The replacement for
            ``torch.nn.utils.clip_grad_norm_``, which cannot act on ``p.grad`` here (it holds the
            optimizer's update after the hook; ``optimizer.step()`` raises if it was changed).
            ``grad_norm`` is this rank's gradient norm of the last step, before clipping.
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
                 warmup_codec: Optional[str] = None, uncompressed_numel: int = 0,
                 max_grad_norm: Optional[float] = None):
        super().__init__(ReducerConfig(codec, error_feedback, warmup_steps, min_compress_numel,
                                       guard_nonfinite, optimizer, cast_sum, warmup_codec,
                                       uncompressed_numel, max_grad_norm))
        self._clip = self.config.new_clip()
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
    @property
    def grad_norm(self) -> Optional[torch.Tensor]:
        """With ``optimizer``: this rank's gradient norm at the last complete step, before
        ``max_grad_norm`` clipped it (a 0-dim tensor on the gradients' device, what
        ``clip_grad_norm_`` returns); None before the first step or without ``optimizer``."""
        return None if self._clip is None else self._clip.grad_norm

    def attach(self, optimizer) -> None:
        """Binds ``optimizer`` to a state that was pickled with another one (``torch.save(state)``
        and loaded in a new process): the state then computes its direction, and its ``step()``
        checks what the hook wrote. It must be of the same kind and settings as the saved one's."""
        saved = self.config.direction
        direction = getattr(optimizer, "direction", None)
        if saved is None or direction is None or direction.describe() != saved.describe():
            raise ValueError("gradzip: attach() takes an optimizer of the kind and settings the "
                             f"state was made with ({'none' if saved is None else saved.describe()})"
                             f", got {type(optimizer).__name__}")
        self.config.direction = direction
        optimizer.attached = True

    def state_dict(self) -> dict:
        self._commit()
        return {"version": STATE_VERSION, "codec": self.config.codec, "step": self.step,
                "error_feedback": self.config.error_feedback, "world_size": self._world,
                "residuals": self._ef.state_dict(),
                "clip": None if self._clip is None else self._clip.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"gradzip: unsupported CompressionState version {state.get('version')}"
                             f" (this gradzip reads version {STATE_VERSION})")
        if state["codec"] != self.config.codec:
            raise ValueError(f"gradzip: checkpoint was saved with codec {state['codec']!r}, "
                             f"this state uses {self.config.codec!r}")
        self._commit()
        self.step = int(state["step"])
        self._ef.load_state_dict(state["residuals"])
        if self._clip is not None and state.get("clip") is not None:
            self._clip.load_state_dict(state["clip"])
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
            if warm is not None and self.step <= self.config.last_exact_step:
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
        bucket = self.config.begin_bucket(self.step, layout, self._world, reduction_guards=True)
        selected = bucket.send(x, st, self._guard, self._clip)
        runtime = self._runtime_of_step()
        fut = bucket.reduce(runtime, index, bucket_view, x, st)
        bucket.count(self._stats, runtime.traffic(index))
        if self.config.direction is None:
            return fut

        def finish(f):
            out = f.value()[0]
            avg = out if out.dtype == torch.float32 else out.float()
            bucket.receive(avg, st, selected)
            if avg is not out:
                out.copy_(avg)
            self.config.direction.wrote_(out)
            return [out]

        return fut.then(finish)

    def _runtime_of_step(self):
        """The warm-up codec's reduction for every bucket of a warm-up step (those it does not
        compress too: one object's thread issues a step's collectives, in order), else the codec's.
        Steps never overlap (DDP waits for a step's Futures before the next backward pass)."""
        if self._warmup_runtime is not None and self.config.exact_step(self.step):
            return self._warmup_runtime
        if self.step > self.config.last_exact_step:
            self._warmup_runtime = None  # no exact step is left: its buffers go
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
        if state.config.direction is not None:
            state.config.direction.begin_step_()
    # DDP gives a sparse gradient (nn.Embedding(sparse=True)) a bucket of its own
    dense = buf.layout == torch.strided
    fut = _reduce_dense(state, bucket, buf) if dense else _reduce_sparse(state, buf)
    if bucket.is_last():
        if state._clip is not None:
            state._clip.end_step()
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
