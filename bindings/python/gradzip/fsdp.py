"""Compressed gradient reduce-scatter with error feedback for FSDP2 (``fully_shard``).

    from torch.distributed.fsdp import fully_shard
    import gradzip.fsdp

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    state = gradzip.fsdp.compress(model, "int8")   # before the first backward
    # ... train as usual; state.stats, state.state_dict() / load_state_dict()

FSDP keeps gradients sharded, so its gradient step is a reduce-scatter, not an all-reduce: each
rank encodes the W shards of its unsharded gradient (error feedback on the whole unsharded
gradient, one residual per FSDP parameter group), sends shard j to rank j (one all-to-all), and
decodes the W encodings of its own shard in rank order, summing in fp32. No second phase: the
sum is the sharded gradient. Top-k selects per destination shard (k = ceil(ratio * shard) of each).
The reduction is C++ (``torch.classes.gradzip.CompressedAllreduce.reduce_scatter``, the encode,
all-to-all and fp32 sum of the DDP hook's reduction, see bindings/torch/bucket_reduction.hpp).

``lowrank:R`` has no per-shard encoding: P and Q of a parameter need all of its rows. Each rank
reduces the group's unsharded gradient (its parameters one after the other, FSDP's padding left
out) as the DDP hook reduces a bucket (``CompressedAllreduce.reduce``: two fp32
all-reduces of the factors, error feedback M - P Q^T / W on the unsharded gradient, each
parameter's Q kept between steps and identical on every rank) and keeps its own rows of the
average. Its parameters must be sharded on dim 0 (FSDP's default).

FSDP's own rules hold: the gradient arrives in FSDP's reduce dtype (``MixedPrecisionPolicy``) and
the result is returned in it; FSDP's divide factors are kept (``AVG`` averages, the pre- and
post-division FSDP applies around a ``SUM`` stay FSDP's, ``set_gradient_divide_factor`` scales by
1/factor); the shards are FSDP's, padding included (padded elements are zero on the wire and in
the residual). HSDP's replica all-reduce, where configured, stays uncompressed.

``compress(..., ranks_per_node=R)``: the two-level reduce-scatter of nodes of R ranks (exact inside
a node, the codec between nodes; see ``FSDPCompressionState._node_sum``), as gradzip.two_level
reduces DDP's buckets.

``compress(..., optimizer=opt)`` with a ``gradzip.optim.FrozenVarianceAdamW`` over the model's
sharded parameters: the reduce-scatter computes its direction as the DDP hook does (exact AdamW
through ``warmup_steps``, then v frozen and the momentum compressed), with the Adam state sharded
as FSDP shards the rest: each rank keeps m and v of its own shard, and from the freeze on the whole
groups' frozen denominator and momentum over it (``denominator_dtype``, bf16 by default). Its
compressed steps are the DDP hook's two-phase all-reduce of the whole group (each rank's
candidate momentum, the owner's re-encode with its own residual, the all-gather): twice the bytes
of the reduce-scatter, which compressed only the gradient's part and collapsed the model on the
harness. The reduce-scatter's output, hence the sharded gradient, holds the update, which
``opt.step()`` applies with decoupled weight decay. See :mod:`gradzip.fsdp_adam`.
"""

import logging
import math
import warnings
from dataclasses import dataclass
from functools import cached_property
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from . import _ops  # noqa: F401  (loads the extension that defines torch.classes.gradzip)
from ._groups import gather_group_name, reducing_group, require_same_config
from .bucket_state import initial_qs, tuplify
from .fsdp_adam import DENOMINATOR_DTYPES, ShardedAdam
from .optim import FrozenVarianceAdam
from .plan import CodecPlan
from .reducer import ReducerConfig, ReducerState, reduce_bucket
from .param_gather import CompressedAllGather, param_codec as _param_codec
from .two_level import NodeGroups, check_two_level, checked_ranks_per_node
from .wire import MIN_COMPRESS_NUMEL, travels_uncompressed

__all__ = ["compress", "FSDPCompressionState", "CompressedReduceScatter"]

logger = logging.getLogger(__name__)

_STATE_VERSION = 1


@dataclass(frozen=True)
class _Param:
    fqn: str
    size: Tuple[int, ...]  # the unsharded parameter's
    shard_dim: int


@dataclass(frozen=True)
class _GroupLayout:
    """Where one FSDP parameter group's gradient lies in FSDP's reduce-scatter input: W rows of S
    elements, row j = every parameter's chunk j (dim 0 padded to a multiple of W), in order."""

    world: int
    params: Tuple[_Param, ...]

    # Computed once per layout (a group's layout lives as long as its state): every step reads them.
    @cached_property
    def chunks(self) -> List[int]:
        """Elements of each parameter's chunk in a row."""
        out = []
        for p in self.params:
            numel = math.prod(p.size)
            if p.shard_dim == 0 and p.size:
                rows = -(-p.size[0] // self.world)
                out.append(rows * (numel // p.size[0]) if p.size[0] else 0)
            else:
                out.append(numel // self.world)
        return out

    @cached_property
    def shard(self) -> int:
        return sum(self.chunks)

    @cached_property
    def numels(self) -> List[int]:
        """The pieces of the input, in order (block-scaled codecs restart their blocks at each)."""
        return self.row_numels(self.world)

    def row_numels(self, rows: int) -> List[int]:
        """The pieces of ``rows`` rows (each row holds every parameter's chunk, in order)."""
        return [c for _ in range(rows) for c in self.chunks if c]

    def exact(self, uncompressed_numel: int, rows: Optional[int] = None) -> List[bool]:
        """Per piece of ``row_numels(rows)`` (default: the whole input's), whether its parameter
        travels in fp32."""
        flags = [travels_uncompressed(p.size, uncompressed_numel) for p in self.params]
        return [f for _ in range(rows or self.world) for f, c in zip(flags, self.chunks) if c]

    def padding(self) -> torch.Tensor:
        """Indices of the input's padding elements (FSDP's zero rows past a parameter's dim 0)."""
        index, row = [], 0
        for j in range(self.world):
            for p, c in zip(self.params, self.chunks):
                if p.shard_dim == 0 and p.size and c:
                    per_row = c // -(-p.size[0] // self.world)
                    real = max(0, min(c, (p.size[0] - j * (c // per_row)) * per_row))
                    index.extend(range(row + real, row + c))
                row += c
        return torch.tensor(index, dtype=torch.long)

    def describe(self) -> tuple:
        return (self.world, tuple((p.fqn, p.size, p.shard_dim) for p in self.params))

    @cached_property
    def bucket(self) -> tuple:
        """The unsharded group as a DDP bucket (bucket_state.Layout): its parameters' names (the
        keys that seed their first Q) and shapes, one after the other."""
        return (sum(math.prod(p.size) for p in self.params),
                tuple((p.fqn, p.size) for p in self.params))

    def unsharded_index(self) -> torch.Tensor:
        """The input's position of each element of ``bucket`` (dim-0 shards only): row i of a
        parameter is row i % r of its chunk i // r, r = ceil(rows / W)."""
        parts, start = [], 0
        for p, c in zip(self.params, self.chunks):
            if c:
                r = -(-p.size[0] // self.world)
                i = torch.arange(p.size[0])
                row = (i // r) * self.shard + start + (i % r) * (c // r)
                parts.append((row[:, None] + torch.arange(c // r)).reshape(-1))
            start += c
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


class _GroupState:
    """One parameter group's state on this rank. The codecs' reduce-scatter takes ``rows`` rows of
    the input (all W of them; with nodes of R ranks, the W / R rows of this local rank: see
    ``_node_sum``), pieces ``numels``, and keeps the ``residual`` of those rows, whose padding
    elements are ``padding``. lowrank: ``residual`` is the unsharded gradient's
    (``layout.bucket``), ``q`` its parameters' Q factors; ``gather`` takes the unsharded gradient
    out of the input, ``mine`` / ``into`` move this rank's rows of it into the output.
    ``owner_residual`` (this rank's shard): only with the optimizer, whose compressed steps are a
    two-phase all-reduce; the reduce-scatter keeps each rank's shard of the sum as it is.
    ``node_rows``: with nodes, the buffers of the exact sum inside the node (reused)."""

    __slots__ = ("layout", "rows", "numels", "residual", "owner_residual", "padding", "q", "gather",
                 "mine", "into", "adam", "node_rows")

    def __init__(self, layout: _GroupLayout, rows: int, padding: torch.Tensor,
                 residual: Optional[torch.Tensor], q: Optional[torch.Tensor], rank: int, device,
                 adam: Optional[ShardedAdam] = None,
                 owner_residual: Optional[torch.Tensor] = None):
        self.layout, self.residual, self.q, self.adam = layout, residual, q, adam
        self.rows, self.numels = rows, layout.row_numels(rows)
        self.owner_residual = owner_residual
        self.padding = padding.to(device)
        self.node_rows = None
        self.gather = self.mine = self.into = None
        if q is not None:
            index = layout.unsharded_index()
            first = rank * layout.shard
            mine = ((index >= first) & (index < first + layout.shard)).nonzero().view(-1)
            self.gather, self.mine = index.to(device), mine.to(device)
            self.into = (index[mine] - first).to(device)


class CompressedReduceScatter(ReduceScatter):
    """The ``ReduceScatter`` that :func:`compress` installs on one FSDP parameter group
    (``FSDPModule.set_custom_reduce_scatter``); it reduces through its shared state."""

    def __init__(self, state: "FSDPCompressionState", index: int, param_group):
        self._state, self._index, self._param_group = state, index, param_group

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op, async_op: bool = False) -> Optional[dist.Work]:
        return self._state._reduce_scatter(self._index, output_tensor, input_tensor, group, op,
                                           async_op, self._param_group.gradient_divide_factor)


class FSDPCompressionState(ReducerState):
    """State of the compressed reduce-scatter of every FSDP parameter group under one root (made by
    :func:`compress`).

    ``stats`` holds the last completed step's traffic of this rank (``bytes_sent``,
    ``bytes_received``, ``raw_bytes`` = what FSDP's own reduce-scatter of the same input in its
    reduce dtype sends, ``compression_ratio`` = raw / sent; lowrank counts its two all-reduces as
    the DDP hook does). A step ends when every parameter group
    has been reduced once (or one is reduced again). ``state_dict()`` / ``load_state_dict()`` carry
    the residuals (one per parameter group, checked against the group's parameters, sizes and
    world size), lowrank's Q factors and the step count; the state pickles without process groups
    or modules.

    The first reduce-scatter checks, with one small all-gather, that every rank uses the same
    configuration and parameter groups, and raises ``ValueError`` on all ranks otherwise. On CPU
    tensors the reduction runs on a process group of its own (same ranks, backend and timeout),
    created at that call; on CUDA tensors on FSDP's group, in its reduce-scatter stream.
    """

    def __init__(self, codec: str, error_feedback: bool = True, warmup_steps: int = 0,
                 min_compress_numel: int = MIN_COMPRESS_NUMEL, guard_nonfinite: bool = True,
                 param_codec: Optional[str] = None, uncompressed_numel: int = 0,
                 optimizer=None, denominator_dtype: str = "bf16",
                 residual_dtype: torch.dtype = torch.float32, ranks_per_node: int = 1):
        _check_optimizer(optimizer, codec, denominator_dtype)
        self.ranks_per_node = checked_ranks_per_node(ranks_per_node)
        if self.ranks_per_node > 1:
            check_two_level(codec, optimizer)
        self._nodes: Optional[NodeGroups] = None  # with ranks_per_node > 1, made at the first call
        # the settings, their checks and the warm-up / small-group policy are the DDP hook's; the
        # reduce-scatter sums every codec in fp32
        super().__init__(ReducerConfig(codec, error_feedback, warmup_steps, min_compress_numel,
                                 guard_nonfinite, optimizer=optimizer, cast_sum="fp32",
                                 uncompressed_numel=uncompressed_numel, reduce_scatter=True,
                                 residual_dtype=residual_dtype))
        # the dtype of the frozen denominator each rank keeps of every whole parameter group
        self.denominator_dtype = DENOMINATOR_DTYPES[denominator_dtype]
        self.param_codec = None if param_codec is None else _param_codec(param_codec)
        # the parameter all-gathers' bytes since construction (CompressedAllGather adds to it)
        self._gather_traffic = {"bytes_sent": 0, "raw_bytes": 0}
        self._config_checked = False
        self._params: Dict[int, Tuple[_Param, ...]] = {}  # per group index, set by compress()
        self._groups: Dict[int, _GroupState] = {}
        self._loaded: Dict[int, dict] = {}  # checkpointed groups not yet reduced in this process
        self._reduced = set()  # group indices reduced in the current step
        self._group_name = None

    def describe(self, world: int) -> str:
        groups = ",".join(f"{i}:{len(p)}:{sum(math.prod(q.size) for q in p)}"
                          for i, p in sorted(self._params.items()))
        return (f"{self.config.describe(world)} param_codec={self.param_codec or 'none'} "
                f"denominator={self.denominator_dtype} ranks_per_node={self.ranks_per_node} "
                f"groups={groups}")

    @property
    def all_gather_traffic(self) -> dict:
        """What this rank's parameter all-gathers sent since the state was made: ``bytes_sent``,
        ``raw_bytes`` (FSDP's own all-gathers of the same inputs) and ``compression_ratio``; with
        ``param_codec=None`` nothing is counted."""
        t = dict(self._gather_traffic)
        t["compression_ratio"] = t["raw_bytes"] / t["bytes_sent"] if t["bytes_sent"] else 1.0
        return t

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        self._commit()
        clone = lambda t: None if t is None else t.detach().clone()  # noqa: E731
        groups = {i: {"layout": g.layout.describe(), "residual": clone(g.residual), "q": clone(g.q),
                      "owner_residual": clone(g.owner_residual),
                      "adam": None if g.adam is None else g.adam.state_dict()}
                  for i, g in self._groups.items()}
        groups.update({i: d for i, d in self._loaded.items() if i not in groups})
        return {"version": _STATE_VERSION, "codec": self.config.codec, "step": self.step,
                "error_feedback": self.config.error_feedback, "groups": groups,
                "ranks_per_node": self.ranks_per_node}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"gradzip: unsupported FSDPCompressionState version "
                             f"{state.get('version')} (this gradzip reads version {_STATE_VERSION})")
        cfg = self.config
        if state["codec"] != cfg.codec or bool(state["error_feedback"]) != cfg.error_feedback:
            raise ValueError(f"gradzip: checkpoint was saved with codec {state['codec']!r}, "
                             f"error_feedback={state['error_feedback']}; this state uses "
                             f"{cfg.codec!r}, error_feedback={cfg.error_feedback}")
        with_adam = self.config.direction is not None
        if any((d.get("adam") is not None) != with_adam for d in state["groups"].values()):
            raise ValueError("gradzip.fsdp: the checkpoint was saved " +
                             ("without an optimizer's Adam state; this state has one" if with_adam
                              else "with an optimizer's Adam state; this state has none") +
                             " (compress(..., optimizer=...) must be the same)")
        unknown = set(state["groups"]) - set(self._params)
        if unknown:
            raise ValueError(f"gradzip: checkpoint holds parameter groups {sorted(unknown)} that "
                             f"this model does not have ({len(self._params)} groups)")
        self._commit()
        self.step = int(state["step"])
        self._groups, self._reduced = {}, set()
        self._loaded = {int(i): d for i, d in state["groups"].items()}
        saved = state.get("ranks_per_node", 1)
        if saved != self.ranks_per_node:
            warnings.warn(f"gradzip.fsdp: the checkpoint was saved with ranks_per_node={saved}, "
                          f"this state has {self.ranks_per_node}: a rank's residual covers other "
                          "rows, the residuals are dropped", stacklevel=2)
            self._loaded = {i: dict(d, residual=None) for i, d in self._loaded.items()}

    def __getstate__(self):
        d = super().__getstate__()
        d["_group_name"] = None
        d["_config_checked"] = False
        d["_nodes"] = None
        return d

    # -- internals --------------------------------------------------------------------------------
    def _end_step(self) -> None:
        super()._end_step()
        self._reduced = set()

    def _check_config(self, group, device) -> None:
        """Once, before this process's first compressed collective (an all-gather or a
        reduce-scatter): every rank's settings and parameter groups agree."""
        if not self._config_checked:
            require_same_config(self.describe(group.size()), group, device, "gradzip.fsdp")
            self._config_checked = True

    def _setup(self, group, device) -> None:
        if self._runtime is None:
            self._check_config(group, device)
            # with the optimizer, compressed steps are the DDP hook's two-phase all-reduce
            # (gradzip.fsdp_adam), whose CPU all-gathers want a group of their own
            plan = self.config.plan
            gather = "" if self.config.direction is None else \
                gather_group_name(group, device, plan)
            between = group
            if self.ranks_per_node > 1:
                if group.size() != dist.get_world_size():
                    raise ValueError(f"gradzip.fsdp: ranks_per_node lays nodes out over the "
                                     f"default group's {dist.get_world_size()} ranks; FSDP "
                                     f"reduces over {group.size()} of them (HSDP?)")
                self._nodes = NodeGroups(self.ranks_per_node)
                between = self._nodes.across
            self._runtime = torch.classes.gradzip.CompressedAllreduce(
                reducing_group(between, device).group_name, self.config.codec, self._guard,
                plan.cast_sum, gather)
            self._group_name = group.group_name
        elif group.group_name != self._group_name:
            raise ValueError("gradzip.fsdp: every parameter group must reduce over the same "
                             f"process group (got {group.group_name!r} after "
                             f"{self._group_name!r})")

    def _group_state(self, index: int, world: int, rank: int, device) -> _GroupState:
        st = self._groups.get(index)
        if st is None:
            layout = _GroupLayout(world, self._params[index])
            q_rank = self.config.plan.lowrank_rank
            rows, padding = world, layout.padding()
            if self._nodes is not None:  # this local rank's rows (_node_sum)
                r, local = self.ranks_per_node, self._nodes.local_rank
                rows = world // r
                row, at = padding // layout.shard, padding % layout.shard
                mine = row % r == local
                padding = row[mine] // r * layout.shard + at[mine]
            residual = q = None
            if self.config.keeps_residual:  # lowrank's: of the unsharded gradient, no padding
                n = layout.bucket[0] if q_rank else rows * layout.shard
                residual = torch.zeros(n, dtype=self.config.residual_dtype, device=device)
            if q_rank:
                q = initial_qs(layout.bucket, q_rank, device)
            adam = None
            if self.config.direction is not None:
                padding = layout.padding()
                mine = padding[(padding >= rank * layout.shard) &
                               (padding < (rank + 1) * layout.shard)] - rank * layout.shard
                adam = ShardedAdam(layout.shard, mine, device)
            # the owner's residual of the two-phase all-reduce the optimizer's compressed steps use
            owner = None if adam is None or residual is None else torch.zeros(
                layout.shard, dtype=self.config.residual_dtype, device=device)
            saved = self._loaded.pop(index, None)
            if saved is not None:
                if tuplify(saved["layout"]) != layout.describe():
                    raise ValueError(f"gradzip.fsdp: parameter group {index}: the checkpoint's "
                                     f"layout {saved['layout']} is not this model's "
                                     f"{layout.describe()} (another model or world size?)")
                if residual is not None and saved["residual"] is not None:
                    residual.copy_(saved["residual"])
                if q is not None and saved.get("q") is not None:
                    q.copy_(saved["q"])
                if owner is not None and saved.get("owner_residual") is not None:
                    owner.copy_(saved["owner_residual"])
                if adam is not None:
                    adam.load_state_dict(saved["adam"], self.denominator_dtype)
            st = self._groups[index] = _GroupState(layout, rows, padding, residual, q, rank, device,
                                                   adam, owner)
        return st

    def _prescale(self, op, world: int, divide_factor: Optional[float]) -> float:
        kind = getattr(op, "op", op)  # a ReduceOp (premul_sum) or its RedOpType
        if kind == dist.ReduceOp.AVG:
            return 1.0 / world
        if kind == dist.ReduceOp.SUM:
            return 1.0
        if kind == dist.ReduceOp.PREMUL_SUM and divide_factor:
            return 1.0 / float(divide_factor)
        raise ValueError(f"gradzip.fsdp: unsupported reduce-scatter op {op} (AVG, SUM or FSDP's "
                         "divide factor)")

    def _reduce_scatter(self, index, output, input, group, op, async_op, divide_factor):
        world, rank = group.size(), group.rank()
        if index in self._reduced:
            self._end_step()  # a group not reduced in the last step (no gradient): end it here
        self._begin_step()
        self._setup(group, input.device)
        st = self._group_state(index, world, rank, input.device)
        if input.numel() != world * st.layout.shard or output.numel() != st.layout.shard:
            raise ValueError(f"gradzip.fsdp: parameter group {index}: reduce-scatter of "
                             f"{input.numel()} -> {output.numel()} elements, its parameters make "
                             f"{world} x {st.layout.shard} (parameters changed after compress()?)")
        compressed = self.config.compresses(self.step, input.numel(), world)
        # FSDP's own reduce-scatter of the same input (with nodes: of the node sums between them)
        raw = (st.rows - 1) * st.layout.shard * input.element_size()
        if st.adam is not None:
            self._check_adam_op(op)
            if compressed:  # v freezes at the group's first compressed step
                st.adam.freeze_(self.config.direction, group, self.denominator_dtype)
            if self._guard is not None:  # before the update: an overflow step undoes it
                self._guard.save([st.adam.m, st.adam.m_over_den] if compressed else
                                 [st.adam.m, st.adam.v])
        if compressed:
            scale = self._prescale(op, world, divide_factor)
            if st.q is not None:
                fut = self._reduce_lowrank(index, st, output, input, scale * world)
            else:
                x = input.reshape(-1)
                x = x if x.dtype == torch.float32 else x.float()
                exact = st.layout.exact(self.config.uncompressed_numel, st.rows)
                if st.adam is not None:
                    st.adam.send_(self.config.direction, x)
                    fut = self._allreduce_adam(index, st, x, exact)
                    fut = fut.then(self._finishing_adam(st, output, rank, x))
                else:
                    if self._nodes is not None:
                        x = self._node_sum(st, x)
                    fut = self._reduce_codec(index, st, output, x, scale, exact)
            sent, received = self._runtime.traffic(index)
        else:
            sent = received = raw
        self._stats.add(sent, received, raw, compressed)
        self._reduced.add(index)
        if len(self._reduced) == len(self._params):
            self._end_step()
        if not compressed:
            if st.adam is None:
                return dist.reduce_scatter_tensor(output, input, op=op, group=group,
                                                  async_op=async_op)
            dist.reduce_scatter_tensor(output, input, op=op, group=group)
            if self._guard is not None:
                self._guard.flag(output)
            fut = torch.futures.Future()
            fut.set_result(self._finish_adam(st, output, rank, compressed=False))
        if async_op:
            return torch._C._distributed_c10d._create_work_from_future(fut)
        fut.wait()
        return None

    def _check_adam_op(self, op) -> None:
        """The optimizer's update is written into FSDP's reduce-scatter output: FSDP must not
        scale it afterwards, as it does after a SUM (an fp16 reduce dtype, or
        set_force_sum_reduction_for_comms)."""
        if getattr(op, "op", op) == dist.ReduceOp.SUM:
            raise ValueError("gradzip.fsdp: with optimizer=..., the reduce-scatter writes the "
                             "optimizer's update, which FSDP would divide after a SUM reduce-"
                             "scatter (an fp16 reduce_dtype, or set_force_sum_reduction_for_comms):"
                             " use an fp32 or bf16 reduce_dtype")

    def _finishing_adam(self, st, output, rank, whole):
        """The callback that finishes a compressed step's Future for the optimizer: ``whole``,
        the group's all-reduced candidates."""
        def finish(f):
            f.value()  # raises the reduction's error, if any
            return self._finish_adam(st, output, rank, compressed=True, whole=whole)
        return finish

    def _finish_adam(self, st, output, rank, compressed, whole=None) -> list:
        """The optimizer's update of this rank's shard, written into ``output``: from the whole
        group's averaged candidates ``whole`` (a compressed step), or from the exactly averaged
        shard in ``output``."""
        out = output.view(-1)
        avg = out if out.dtype == torch.float32 else out.float()
        if compressed:
            whole.index_fill_(0, st.padding, 0.0)  # a codec may decode padding to non-zero (sign)
            st.adam.receive_(self.config.direction, whole, rank, avg)
        else:
            st.adam.exact_(self.config.direction, avg)
        if avg is not out:
            out.copy_(avg)
        self.config.direction.wrote_(out)
        return [output]

    def _prepare_residual(self, st) -> None:
        """Before a compressed reduction: the guard's backup of the residual as it is, then its
        padding zeroed (FSDP pads with zeros; a codec may have left non-zero errors there)."""
        if st.residual is not None:
            if self._guard is not None:
                self._guard.save([st.residual])  # before the update: an overflow step undoes it
            st.residual.index_fill_(0, st.padding, 0.0)

    def _reduce_codec(self, index, st, output, x, prescale, exact):
        self._prepare_residual(st)
        return self._runtime.reduce_scatter(index, output.view(-1), x, st.numels, st.residual,
                                            prescale, exact)

    def _node_sum(self, st, x):
        """The two-level reduce-scatter's first phase: row j of the input (W rows, row j = rank
        j's shard) belongs to node j // R's local rank j % R. An exact fp32 reduce-scatter inside
        the node gives local rank l the node's sum of rows l, R + l, 2R + l, ... (one per node);
        the codec's reduce-scatter of those rows over the N ranks of local rank l, one per node,
        then leaves rank j the sum of row j over every rank (its shard): the slow link carries one
        node's compressed gradient, not every rank's."""
        r, rows, shard = self.ranks_per_node, st.rows, st.layout.shard
        if st.node_rows is None:
            st.node_rows = (torch.empty(r * rows * shard, dtype=torch.float32, device=x.device),
                            torch.empty(rows * shard, dtype=torch.float32, device=x.device))
        by_local, node_sum = st.node_rows
        by_local.view(r, rows, shard).copy_(x.view(rows, r, shard).transpose(0, 1))
        dist.reduce_scatter_tensor(node_sum, by_local, group=self._nodes.node)
        return node_sum

    def _allreduce_adam(self, index, st, x, exact):
        """The two-phase all-reduce of the whole group's candidates ``x``, in place, as the DDP
        hook's (worker and owner residuals; the C++ reduction saves the owner's for the guard)."""
        self._prepare_residual(st)
        numels = st.layout.numels
        # rows (lowrank's matrix shapes, which a group with an optimizer never has): one per tensor
        return self._runtime.reduce(index, x, x, numels, st.residual, st.owner_residual, True,
                                    exact, numels, None)

    def _reduce_lowrank(self, index, st, output, input, scale):
        """The whole unsharded gradient's lowrank average on every rank (the DDP hook's
        reduction of a bucket), ``scale`` times it (FSDP's op: W for a SUM) in this rank's rows."""
        x = input.reshape(-1).index_select(0, st.gather).float()
        fut = reduce_bucket(self._runtime, index, x, x, st.layout.bucket, st)

        def keep_mine(f):
            mine = f.value()[0].index_select(0, st.mine)
            if scale != 1.0:
                mine.mul_(scale)
            out = output.view(-1)
            out.zero_()  # FSDP's padding
            out.index_copy_(0, st.into, mine.to(out.dtype))
            return [output]

        return fut.then(keep_mine)


def _check_optimizer(optimizer, codec: str, denominator_dtype: str) -> None:
    """What FSDP's reduce-scatter can carry of a gradzip.optim optimizer: FrozenVarianceAdamW's
    direction, with its variance frozen once, through a codec that encodes each shard."""
    if denominator_dtype not in DENOMINATOR_DTYPES:
        raise ValueError(f"gradzip.fsdp: denominator_dtype must be one of "
                         f"{sorted(DENOMINATOR_DTYPES)}, got {denominator_dtype!r}")
    if optimizer is None:
        return
    direction = getattr(optimizer, "direction", None)
    if not isinstance(direction, FrozenVarianceAdam):
        raise TypeError("gradzip.fsdp: optimizer must be a gradzip.optim.FrozenVarianceAdamW over "
                        f"the FSDP model's parameters, got {type(optimizer).__name__} (torch's "
                        "optimizers take compressed gradients without optimizer=...; "
                        "CompressedSGD keeps each rank's velocity of the whole gradient, which "
                        "FSDP does not hold)")
    if direction.refresh_until:
        raise ValueError("gradzip.fsdp: FrozenVarianceAdamW's refresh_until (0/1 Adam's variance "
                         "refreshes) is not supported under FSDP: the variance freezes once, "
                         "after warmup_steps; use refresh_until=0")
    if CodecPlan.parse(codec).lowrank_rank:
        raise ValueError(f"gradzip.fsdp: optimizer=... needs a codec that encodes each shard "
                         f"(fp32, bf16, fp16, int8, sign, topk), not {codec}")


def _check_optimizer_params(optimizer, groups) -> None:
    """The optimizer steps exactly the parameters whose gradients the reduce-scatter turns into
    its update: another parameter would take a plain gradient as an update, and one left out
    would keep an update as its gradient."""
    sharded = {id(p.sharded_param): p for g in groups for p in g.fsdp_params}
    mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if mine != set(sharded):
        raise ValueError(f"gradzip.fsdp: the optimizer must hold exactly the FSDP model's "
                         f"parameters ({len(sharded)} under root); it holds {len(mine)}, of which "
                         f"{len(mine - set(sharded))} are not the model's")
    if any(g._is_hsdp for g in groups):
        raise ValueError("gradzip.fsdp: optimizer=... under HSDP: the replicas' all-reduce would "
                         "average updates computed from moments it never sees")


def compress(root: torch.nn.Module, codec: str, error_feedback: bool = True,
             warmup_steps: int = 0, min_compress_numel: int = MIN_COMPRESS_NUMEL,
             guard_nonfinite: bool = True, param_codec: Optional[str] = None,
             uncompressed_numel: int = 0, optimizer=None,
             denominator_dtype: str = "bf16",
             residual_dtype: torch.dtype = torch.float32,
             ranks_per_node: int = 1) -> FSDPCompressionState:
    """Installs a compressed reduce-scatter on every FSDP module under ``root`` (already wrapped
    with ``fully_shard``, ``root`` included) and returns their shared state.

    Args:
        codec: ``"bf16"``, ``"fp16"``, ``"int8[:block=N]"``, ``"sign[:block=N]"``,
            ``"topk:RATIO[:values=fp16]"``, ``"lowrank:R"`` (as the DDP hook's).
        error_feedback: keep a residual of the unsharded gradient per parameter group on each rank.
        warmup_steps: the first steps use FSDP's own reduce-scatter.
        min_compress_numel: parameter groups with fewer unsharded gradient elements use FSDP's own
            reduce-scatter (headers and latency dominate there).
        guard_nonfinite: when a reduced shard of a step holds Inf/NaN (an AMP overflow step,
            which GradScaler skips), every residual keeps its value of before the step.
        param_codec: ``"bf16"``, ``"fp16"`` or ``"int8[:block=N]"``: FSDP's parameter all-gathers
            send each rank's fp32 shard in this codec (gradzip.param_gather: no error feedback,
            every rank decodes the same parameters, the sharded ones stay exact; shards FSDP
            gathers in 16 bits already are sent as they are). None: FSDP's own all-gather.
        uncompressed_numel: with int8/sign, the gradients of 1-D parameters and of those with
            fewer elements travel in fp32 (exact sum, no residual), as the DDP hook's option.
        optimizer: a ``gradzip.optim.FrozenVarianceAdamW`` over ``root``'s (sharded) parameters,
            made after ``fully_shard``: the reduce-scatter computes its direction and leaves its
            update in the sharded gradients, which ``opt.step()`` applies (see
            gradzip.fsdp_adam). ``warmup_steps`` (>= 1) are its exact AdamW steps, after which the
            variance freezes and each rank's share of the momentum is compressed. Its m and v are
            sharded, in ``state_dict()``.
        denominator_dtype: ``"bf16"`` or ``"fp32"``: the frozen denominator of every whole
            parameter group, which each rank keeps from the freeze on (2 or 4 bytes per parameter).
        residual_dtype: ``torch.float32``, or ``torch.bfloat16``: the compact residual, half the
            bytes (each update rounded to bfloat16; the guard's backup is then bfloat16 too).
        ranks_per_node: R > 1: the W = N x R ranks (FSDP's group must be the default one,
            numbered node by node as torchrun numbers them) reduce in two levels, exact inside a
            node (an fp32 reduce-scatter) and the codec between nodes, each rank over the N ranks
            of its local rank (gradzip.two_level's layout; see ``_node_sum``): the slow link
            carries one node's compressed gradient, and a rank's residual is 1/R of the flat
            one's. Not with ``optimizer`` or ``lowrank:R``.

    ``"lowrank:R"`` (the DDP hook's PowerSGD class) needs every parameter sharded on dim 0.
    """
    state = FSDPCompressionState(codec, error_feedback, warmup_steps, min_compress_numel,
                                 guard_nonfinite, param_codec, uncompressed_numel, optimizer,
                                 denominator_dtype, residual_dtype, ranks_per_node)
    names = {id(p): n for n, p in root.named_parameters(remove_duplicate=False)}
    modules = [m for m in root.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise TypeError("gradzip.fsdp.compress: no module under root is wrapped with fully_shard")
    if optimizer is not None:
        _check_optimizer_params(optimizer, [g for m in modules
                                            if (g := m._get_fsdp_state()._fsdp_param_group)])
    for module in modules:
        group = module._get_fsdp_state()._fsdp_param_group
        if group is None:
            continue  # manages no parameters of its own
        index = len(state._params)
        state._params[index] = tuple(
            _Param(names.get(id(p.sharded_param), f"{index}.{k}"), tuple(p._orig_size),
                   int(p.fsdp_placement.dim))
            for k, p in enumerate(group.fsdp_params))
        other = [p.fqn for p in state._params[index] if p.shard_dim != 0 or not p.size]
        if state.config.plan.lowrank_rank and other:
            raise ValueError(f"gradzip.fsdp: {state.codec} needs every parameter sharded on dim 0 "
                             f"(FSDP's default); {other} are not")
        module.set_custom_reduce_scatter(CompressedReduceScatter(state, index, group))
        if state.param_codec is not None:
            params = state._params[index]
            module.set_custom_all_gather(CompressedAllGather(
                state.param_codec, lambda world, params=params: _GroupLayout(world, params).chunks,
                state._gather_traffic, state._check_config))
    return state

