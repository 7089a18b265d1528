"""What the DDP hook (:mod:`gradzip.ddp`), its simulation (:mod:`gradzip.simulation`) and FSDP's
reduce-scatter (:mod:`gradzip.fsdp`) share: the settings every rank must agree on and the per-step
policy (:class:`ReducerConfig`: warm-up steps and small buckets go uncompressed, which tensors travel
exact, the optimizer direction), the sequence one bucket goes through at one step around the
caller's collective (:class:`BucketStep`), and the state object's common part
(:class:`ReducerState`: the step count, the traffic counters, the C++ reduction, the non-finite
guard, settling a step).
"""

import logging
from typing import List, Optional

import torch

from . import _ops, wire  # _ops also loads the extension that defines torch.classes.gradzip
from .bucket_state import StateStore, layout_exact, layout_numels, layout_rows
from .local_clip import LocalGradClip, checked_max_norm
from .plan import CodecPlan, TrafficStats, shard_bounds

logger = logging.getLogger(__name__)

# The format of CompressionState.state_dict() and SimulatedWorkers.state_dict().
# 3: state kept per bucket but described per parameter (key and shape), so that it survives a
#    re-bucketing; owner residuals carry their shard offset.
STATE_VERSION = 3


def checked_residual_dtype(dtype) -> torch.dtype:
    """float32, or bfloat16: the compact residual (half the bytes; each update rounded to it)."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError("gradzip: residual_dtype must be torch.float32 or torch.bfloat16 (the "
                         f"compact residual), got {dtype!r}")
    return dtype


class ReducerConfig:
    """What every rank must agree on, and the per-step policy shared by the hook, the
    simulation and gradzip.fsdp: warm-up steps and small buckets go uncompressed."""

    residual_dtype = torch.float32  # what a configuration pickled before the option had

    def __init__(self, codec: str, error_feedback: bool, warmup_steps: int, min_compress_numel: int,
                 guard_nonfinite: bool, optimizer=None, cast_sum: Optional[str] = None,
                 warmup_codec: Optional[str] = None, uncompressed_numel: int = 0,
                 max_grad_norm: Optional[float] = None, reduce_scatter: bool = False,
                 residual_dtype: torch.dtype = torch.float32):
        # FSDP's reduce-scatter: each rank keeps its shard of the sum, no owner re-encodes it
        self.reduce_scatter = bool(reduce_scatter)
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
        # What error feedback keeps: nothing for a lossless codec (fp32), whose residual would stay
        # zero; so fp32 costs neither a residual's memory nor its passes.
        parsed = CodecPlan.parse(codec)  # the summing rule (cast_sum) is decided below
        kind = parsed.kind
        self.keeps_residual = self.error_feedback and kind not in wire.LOSSLESS_KINDS
        self.residual_dtype = checked_residual_dtype(residual_dtype)
        if self.residual_dtype != torch.float32 and parsed.lowrank_rank:
            raise ValueError("gradzip: residual_dtype=torch.bfloat16 keeps the codecs' residuals "
                             "(fp16, bf16, int8, sign, top-k); lowrank's stays float32")
        # The owner residual exists only where one rank forms the sum in fp32 (the two-phase path):
        # by default the casts' sum under an optimizer direction, whose owner residual needs it;
        # top-k all-gathers unless asked for the two-phase exchange (cast_sum="fp32").
        if cast_sum is None:
            direction_owner = self.keeps_residual and self.direction is not None
            cast_sum = "fp32" if direction_owner and kind not in wire.ALL_GATHERED_KINDS else \
                "wire"
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
        if max_grad_norm is not None and self.direction is None:
            raise ValueError("gradzip: max_grad_norm clips each rank's gradient before a "
                             "gradzip.optim optimizer's direction is computed (optimizer=...); "
                             "without one, p.grad holds the averaged gradient after the hook and "
                             "torch.nn.utils.clip_grad_norm_ clips it as usual")
        self.max_grad_norm = checked_max_norm(max_grad_norm)
        # the elements of all buckets together: each bucket's share of max_grad_norm
        self.total_numel = 0 if optimizer is None else sum(
            p.numel() for group in optimizer.param_groups for p in group["params"])
        if optimizer is not None:
            optimizer.attached = True  # its step() now checks what the reducer wrote

    @property
    def codec(self) -> str:
        return self.plan.spec

    def attach(self, optimizer) -> None:
        """Binds ``optimizer``'s direction in place of the one this configuration was made (and
        pickled) with, of the same kind and settings."""
        saved = self.direction
        direction = getattr(optimizer, "direction", None)
        if saved is None or direction is None or direction.describe() != saved.describe():
            raise ValueError("gradzip: attach() takes an optimizer of the kind and settings the "
                             f"state was made with ({'none' if saved is None else saved.describe()})"
                             f", got {type(optimizer).__name__}")
        self.direction = direction
        optimizer.attached = True

    def describe(self, world: int) -> str:
        return (f"codec={self.plan.spec} cast_sum={self.plan.cast_sum} "
                f"error_feedback={int(self.error_feedback)} "
                f"warmup_steps={self.warmup_steps} warmup_codec="
                f"{'fp32' if self.warmup_plan is None else self.warmup_plan.spec} "
                f"min_compress_numel={self.min_compress_numel} "
                f"uncompressed_numel={self.uncompressed_numel} "
                f"guard_nonfinite={int(self.guard_nonfinite)} world={world} "
                f"residual_dtype={str(self.residual_dtype).replace('torch.', '')} "
                f"max_grad_norm={self.max_grad_norm!r} direction="
                f"{'none' if self.direction is None else self.direction.describe()}")

    @property
    def _refresh_steps(self) -> frozenset:
        """The optimizer direction's exact steps after the warm-up (a FrozenVarianceAdamW's
        variance refreshes)."""
        return frozenset() if self.direction is None else \
            self.direction.refresh_steps(self.warmup_steps)

    def exact_step(self, step: int) -> bool:
        """The warm-up's steps and the direction's refreshes: the gradient is averaged exactly
        (or in the warm-up codec)."""
        return step < self.warmup_steps or step in self._refresh_steps

    @property
    def last_exact_step(self) -> int:
        """The last step exact_step names (-1: none): the warm-up codec's reduction is kept until
        then."""
        return max([self.warmup_steps - 1, *self._refresh_steps])

    def compresses(self, step: int, n: int, world: int) -> bool:
        """Not an exact step and big enough: the codec carries the bucket, with error feedback and
        the optimizer's compressed direction."""
        return world > 1 and not self.exact_step(step) and self._big_enough(n, world)

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
        """Per tensor of the bucket (bucket_state.layout_numels), whether it travels in fp32."""
        return layout_exact(layout, self.uncompressed_numel)

    @property
    def wants_owner_residual(self) -> bool:
        """The owner's second residual on the reduced shard of a two-phase bucket: measured to help
        only where an optimizer direction is compressed (on raw gradients it compounds the two
        errors); and always for top-k's two-phase exchange, whose owner keeps only the k largest of
        the sum: without it the rest would be lost, though every rank's residual counts it as
        sent."""
        return self.keeps_residual and not self.reduce_scatter and (
            self.direction is not None or (self.plan.two_phase
                                           and self.plan.kind in wire.ALL_GATHERED_KINDS))

    @property
    def keeps_state(self) -> bool:
        return self.keeps_residual or self.direction is not None or self.plan.lowrank_rank > 0

    def new_clip(self) -> Optional[LocalGradClip]:
        """One rank's LocalGradClip where an optimizer direction is computed (it measures the
        gradient's norm for logging, and clips with max_grad_norm), else None."""
        return None if self.direction is None else LocalGradClip(self.max_grad_norm,
                                                                 self.total_numel)

    def new_guard(self):
        """A C++ NonfiniteGuard where there is state to protect, else None."""
        return torch.classes.gradzip.NonfiniteGuard() if self.guard_nonfinite and self.keeps_state \
            else None

    def bucket_state(self, store: StateStore, index: int, layout, world: int, rank: int, device):
        """This rank's state of one bucket, or None when it keeps none."""
        moments = 0 if self.direction is None else self.direction.buffers
        q_rank = self.plan.lowrank_rank  # lowrank keeps its Q factors with or without feedback
        if not self.keeps_residual and not moments and not q_rank:
            return None
        owner = None
        if self.wants_owner_residual and self.plan.two_phase:
            bounds = shard_bounds(layout[0], world)
            owner = (bounds[rank], bounds[rank + 1] - bounds[rank])
        return store.get(index, layout, self.keeps_residual, owner, moments, device, q_rank,
                         self.residual_dtype)

    def apply_direction(self, x: torch.Tensor, st, compressed: bool, world: int,
                        numels: List[int], exact: List[bool]) -> Optional[torch.Tensor]:
        """Turns this rank's gradient ``x`` into what it sends for the optimizer, in place.
        Returns, where the direction masks what top-k sent, what the top-k encoder selects from
        (``x / world + residual``, zero on the tensors that travel exact), for finish_direction;
        else None."""
        if self.direction is None:
            return None
        if st.exact_updates is None:  # a checkpoint from before exact_updates was kept
            st.exact_updates = min(st.updates, self.warmup_steps)
        st.updates += 1
        st.exact_updates += 0 if compressed else 1
        self.direction.apply_(x, st.moments, st.updates, st.exact_updates, compressed, world)
        if not (compressed and self.direction.masks_sent and self.plan.kind == "topk"
                and st.residual is not None):
            return None
        selected_from = torch.add(st.residual, x, alpha=1.0 / world)
        offset = 0
        for m, is_exact in zip(numels, exact):
            if is_exact:
                selected_from[offset:offset + m] = 0.0
            offset += m
        return selected_from

    def finish_direction(self, avg: torch.Tensor, st, compressed: bool,
                         selected_from: Optional[torch.Tensor] = None) -> None:
        """Turns the average ``avg`` into what the optimizer applies, in place (after
        apply_direction of the same step, given what it returned)."""
        if self.direction is None:
            return
        # A sent coordinate keeps at most the rounding of its value as residual (fp16 values:
        # 2^-11 of it; int8 values: half its chunk's step, under half the value from 2/3 of a step
        # on: a kept value rounded to 0 counts as not sent, one just above half a step may too);
        # one not sent keeps all of it (to within an FMA's rounding).
        sent = None if selected_from is None else st.residual.abs() < 0.5 * selected_from.abs()
        self.direction.finish_(avg, st.moments, st.updates, st.exact_updates, compressed, sent)

    def begin_bucket(self, step: int, layout, world: int, reduction_guards: bool) -> "BucketStep":
        """How one bucket (of ``layout``) travels at ``step``; see :class:`BucketStep`."""
        return BucketStep(self, step, layout, world, reduction_guards)


class BucketStep:
    """The sequence one bucket goes through at one step, the same for the DDP hook (one rank) and
    the simulation (each of its W ranks): :meth:`ReducerConfig.begin_bucket` decides how the bucket
    travels; then, per rank, :meth:`send` (before the collective), the reduction (:meth:`reduce` on
    a process group, :meth:`reduce_in_memory` for the simulation's W ranks) and :meth:`receive`;
    and :meth:`count` of the bytes the reduction reports.

    ``reduction_guards``: the reduction itself saves the residuals and Q factors it updates and
    flags its result for the non-finite guard (the hook's C++ CompressedAllreduce does; the
    simulation's in-memory phases do not, and these steps do it for them)."""

    def __init__(self, config: ReducerConfig, step: int, layout, world: int,
                 reduction_guards: bool):
        n = layout[0]
        self.config, self.world, self.reduction_guards = config, world, reduction_guards
        self.layout = layout
        self.numels, self.rows, self.exact = layout_numels(layout), layout_rows(layout), \
            config.exact(layout)
        self.compressed = config.compresses(step, n, world)
        self.plan = config.transport(step, n, world)  # None: an fp32 all-reduce of the average
        # the uncompressed reference: an fp32 ring all-reduce of the bucket
        self.raw_bytes = _ops.fp32_traffic(n, world)

    def send(self, x: torch.Tensor, st, guard, clip=None) -> Optional[torch.Tensor]:
        """One rank's part before the collective: its ``guard`` saves the bucket's state ``st``
        before any update (an overflow step undoes all), its ``clip`` (ReducerConfig.new_clip)
        measures and clips the gradient, then the optimizer direction turns ``x`` into what the
        rank sends, in place. Returns what :meth:`receive` is given back."""
        if guard is not None and st is not None:
            guard.save(st.moments if self.reduction_guards else state_tensors(st))
        if clip is not None:
            clip.clip_(x, self.layout)
        return self.config.apply_direction(x, st, self.compressed, self.world, self.numels,
                                           self.exact)

    def feedback(self, st):
        """The state whose residuals the collective updates, or None: the codec's steps only (a
        warm-up codec sends without feedback)."""
        return st if self.compressed else None

    def reduce(self, runtime, index: int, bucket: torch.Tensor, x: torch.Tensor, st,
               selected: Optional[torch.Tensor] = None):
        """One rank's reduction of ``x`` (the bucket's float32 values, or ``bucket`` itself) into
        ``bucket`` on ``runtime``, the C++ CompressedAllreduce of :attr:`plan` (the codec's
        exchange or lowrank's factors: the C++ reduction is chosen by the codec), then
        :meth:`receive` (``selected``: what :meth:`send` returned) where an optimizer direction
        finishes the average. Returns the Future of ``bucket``."""
        fut = reduce_bucket(runtime, index, bucket, x, self.layout, self.feedback(st),
                            self.plan is not None, self.exact)
        direction = self.config.direction
        if direction is None:
            return fut

        def finish(f):
            out = f.value()[0]
            avg = out if out.dtype == torch.float32 else out.float()
            self.receive(avg, st, selected)
            if avg is not out:
                out.copy_(avg)
            direction.wrote_(out)
            return [out]

        return fut.then(finish)

    def reduce_in_memory(self, ranks: list, xs: list, states: list, outs: list) -> None:
        """Every rank's reduction of its ``xs[r]`` into ``outs[r]``, the collectives done in memory:
        ``ranks``, the W C++ BucketReduction of :attr:`plan` (see reduce_bucket)."""
        updated = zip(*(reduction_operands(self.feedback(st)) for st in states))
        torch.ops.gradzip.reduce_in_memory(ranks, xs, *(list(t) for t in updated), outs)

    def receive(self, avg: torch.Tensor, st, selected: Optional[torch.Tensor], guard=None) -> None:
        """One rank's part after the collective: the optimizer direction turns the average ``avg``
        into what the optimizer applies, in place (``selected``: what :meth:`send` returned), and
        ``guard`` flags the result where the reduction did not."""
        self.config.finish_direction(avg, st, self.compressed, selected)
        if guard is not None and not self.reduction_guards:
            guard.flag(avg)

    def count(self, stats: TrafficStats, traffic) -> None:
        """Adds this bucket to ``stats``: ``traffic``, the (sent, received) bytes its reduction
        reports (``traffic()`` of the C++ reduction), against :attr:`raw_bytes`."""
        sent, received = traffic
        stats.add(sent, received, self.raw_bytes, self.plan is not None)


def reduction_operands(st) -> tuple:
    """What a reduction updates besides the bucket, from the state ``st`` (None: nothing): its
    residual, owner residual and lowrank's Q factors. Each C++ reduction reads those it has."""
    return (None,) * 3 if st is None else (st.residual, st.owner_residual, st.q)


def reduce_bucket(runtime, index: int, bucket: torch.Tensor, x: torch.Tensor, layout, st,
                  compress: bool = True, exact=()):
    """Starts the reduction of ``x`` into ``bucket`` (of ``layout``, a bucket_state layout) on
    ``runtime``, a C++ CompressedAllreduce, updating ``st`` (reduction_operands); ``compress=False``:
    an fp32 all-reduce of the average. The one call of the reduction for the DDP hook and FSDP's
    all-reduced groups; returns its Future."""
    residual, owner_residual, q = reduction_operands(st)
    return runtime.reduce(index, bucket, x, layout_numels(layout), residual, owner_residual,
                          compress, list(exact), layout_rows(layout), q)


def state_tensors(st) -> list:
    return [] if st is None else [t for t in st.tensors() if t is not None]


class Reporting:
    """The codec and the last step's traffic of a reducer (``config`` and ``_stats`` set by it): the
    hook's and FSDP's state objects, and the simulation, report alike."""

    @property
    def codec(self) -> str:
        return self.config.codec

    @property
    def stats(self) -> dict:
        """This rank's traffic in the last completed step (the simulation's: rank 0's)."""
        return dict(self._stats.last)


class ReducerState(Reporting):
    """What the DDP hook's and FSDP's states share: the settings, the step count, the traffic
    counters, the C++ reduction (built at the first call), the non-finite guard, the gradient clip,
    beginning and ending a step, and pickling without the C++ objects."""

    def __init__(self, config: ReducerConfig):
        self.config = config
        self.step = 0
        self._stats = TrafficStats()
        self._runtime = None  # torch.classes.gradzip.CompressedAllreduce, built at the first call
        self._guard = config.new_guard()
        self._guard_step = 0  # the step whose residual updates the guard holds
        self._begun_step = -1  # the step whose reductions have begun
        self._clip = config.new_clip()

    def _begin_step(self) -> None:
        """At each reduction: the first of a new step settles the previous one (every reduction of
        it is complete) and begins the optimizer direction's step."""
        if self._guard_step != self.step:
            self._commit()
        # apart from the commit, which state_dict() also makes between steps: the update of a step
        # that was skipped (a non-finite one) must not count in the next one's
        if self._begun_step != self.step:
            self._begun_step = self.step
            if self.config.direction is not None:
                self.config.direction.begin_step_()

    def _end_step(self) -> None:
        """After a step's last reduction: its gradient norm and traffic are kept, the step count
        advances."""
        if self._clip is not None:
            self._clip.end_step()
        self._stats.end_step(self.step)
        self.step += 1

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
        self.__dict__.setdefault("_begun_step", -1)  # pickled before it was kept
        self._guard = self.config.new_guard()
        self._guard_step = self.step
