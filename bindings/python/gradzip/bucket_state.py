"""The error-feedback state of every bucket: residuals, optimizer moments and low-rank Q factors,
kept per bucket and described per parameter.

State is kept per bucket (flat tensors: the encoders read one contiguous residual) and described
per parameter: a bucket's layout lists its parameters' keys and shapes. When DDP rebuilds its buckets
(after the first iteration) or a checkpoint of another layout is loaded, a new bucket's state is
assembled parameter by parameter from the buckets that held those parameters before (see
StateStore.get), so residuals and moments survive a re-bucketing.
"""

from __future__ import annotations

import math
import zlib
from typing import List, Optional, Tuple

import torch

from . import _ops, wire

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

    __slots__ = ("layout", "residual", "owner_residual", "owner_start", "moments", "updates",
                 "exact_updates", "q", "q_rank")

    def __init__(self, layout, residual, owner_residual=None, owner_start: int = 0, moments=(),
                 updates: int = 0, q=None, q_rank: int = 0, exact_updates: Optional[int] = 0):
        self.layout = layout
        self.residual = residual
        self.owner_residual = owner_residual
        self.owner_start = int(owner_start)
        self.moments = list(moments)
        self.updates = updates  # steps the moments have seen (bias correction)
        # of those, the steps averaged exactly (a frozen-variance Adam's variance updates); None:
        # unknown (a checkpoint of an older gradzip)
        self.exact_updates = exact_updates
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

    def residuals(self) -> list:
        """The error-feedback residuals of every bucket (worker and owner)."""
        return [t for st in self.buckets.values()
                for t in (st.residual, st.owner_residual) if t is not None]

    def get(self, index: int, layout: Layout, residual: bool, owner: Optional[Tuple[int, int]],
            moments: int, device, q_rank: int = 0,
            residual_dtype: torch.dtype = torch.float32) -> BucketState:
        """``owner``: (start, size) of this rank's shard if it keeps an owner residual, else None.
        ``q_rank``: R of lowrank:R (the bucket keeps Q factors), else 0. ``residual_dtype``: the
        residuals' (float32, or bfloat16 compact); a stored residual of the other dtype (a
        checkpoint saved with the other setting) is converted."""
        n = layout[0]
        st = self.buckets.get(index)
        if st is None or st.layout != layout:
            st = self._assemble(layout, residual, owner, moments, device, q_rank, residual_dtype)
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
        if st.residual is not None and st.residual.dtype != residual_dtype:
            st.residual = st.residual.to(residual_dtype)
        if st.owner_residual is not None and st.owner_residual.dtype != residual_dtype:
            st.owner_residual = st.owner_residual.to(residual_dtype)
        return st

    def _assemble(self, layout, residual, owner, moments, device, q_rank,
                  residual_dtype=torch.float32) -> BucketState:
        n = layout[0]
        zeros = lambda m, dtype=torch.float32: torch.zeros(m, dtype=dtype, device=device)  # noqa: E731
        st = BucketState(layout, zeros(n, residual_dtype) if residual else None,
                         None if owner is None else zeros(owner[1], residual_dtype),
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
            st.exact_updates = (None if src.exact_updates is None or st.exact_updates is None
                                else max(st.exact_updates, src.exact_updates))
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
                st.moments, st.updates, st.exact_updates = [], 0, 0

    def drop_retired(self) -> None:
        """Forgets the replaced buckets' state (what no later bucket can claim)."""
        self._retired = []

    def _drop_claimed(self) -> None:
        live = {k for st in self.buckets.values() for k in st.offsets()}
        self._retired = [st for st in self._retired if not set(st.offsets()) <= live]

    def covering(self, layout: Layout) -> Optional[List[Tuple[int, Layout]]]:
        """The stored buckets that hold exactly this layout's parameters (see :func:`covering`)."""
        return covering({i: st.layout for i, st in self.buckets.items()}, layout)

    def state_dict(self) -> dict:
        clone = lambda t: None if t is None else t.detach().clone()  # noqa: E731
        return {i: {"layout": st.layout, "residual": clone(st.residual),
                    "owner_residual": clone(st.owner_residual), "owner_start": st.owner_start,
                    "moments": [clone(t) for t in st.moments], "updates": st.updates,
                    "exact_updates": st.exact_updates,
                    "q": clone(st.q), "q_rank": st.q_rank}
                for i, st in self.buckets.items()}

    def load_state_dict(self, d: dict) -> None:
        clone = lambda t: None if t is None else t.detach().clone()  # noqa: E731
        self._retired = []
        self.buckets = {
            int(i): BucketState(tuplify(v["layout"]), clone(v["residual"]),
                                clone(v.get("owner_residual")), int(v.get("owner_start", 0)),
                                [clone(t) for t in v.get("moments", [])], int(v.get("updates", 0)),
                                clone(v.get("q")), int(v.get("q_rank", 0)),
                                v.get("exact_updates"))
            for i, v in d.items()}


def covering(layouts: dict, layout: Layout) -> Optional[List[Tuple[int, Layout]]]:
    """(index, layout) of two or more of ``layouts`` (index -> layout, the buckets a state has
    reduced) whose parameters are exactly this layout's (in any order), or None: DDP's first
    iteration puts every parameter in one bucket; a run resumed from a checkpoint reduces it as
    the saved buckets, as the uninterrupted run did."""
    if layout in layouts.values():
        return None
    keys = {k for k, _ in layout[1]}
    found, seen = [], set()
    for i, saved in sorted(layouts.items()):
        ks = set(param_offsets(saved))
        if ks and ks <= keys:
            found.append((i, saved))
            seen |= ks
    if len(found) < 2 or seen != keys or sum(saved[0] for _, saved in found) != layout[0]:
        return None
    return found


def tuplify(x):
    return tuple(tuplify(v) for v in x) if isinstance(x, (list, tuple)) else x
