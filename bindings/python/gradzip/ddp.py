"""A DDP communication hook that compresses gradients with error feedback.

    from gradzip.ddp import CompressionState, compress_hook
    ddp_model.register_comm_hook(CompressionState("topk:0.01"), compress_hook)

A drop-in for PyTorch's hooks (``default_hooks.allreduce_hook``, ``powerSGD_hook``): the hook
returns a Future holding the bucket's averaged gradient (written in place into ``bucket.buffer()``),
reduced in C++ (``torch.classes.gradzip.CompressedAllreduce`` over the state's
``c10d::ProcessGroup``: the codec's collectives, or lowrank's two all-reduces of factors; see
docs/guide.md). The policy is :mod:`gradzip.reducer`'s, the per-bucket state
:mod:`gradzip.bucket_state`'s, resuming :mod:`gradzip.resume`'s;
:class:`gradzip.simulation.SimulatedWorkers` runs the same C++ steps for W workers in one process.
"""

import logging
from typing import Optional

import torch
import torch.distributed as dist

from . import _ops  # noqa: F401  (loads the extension that defines torch.classes.gradzip)
from ._groups import gather_group_name, reducing_group, require_same_config
from .bucket_state import StateStore
from .reducer import STATE_VERSION, ReducerConfig, ReducerState
from .resume import ParameterKeys, drop_state_of_another_world, reduce_as_saved
from .wire import MIN_COMPRESS_NUMEL

__all__ = ["CompressionState", "compress_hook"]

logger = logging.getLogger(__name__)


class CompressionState(ReducerState):
    """State of :func:`compress_hook`, one per DDP model (like PowerSGDState).

    ``codec``: a codec spec (``"int8"``, ``"sign:block=1024"``, ``"topk:0.01"``, ``"bf16"``,
    ``"lowrank:4"``); the other arguments (error feedback, warm-up, small buckets, the non-finite
    guard, a ``gradzip.optim`` optimizer, where casts are summed, exact tensors, clipping, the
    residuals' dtype: ``torch.bfloat16`` halves their memory) are
    described in docs/guide.md, "CompressionState arguments". The first hook call checks that
    every rank uses the same configuration (a ``ValueError`` naming the difference, not a hang).
    ``stats`` holds the last step's traffic; ``state_dict()`` / ``load_state_dict()`` carry the
    residuals, moments and the step count, described per parameter so that they follow each
    parameter across DDP's bucket rebuild (:mod:`gradzip.resume`). The state pickles without its
    process group (restored as the default group), as PowerSGDState does.
    """

    def __init__(self, codec: str, process_group=None, error_feedback: bool = True,
                 warmup_steps: int = 0, min_compress_numel: int = MIN_COMPRESS_NUMEL,
                 guard_nonfinite: bool = True, optimizer=None, cast_sum: Optional[str] = None,
                 warmup_codec: Optional[str] = None, uncompressed_numel: int = 0,
                 max_grad_norm: Optional[float] = None,
                 residual_dtype: torch.dtype = torch.float32):
        super().__init__(ReducerConfig(codec, error_feedback, warmup_steps, min_compress_numel,
                                       guard_nonfinite, optimizer, cast_sum, warmup_codec,
                                       uncompressed_numel, max_grad_norm,
                                       residual_dtype=residual_dtype))
        self.process_group = process_group
        self._ef = StateStore()
        self._keys = ParameterKeys()
        self._resumed_step = None  # the step a checkpoint was loaded at (see reduce_as_saved)
        self._world = self._rank = None  # known at the first hook call
        self._warmup_runtime = None  # the warm-up codec's CompressedAllreduce, if any
        self._saved_world = None  # the world size a loaded checkpoint was saved at, if known

    @property
    def grad_norm(self) -> Optional[torch.Tensor]:
        """With ``optimizer``: this rank's gradient norm at the last complete step, before
        ``max_grad_norm`` clipped it (a 0-dim tensor on the gradients' device, what
        ``clip_grad_norm_`` returns); None before the first step or without ``optimizer``."""
        return None if self._clip is None else self._clip.grad_norm

    def residuals(self) -> list:  # this rank's error-feedback residuals, every bucket's
        return self._ef.residuals()

    def attach(self, optimizer) -> None:
        """Binds ``optimizer`` to a state that was pickled with another one (``torch.save(state)``
        and loaded in a new process): the state then computes its direction, and its ``step()``
        checks what the hook wrote. It must be of the same kind and settings as the saved one's."""
        self.config.attach(optimizer)

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

    def __getstate__(self):  # without the process group, as PowerSGDState
        d = super().__getstate__()
        d["process_group"] = d["_warmup_runtime"] = None
        return d

    def __setstate__(self, d):
        super().__setstate__(d)
        # an unpickled state is a checkpoint: resumed as load_state_dict resumes one
        self._keys = ParameterKeys()
        self._resumed_step = self.step
        self._saved_world = d.get("_world")
        logger.info("gradzip: CompressionState unpickled; process_group set to the default group")

    def _group(self):
        """The group the codec reduces over."""
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def _covering(self, layout):
        """The saved buckets a resumed run's first bucket is reduced as (StateStore.covering)."""
        return self._ef.covering(layout)

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
            if drop_state_of_another_world(self._ef, self.config, self._saved_world, self._world,
                                           self.step):
                self._resumed_step = None
            self._saved_world = None
        return self._runtime

    def _reduce(self, index, bucket_view, x, layout):
        """Enqueues one reduction of ``x`` (the bucket's values) in C++; returns its Future."""
        st = self.config.bucket_state(self._ef, index, layout, self._world, self._rank, x.device)
        bucket = self.config.begin_bucket(self.step, layout, self._world, reduction_guards=True)
        selected = bucket.send(x, st, self._guard, self._clip)
        runtime = self._runtime_of_step()
        fut = bucket.reduce(runtime, index, bucket_view, x, st, selected)
        bucket.count(self._stats, runtime.traffic(index))
        return fut

    def _runtime_of_step(self):
        """The warm-up codec's reduction on a warm-up step, else the codec's (one object's thread
        issues all of a step's collectives, in order; DDP waits for a step before the next)."""
        if self._warmup_runtime is not None and self.config.exact_step(self.step):
            return self._warmup_runtime
        if self.step > self.config.last_exact_step:
            self._warmup_runtime = None  # no exact step is left: its buffers go
        return self._runtime


def compress_hook(state: "CompressionState",
                  bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: averages ``bucket`` across ``state``'s process group with the
    state's codec and error feedback. Register with
    ``ddp_model.register_comm_hook(state, compress_hook)``. Returns a Future of the bucket buffer,
    reduced in place (DDP does not divide by the world size once a hook is registered: this does)."""
    buf = bucket.buffer()
    state._setup(buf.device)
    state._begin_step()
    # DDP gives a sparse gradient (nn.Embedding(sparse=True)) a bucket of its own
    dense = buf.layout == torch.strided
    fut = _reduce_dense(state, bucket, buf) if dense else _reduce_sparse(state, buf)
    if bucket.is_last():
        state._end_step()
    # DDP reads a Python value from the hook's Future (as allreduce_hook's `then`).
    return fut.then(lambda f: f.value()[0])


def _reduce_dense(state, bucket, buf):
    cfg = state.config
    layout = state._keys.layout(bucket, buf.numel())
    resuming = cfg.keeps_state and state._resumed_step == state.step
    cover = state._covering(layout) if resuming else None
    if cover is not None:
        return reduce_as_saved(buf, layout, cover,
                               lambda i, part, saved: state._reduce(i, part, part, saved))
    encoded = cfg.transport(state.step, buf.numel(), state._world) is not None
    # bf16/fp16 buckets are upcast for the codecs and the direction (the state is fp32)
    keep = buf.dtype == torch.float32 or (not encoded and cfg.direction is None)
    x = buf if keep else buf.float()
    return state._reduce(bucket.index(), buf, x, layout)


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
