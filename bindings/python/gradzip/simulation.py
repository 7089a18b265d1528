"""W ranks in one process: :class:`SimulatedWorkers` runs the DDP hook's C++ reduction for W
workers, its steps in the order the hook's C++ driver runs them, each exchange done in memory by
copying bytes (``torch.ops.gradzip.reduce_in_memory``, ``bindings/torch/in_memory_exchange.hpp``),
so that its result equals the multi-rank hook bit for bit, except where the backend sums: the
casts' one all-reduce (``cast_sum="wire"``; simulated as the fp32 sum of the W payloads in rank
order rounded once, equal to the wire dtype's rounding of a W-term sum) and warm-up and small
buckets (a plain fp32 all-reduce; equal to fp32 rounding). With ``ranks_per_node`` it runs the
two-level reduction of :mod:`gradzip.two_level` instead.
"""

from __future__ import annotations

import math
from typing import List, Optional

import torch

from . import _ops  # noqa: F401  (loads the extension that defines torch.classes.gradzip)
from .bucket_state import StateStore
from .plan import TrafficStats
from .reducer import STATE_VERSION, ReducerConfig, Reporting
from .two_level import check_two_level, shard_layout
from .wire import MIN_COMPRESS_NUMEL

__all__ = ["SimulatedWorkers"]


class SimulatedWorkers(Reporting):
    """W workers in one process, each with its own error-feedback state, reduced with exactly the
    arithmetic of :func:`compress_hook` (the same C++ phases in the same order, written once in
    C++; the collectives done in memory by ``torch.ops.gradzip.reduce_in_memory``).

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

    ``ranks_per_node=R`` (R > 1, dividing W): the workers are N = W / R nodes of R ranks, numbered
    node by node, reduced as :class:`gradzip.two_level.TwoLevelState` reduces them: each node's
    exact average of the bucket (summed in rank order, then divided by R), cut into R shards, and
    shard l of every node reduced by the compressed reduction over the N nodes held by their local
    rank l (one simulation of N workers per local rank, its residuals the shard's). Equal to the
    hook bit for bit at R = 2 (a sum of two is the same in any order), to the fp32 rounding of the
    node sums above. ``stats`` are the inter-node reduction's of local rank 0, as the hook's; the
    guard keeps or undoes a step's updates of every shard together. Not with ``optimizer`` or
    ``lowrank:R`` (as the hook).
    """

    def __init__(self, codec: str, world_size: int, error_feedback: bool = True,
                 warmup_steps: int = 0, min_compress_numel: int = MIN_COMPRESS_NUMEL,
                 guard_nonfinite: bool = True, optimizer=None, cast_sum: Optional[str] = None,
                 warmup_codec: Optional[str] = None, uncompressed_numel: int = 0,
                 max_grad_norm: Optional[float] = None,
                 residual_dtype: torch.dtype = torch.float32, ranks_per_node: int = 1):
        if int(world_size) < 1:
            raise ValueError(f"gradzip: world_size must be >= 1, got {world_size}")
        if int(ranks_per_node) < 1 or int(world_size) % int(ranks_per_node):
            raise ValueError(f"gradzip: ranks_per_node={ranks_per_node} does not divide the "
                             f"world size {world_size}")
        if int(ranks_per_node) > 1:
            check_two_level(codec, optimizer)
        self.config = ReducerConfig(codec, error_feedback, warmup_steps, min_compress_numel,
                                    guard_nonfinite, optimizer, cast_sum, warmup_codec,
                                    uncompressed_numel, max_grad_norm,
                                    residual_dtype=residual_dtype)
        self.world_size = int(world_size)
        self.step = 0
        self._ef = [StateStore() for _ in range(self.world_size)]
        self._stats = TrafficStats()
        self._guards = [self.config.new_guard() for _ in range(self.world_size)]
        self._clips = [self.config.new_clip() for _ in range(self.world_size)]
        self._in_step = False  # a bucket of the current step has been reduced
        self._reductions = {}  # (plan, bucket_index, numels, rows, exact, device) -> one per rank
        self.ranks_per_node = int(ranks_per_node)
        self._shards: List[SimulatedWorkers] = []  # two-level: local rank l's, over the nodes
        if self.ranks_per_node > 1:
            self._shards = [
                SimulatedWorkers(codec, self.world_size // self.ranks_per_node, error_feedback,
                                 warmup_steps, min_compress_numel, guard_nonfinite, None, cast_sum,
                                 warmup_codec, uncompressed_numel, None, residual_dtype)
                for _ in range(self.ranks_per_node)]
            self._stats = self._shards[0]._stats

    @property
    def grad_norm(self) -> Optional[torch.Tensor]:
        """With ``optimizer``: rank 0's gradient norm at the last complete step, before
        ``max_grad_norm`` clipped it (see CompressionState.grad_norm); else None."""
        return None if self._clips[0] is None else self._clips[0].grad_norm

    def residuals(self, rank: int = 0) -> List[torch.Tensor]:
        """The error-feedback residuals a worker holds (worker and owner, every bucket; with
        ranks_per_node, of its shards)."""
        if self._shards:
            node, local = divmod(rank, self.ranks_per_node)
            return self._shards[local].residuals(node)
        return self._ef[rank].residuals()

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
        layout = bucket_layout(n, bucket_index, numels, keys, shapes)
        if self._shards:
            return self._reduce_two_level(flats, bucket_index, is_last, layout)
        bucket = cfg.begin_bucket(self.step, layout, world, reduction_guards=False)
        states = [cfg.bucket_state(self._ef[r], bucket_index, layout, world, r, flats[r].device)
                  for r in range(world)]
        if cfg.direction is not None and not self._in_step:
            cfg.direction.begin_step_()
        self._in_step = True
        selected = [bucket.send(f, st, g, c)
                    for f, st, g, c in zip(flats, states, self._guards, self._clips)]
        if bucket.plan is None:
            out = torch.zeros_like(flats[0])
            for f in flats:
                out += f / world
            # each rank's own copy where the optimizer finishes it in place
            outs = [out] * world if cfg.direction is None else [out] + [
                out.clone() for _ in range(world - 1)]
            traffic = (bucket.raw_bytes,) * 2  # the fp32 all-reduce is the reference itself
        else:
            outs = [torch.empty_like(f) for f in flats]
            ranks = self._reductions_of(bucket, bucket_index, flats[0])
            bucket.reduce_in_memory(ranks, flats, states, outs)
            traffic = ranks[0].traffic()
        bucket.count(self._stats, traffic)  # rank 0's, as the hook's stats are its rank's
        for o, st, sel, g in zip(outs, states, selected, self._guards):
            bucket.receive(o, st, sel, g)
        if cfg.direction is not None:
            cfg.direction.wrote_(outs[0])
        if is_last:
            self._end_step()
        return outs[0]

    def _end_step(self) -> None:
        """After a step's last bucket: the guard keeps or undoes the step's updates, the step
        count advances."""
        for g in self._guards:
            if g is not None:
                g.commit()
        for c in self._clips:
            if c is not None:
                c.end_step()
        self._in_step = False
        self._stats.end_step(self.step)
        self.step += 1

    def _reduce_two_level(self, flats, bucket_index, is_last, layout) -> torch.Tensor:
        """The two-level reduction of one bucket (see the class docstring)."""
        r, n = self.ranks_per_node, layout[0]
        shard = -(-n // r)
        nodes = []
        for node in range(self.world_size // r):
            total = torch.zeros(r * shard, dtype=torch.float32, device=flats[0].device)
            for f in flats[node * r:(node + 1) * r]:
                total[:n] += f
            nodes.append(total.div_(r))
        out = torch.empty(r * shard, dtype=torch.float32, device=flats[0].device)
        for local, sim in enumerate(self._shards):
            sim.step = self.step
            piece = shard_layout(layout, local, shard)
            part = slice(local * shard, (local + 1) * shard)
            out[part] = sim.reduce([avg[part] for avg in nodes], bucket_index, is_last=False,
                                   shapes=[s for _, s in piece[1]], keys=[k for k, _ in piece[1]])
        for sim in self._shards:
            for g in sim._guards:
                if g is not None:  # the whole bucket: every shard's updates kept or undone alike
                    g.flag(out[:n])
        if is_last:
            for sim in self._shards:
                sim._end_step()
            self.step += 1
        return out[:n]

    def _reductions_of(self, bucket, index, like):
        """The W ranks' C++ reductions of a bucket (the codec's or lowrank's, as its spec says),
        made at its first step and reused while its layout stays."""
        plan = bucket.plan
        key = (plan, index, tuple(bucket.numels), tuple(bucket.rows), tuple(bucket.exact),
               like.device)
        if key not in self._reductions:
            self._reductions[key] = [
                torch.classes.gradzip.BucketReduction(plan.spec, self.world_size, r,
                                                      list(bucket.numels), like, plan.cast_sum,
                                                      list(bucket.exact), list(bucket.rows))
                for r in range(self.world_size)]
        return self._reductions[key]

    def state_dict(self) -> dict:
        d = {"version": STATE_VERSION, "codec": self.config.codec, "step": self.step,
             "world_size": self.world_size,
             "workers": [store.state_dict() for store in self._ef],
             "clips": [None if c is None else c.state_dict() for c in self._clips]}
        if self._shards:
            d["ranks_per_node"] = self.ranks_per_node
            d["shards"] = [sim.state_dict() for sim in self._shards]
        return d

    def load_state_dict(self, state: dict) -> None:
        layout = (state.get("codec"), state.get("world_size"), state.get("ranks_per_node", 1))
        if layout != (self.config.codec, self.world_size, self.ranks_per_node):
            raise ValueError("gradzip: SimulatedWorkers checkpoint is for codec %r x %s (%s per "
                             "node), this is %r x %s (%s per node)"
                             % (*layout, self.config.codec, self.world_size, self.ranks_per_node))
        for sim, d in zip(self._shards, state.get("shards", [])):
            sim.load_state_dict(d)
        self.step = int(state["step"])
        for store, d in zip(self._ef, state["workers"]):
            store.load_state_dict(d)
        for clip, d in zip(self._clips, state.get("clips") or [None] * self.world_size):
            if clip is not None and d is not None:
                clip.load_state_dict(d)


def bucket_layout(n: int, bucket_index, numels, keys, shapes) -> tuple:
    """The bucket_state layout of a bucket of ``n`` elements given as SimulatedWorkers.reduce's
    arguments, checked."""
    if shapes is None:
        shapes = [(n,)] if numels is None else [(int(m),) for m in numels]
    elif numels is None:
        shapes = [tuple(int(d) for d in s) for s in shapes]
    else:
        raise ValueError("gradzip: give numels or shapes, not both")
    if sum(math.prod(s) for s in shapes) != n or any(d < 0 for s in shapes for d in s):
        raise ValueError(f"gradzip: tensors of shapes {shapes} do not partition the {n} elements")
    keys = [(bucket_index, i) for i in range(len(shapes))] if keys is None else list(keys)
    if len(keys) != len(shapes) or len(set(keys)) != len(keys):
        raise ValueError(f"gradzip: keys must name each of the {len(shapes)} tensors once")
    return (n, tuple(zip(keys, shapes)))
