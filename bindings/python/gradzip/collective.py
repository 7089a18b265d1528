"""What Python keeps of the compressed average: the codec plan, the state of every bucket and the
in-memory exchange of the simulation.

The algorithms are C++, written once (bindings/torch/bucket_reduction.hpp: the phases, the shard
and piece layout, the wire slots; compressed_allreduce.hpp: the driver over a c10d ProcessGroup,
used by the DDP hook and by C++ callers). :func:`run_simulated` drives the same C++ phases for W
ranks in one process, doing the exchanges by copying bytes, so that ``SimulatedWorkers`` equals the
multi-rank hook bit for bit (except for the sum that the backend does in the casts' one all-reduce,
see run_simulated).

State is kept per bucket (flat tensors: the encoders read one contiguous residual) and described
per parameter: a bucket's layout lists its parameters' keys and shapes. When DDP rebuilds its buckets
(after the first iteration) or a checkpoint of another layout is loaded, a new bucket's state is
assembled parameter by parameter from the buckets that held those parameters before (see
StateStore.get), so residuals and moments survive a re-bucketing.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from functools import lru_cache
from typing import List, Optional, Sequence, Tuple

import torch

from . import _ops, wire


# ---- codec plan -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class CodecPlan:
    """A parsed codec spec and the collective its all-reduce uses."""

    spec: str  # canonical spec string
    kind: str  # fp32 | fp16 | bf16 | int8 | sign | topk | lowrank
    cast_sum: str = "wire"  # wire | fp32 (see wire.sums_on_wire)

    @staticmethod
    def parse(spec: str, cast_sum: str = "wire") -> "CodecPlan":
        if not isinstance(spec, str):
            raise TypeError(f"gradzip: codec spec must be a str, got {type(spec).__name__}")
        rank = _ops.lowrank_rank_of(spec)  # a ValueError naming the bad part of a lowrank spec
        canonical = f"lowrank:{rank}" if rank else _ops.canonical_spec(spec)
        return CodecPlan(canonical, canonical.split(":", 1)[0], cast_sum)

    def __post_init__(self):
        wire.sums_on_wire(self.kind, self.cast_sum)  # a ValueError for an unknown cast_sum

    @property
    def wire_sum(self) -> bool:
        """One all-reduce (SUM) of the payload in the wire dtype: fp32/fp16/bf16 with cast_sum
        "wire"."""
        return wire.sums_on_wire(self.kind, self.cast_sum)

    @property
    def two_phase(self) -> bool:
        """All-to-all + all-gather with an fp32 sum (int8, sign, and the casts with cast_sum
        "fp32"; top-k all-gathers)."""
        return self.kind not in ("topk", "lowrank") and not self.wire_sum

    @property
    def lowrank_rank(self) -> int:
        """R of lowrank:R (two all-reduces of low-rank factors, see lowrank_reduction.hpp); 0 for
        the other codecs."""
        return int(self.spec.split(":", 1)[1]) if self.kind == "lowrank" else 0


@lru_cache(maxsize=1024)
def shard_bounds(n: int, world: int) -> Tuple[int, ...]:
    """Start offsets of the W shards of a two-phase bucket, plus n."""
    return tuple(_ops.shard_starts(n, world))


@lru_cache(maxsize=4096)
def traffic(plan: Optional[CodecPlan], numels: Tuple[int, ...], world: int, rank: int,
            rows: Optional[Tuple[int, ...]] = None, exact: Tuple[bool, ...] = ()):
    """Bytes (sent, received) by one rank for one bucket holding tensors of ``numels`` elements
    (``rows``: their first dimensions, for lowrank), those flagged in ``exact`` sent in fp32 (see
    layout_exact); plan None = fp32 all-reduce (counted as a ring all-reduce: 2 (W-1)/W of the
    buffer each way)."""
    if world == 1:
        return 0, 0
    if plan is None:
        b = _ops.fp32_traffic(sum(numels), world)
        return b, b
    if plan.kind == "lowrank":  # two fp32 ring all-reduces: P with the uncompressed tensors, Q
        p, q = _ops.lowrank_sizes(plan.lowrank_rank, list(numels), list(rows or numels))
        b = _ops.fp32_traffic(p, world) + _ops.fp32_traffic(q, world)
        return b, b
    sent, received = _ops.bucket_traffic(plan.spec, world, rank, list(numels), plan.cast_sum,
                                         list(exact))
    return sent, received


class TrafficStats:
    """Bytes sent/received by this rank in the last completed step, and the compression ratio
    against the uncompressed collective of the same tensors (for the all-reduce: an fp32 ring
    all-reduce)."""

    def __init__(self):
        self.last = {"step": -1, "bytes_sent": 0, "bytes_received": 0, "raw_bytes": 0,
                     "compression_ratio": 1.0, "buckets": 0, "compressed_buckets": 0}
        self._acc = self._zero()

    @staticmethod
    def _zero():
        return {"bytes_sent": 0, "bytes_received": 0, "raw_bytes": 0, "buckets": 0,
                "compressed_buckets": 0}

    def add(self, plan, numels, world, rank, rows=None, exact=()):
        """One all-reduced bucket, carried by ``plan`` (None: the fp32 all-reduce; ``rows``,
        ``exact``: see traffic)."""
        numels = tuple(numels)
        rows = None if rows is None else tuple(rows)
        sent, received = traffic(plan, numels, world, rank, rows, tuple(exact))
        self.add_bytes(sent, received, traffic(None, numels, world, rank)[0], plan is not None)

    def add_bytes(self, sent: int, received: int, raw: int, compressed: bool):
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


# ---- per-bucket state ------------------------------------------------------------------------------
Layout = Tuple[int, Tuple[Tuple[object, Tuple[int, ...]], ...]]  # (n, ((key, shape), ...))


def _layout_shapes(layout: Layout) -> Optional[List[Tuple[int, ...]]]:
    """The shapes of a bucket's tensors as the reduction sees them, in buffer order, or None if
    they are unknown. Zero-size tensors are left out: they carry nothing, and a piece boundary
    there would change nothing but the C++ layout's rule that pieces hold elements."""
    n, params = layout
    shapes = [tuple(shape) for _, shape in params if math.prod(shape) > 0]
    return shapes if shapes and sum(math.prod(s) for s in shapes) == n else None


def layout_numels(layout: Layout) -> List[int]:
    """Element counts of a bucket's tensors as the reduction sees them (one tensor if the shapes
    are unknown)."""
    shapes = _layout_shapes(layout)
    return [layout[0]] if shapes is None else [math.prod(s) for s in shapes]


def layout_exact(layout: Layout, uncompressed_numel: int) -> List[bool]:
    """Per tensor of layout_numels, whether it travels uncompressed (wire.travels_uncompressed;
    never where the shapes are unknown)."""
    shapes = _layout_shapes(layout)
    if shapes is None:
        return [False]
    return [wire.travels_uncompressed(s, uncompressed_numel) for s in shapes]


def layout_rows(layout: Layout) -> List[int]:
    """The first dimension of each tensor layout_numels lists (a 1-D tensor's numel, as for
    unknown shapes): lowrank views a tensor as a (rows, numel / rows) matrix."""
    n, params = layout
    if not params or sum(math.prod(s) for _, s in params) != n:
        return [n]
    rows = [shape[0] if len(shape) >= 2 else math.prod(shape) for _, shape in params
            if math.prod(shape) > 0]
    return rows or [n]


def q_offsets(layout: Layout, rank: int) -> dict:
    """key -> (offset, numel, cols) of each parameter's Q factor (cols x r) in its bucket's flat Q,
    for lowrank:``rank``; parameters sent uncompressed have none."""
    out, off = {}, 0
    for key, (_, m, shape) in param_offsets(layout).items():
        rows = shape[0] if len(shape) >= 2 else m
        q = _ops.lowrank_sizes(rank, [m], [rows])[1] if m else 0
        if q:
            out[key] = (off, q, m // rows)
            off += q
    return out


def initial_q(key, cols: int, rank: int) -> torch.Tensor:
    """The first Q of a parameter (before the warm start takes over): Gaussian, from a seed that
    depends on the parameter's key only, so that every rank draws the same without a broadcast."""
    g = torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))
    return torch.randn(cols, rank, generator=g).reshape(-1)


def initial_qs(layout: Layout, rank: int, device) -> torch.Tensor:
    """A bucket's first flat Q for lowrank:``rank``: each parameter's initial_q at its q_offsets."""
    qs = q_offsets(layout, rank)
    q = torch.zeros(sum(m for _, m, _ in qs.values()), dtype=torch.float32, device=device)
    for key, (off, m, cols) in qs.items():
        q[off:off + m].copy_(initial_q(key, cols, m // cols))
    return q


def param_offsets(layout: Layout) -> dict:
    """key -> (offset in the bucket, numel, shape) for the parameters a layout describes (empty
    if its shapes do not add up to the bucket, i.e. are unknown)."""
    out, off = {}, 0
    n, params = layout
    if sum(math.prod(s) for _, s in params) != n:
        return {}
    for key, shape in params:
        out[key] = (off, math.prod(shape), tuple(shape))
        off += math.prod(shape)
    return out


class BucketState:
    """What one rank keeps for one bucket between steps: ``residual`` (n, error feedback; absent
    without it), ``owner_residual`` (the shard this rank owns in a two-phase collective, kept only
    where an optimizer direction is compressed; ``owner_start`` is its offset in the bucket) and
    ``moments`` (the buffers of an optimizer direction computed on this rank, see gradzip.optim);
    ``q``: lowrank:``q_rank``'s Q factors of the bucket's parameters (see q_offsets), the warm start
    of the next step, identical on every rank."""

    __slots__ = ("layout", "residual", "owner_residual", "owner_start", "moments", "updates", "q",
                 "q_rank")

    def __init__(self, layout, residual, owner_residual=None, owner_start: int = 0, moments=(),
                 updates: int = 0, q=None, q_rank: int = 0):
        self.layout = layout
        self.residual = residual
        self.owner_residual = owner_residual
        self.owner_start = int(owner_start)
        self.moments = list(moments)
        self.updates = updates  # steps the moments have seen (bias correction)
        self.q, self.q_rank = q, int(q_rank)

    def tensors(self) -> list:
        return [self.residual, self.owner_residual, *self.moments, self.q]

    def to(self, device) -> None:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        self.residual, self.owner_residual = move(self.residual), move(self.owner_residual)
        self.moments = [move(t) for t in self.moments]
        self.q = move(self.q)

    def offsets(self) -> dict:
        return param_offsets(self.layout)

    def q_offsets(self) -> dict:
        return q_offsets(self.layout, self.q_rank) if self.q_rank else {}


class StateStore:
    """Per-bucket state keyed by bucket index, checked against the bucket's layout (its parameters'
    keys and shapes). A bucket whose layout changed (DDP's rebuild after the first iteration, or a
    checkpoint of another layout) gets its state assembled from the buckets that held the same
    parameters; parameters seen nowhere start from zero, as does the part of an owner residual whose
    elements this rank did not own before (it lives on another rank)."""

    def __init__(self):
        self.buckets: dict = {}
        self._retired: list = []  # replaced buckets whose parameters may still move elsewhere

    def get(self, index: int, layout: Layout, residual: bool, owner: Optional[Tuple[int, int]],
            moments: int, device, q_rank: int = 0) -> BucketState:
        """``owner``: (start, size) of this rank's shard if it keeps an owner residual, else None.
        ``q_rank``: R of lowrank:R (the bucket keeps Q factors), else 0."""
        n = layout[0]
        st = self.buckets.get(index)
        if st is None or st.layout != layout:
            st = self._assemble(layout, residual, owner, moments, device, q_rank)
            old = self.buckets.pop(index, None)
            if old is not None:
                self._retired.append(old)
            # Other buckets that held these parameters now hold stale copies of their state.
            keys = set(st.offsets())
            for i in [i for i, b in self.buckets.items() if keys & set(b.offsets())]:
                self._retired.append(self.buckets.pop(i))
            self.buckets[index] = st
            self._drop_claimed()
        elif any(t is not None and t.device != torch.device(device) for t in st.tensors()):
            st.to(device)  # loaded from a checkpoint elsewhere
        have_owner = None if st.owner_residual is None else (st.owner_start, st.owner_residual.numel())
        if ((st.residual is not None) != residual or have_owner != (None if owner is None else tuple(owner))
                or len(st.moments) != moments or st.q_rank != q_rank
                or any(t.numel() != n for t in [st.residual, *st.moments] if t is not None)):
            raise ValueError(f"gradzip: bucket {index}: the stored state does not fit this "
                             "error-feedback/optimizer setting (checkpoint from another "
                             "configuration?)")
        return st

    def _assemble(self, layout, residual, owner, moments, device, q_rank) -> BucketState:
        n = layout[0]
        zeros = lambda m: torch.zeros(m, dtype=torch.float32, device=device)  # noqa: E731
        st = BucketState(layout, zeros(n) if residual else None,
                         None if owner is None else zeros(owner[1]),
                         0 if owner is None else owner[0], [zeros(n) for _ in range(moments)],
                         q_rank=q_rank)
        if q_rank:
            st.q = initial_qs(layout, q_rank, device)
        sources = list(self.buckets.values()) + self._retired[::-1]  # live, then newest retired
        where = {}
        for src in sources:
            for key, (off, m, shape) in src.offsets().items():
                where.setdefault(key, (src, off, m, shape))
        for key, (off, m, shape) in st.offsets().items():
            found = where.get(key)
            if found is None or found[3] != shape:
                continue
            src, soff = found[0], found[1]
            st.updates = max(st.updates, src.updates)
            for dst_t, src_t in [(st.residual, src.residual)] + list(zip(st.moments, src.moments)):
                if dst_t is not None and src_t is not None:
                    dst_t[off:off + m].copy_(src_t[soff:soff + m])
            if st.owner_residual is not None and src.owner_residual is not None:
                # element e of the parameter: in the new shard at off + e - owner_start, in the old
                # one at soff + e - src.owner_start; copy where both lie inside their shards.
                lo = max(0, st.owner_start - off, src.owner_start - soff)
                hi = min(m, st.owner_start + st.owner_residual.numel() - off,
                         src.owner_start + src.owner_residual.numel() - soff)
                if hi > lo:
                    st.owner_residual[off + lo - st.owner_start:off + hi - st.owner_start].copy_(
                        src.owner_residual[soff + lo - src.owner_start:soff + hi - src.owner_start])
            if st.q is not None and src.q_rank == st.q_rank and key in st.q_offsets():
                (qoff, qm, _), (sqoff, _, _) = st.q_offsets()[key], src.q_offsets()[key]
                st.q[qoff:qoff + qm].copy_(src.q[sqoff:sqoff + qm])
        return st

    def drop_rank_state(self, keep_moments: bool) -> None:
        """Forgets what is each rank's own, meaningless at another world size: the residuals, and
        the moments unless ``keep_moments`` (those computed from the average alone); Q factors,
        the same on every rank, stay. Every bucket's state is then assembled afresh, parameter by
        parameter, at its next use, with zero residuals."""
        for st in self.buckets.values():
            self._retired.append(st)
        self.buckets = {}
        for st in self._retired:
            st.residual = st.owner_residual = None
            if not keep_moments:
                st.moments, st.updates = [], 0

    def _drop_claimed(self) -> None:
        live = {k for st in self.buckets.values() for k in st.offsets()}
        self._retired = [st for st in self._retired if not set(st.offsets()) <= live]

    def covering(self, layout: Layout) -> Optional[List[int]]:
        """Indices of two or more stored buckets whose parameters are exactly this layout's (in
        any order), or None: DDP's first iteration puts every parameter in one bucket; a run resumed
        from a checkpoint reduces it as the saved buckets, as the uninterrupted run did."""
        if layout in [st.layout for st in self.buckets.values()]:
            return None
        keys = {k for k, _ in layout[1]}
        found, seen = [], set()
        for i, st in sorted(self.buckets.items()):
            ks = set(st.offsets())
            if ks and ks <= keys:
                found.append(i)
                seen |= ks
        if len(found) < 2 or seen != keys or sum(self.buckets[i].layout[0] for i in found) != layout[0]:
            return None
        return found

    def state_dict(self) -> dict:
        clone = lambda t: None if t is None else t.detach().clone()  # noqa: E731
        return {i: {"layout": st.layout, "residual": clone(st.residual),
                    "owner_residual": clone(st.owner_residual), "owner_start": st.owner_start,
                    "moments": [clone(t) for t in st.moments], "updates": st.updates,
                    "q": clone(st.q), "q_rank": st.q_rank}
                for i, st in self.buckets.items()}

    def load_state_dict(self, d: dict) -> None:
        clone = lambda t: None if t is None else t.detach().clone()  # noqa: E731
        self._retired = []
        self.buckets = {
            int(i): BucketState(_tuplify(v["layout"]), clone(v["residual"]),
                                clone(v.get("owner_residual")), int(v.get("owner_start", 0)),
                                [clone(t) for t in v.get("moments", [])], int(v.get("updates", 0)),
                                clone(v.get("q")), int(v.get("q_rank", 0)))
            for i, v in d.items()}


def _tuplify(x):
    return tuple(_tuplify(v) for v in x) if isinstance(x, (list, tuple)) else x


# ---- the simulation's exchange ---------------------------------------------------------------------
def run_simulated(reductions: Sequence, xs: Sequence[torch.Tensor], states: Sequence,
                  outs: Sequence[torch.Tensor]) -> None:
    """Runs one C++ BucketReduction per rank through its phases, doing each collective in memory:
    the all-to-all sends rank i's shard j to rank j, the all-gather concatenates in rank order.

    The casts' one all-reduce (wire_sum) is simulated as the fp32 sum of the W payloads in rank
    order, rounded once to the wire dtype. The backends sum in the wire dtype in an order of their
    own (Gloo and NCCL differ, and so do the elements of one bucket), so there the simulation
    equals the hook only to the wire dtype's rounding of a W-term sum; the residuals, which each
    rank forms from its own payload, are equal bit for bit."""
    world = len(reductions)
    for red, x, st in zip(reductions, xs, states):
        red.encode(x, None if st is None else st.residual)
    if reductions[0].wire_sum():
        total = torch.zeros_like(reductions[0].payload(), dtype=torch.float32)
        for red in reductions:
            total += red.payload()
        for red, out in zip(reductions, outs):
            red.payload().copy_(total)
            red.decode(out)
        return
    if reductions[0].two_phase():
        # per rank: its send buffer cut into the bytes for each destination
        sent = [red.send().split(red.send_splits()) for red in reductions]
        for r, red in enumerate(reductions):
            red.recv().copy_(torch.cat([sent[i][r] for i in range(world)]))
        for red, st in zip(reductions, states):
            red.reduce_owner(None if st is None else st.owner_residual)
    gathered = torch.cat([red.gather_in() for red in reductions])
    for red, out in zip(reductions, outs):
        red.gathered().copy_(gathered)
        red.decode(out)


def run_simulated_lowrank(reductions: Sequence, xs: Sequence[torch.Tensor], states: Sequence) -> None:
    """Runs one C++ LowRankReduction per rank through its phases, each all-reduce done as the sum
    of the W buffers in rank order: at W = 2 what every backend computes (a + b commutes), above it
    equal to fp32 rounding (the backend's summation order is its own). ``xs`` are overwritten with
    the average."""
    for red, x, st in zip(reductions, xs, states):
        red.compute_p(x, st.residual, st.q)
    _sum_in_place([red.p() for red in reductions])
    for red, x, st in zip(reductions, xs, states):
        red.compute_q(x, st.q)
    _sum_in_place([st.q for st in states])
    for red, x, st in zip(reductions, xs, states):
        red.finish(x, st.residual, st.q)


def _sum_in_place(buffers: Sequence[torch.Tensor]) -> None:
    total = torch.zeros_like(buffers[0])
    for b in buffers:
        total += b
    for b in buffers:
        b.copy_(total)
