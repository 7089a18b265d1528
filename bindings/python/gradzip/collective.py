"""The per-codec reduction algorithms, written once, and the two ways of running them.

An algorithm is a generator run by one rank: it encodes, ``yield``s a collective request
(:class:`AllToAll` or :class:`AllGather`), receives the exchanged bytes back from ``yield`` and
decodes. Two drivers run it:

* :func:`drive_async` (the DDP hook): each request becomes an asynchronous ``torch.distributed``
  collective and the generator resumes in the collective's ``then`` callback;
* :func:`run_simulated` (``SimulatedWorkers``): W generators in one process in lockstep, the
  exchange done by slicing tensors.

Both run exactly the same arithmetic (the same op calls, in the same order, on the same bytes), so a
simulated reduction equals the multi-rank one bit for bit.

Algorithms:

* ``two_phase`` (fp32, fp16, bf16, int8, sign): the bucket is split into W shards; every rank
  encodes each shard with its error feedback and prescale 1/W; all-to-all sends shard j to rank j;
  the owner decodes the W contributions in rank order, summing in fp32, re-encodes the sum (with a
  residual of its own only for optimizer directions, see _two_phase); all-gather; every rank
  decodes every shard. The casts use it too,
  rather than a 16-bit all-reduce: it moves the same bytes as a ring all-reduce (2 (W-1)/W of the
  16-bit buffer per rank), but accumulates in fp32 in a fixed order, so the sum neither loses
  precision nor overflows as W grows, the result is bitwise reproducible and identical on all ranks
  on any backend, and the simulation matches it exactly.
* Pieces: for the block-scaled codecs (int8, sign) a shard is encoded as one message per tensor
  piece (the bucket cut at its tensor boundaries, see piece_cuts), so that no block mixes two
  tensors; the messages follow each other in 16-byte aligned slots.
* ``all_gather`` (topk): every rank encodes the whole bucket (prescale 1/W, error feedback); the
  fixed-size payloads are all-gathered; every rank decode-adds them in rank order into zeros.

Non-finite steps: with a :class:`NonfiniteGuard`, the residuals are copied before encoding and
restored (``torch.where`` on a device flag: no host synchronisation) when a reduced bucket of the
step holds a non-finite value. The flags come from the reduced results, which are identical on all
ranks, so every rank keeps or drops its residual updates together, as GradScaler (which looks at
every gradient after the reduction) keeps or skips the step.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Generator, List, NamedTuple, Optional

import torch

from . import _ops


# ---- codec plan -----------------------------------------------------------------------------------
TWO_PHASE_KINDS = ("fp32", "fp16", "bf16", "int8", "sign")


@dataclass(frozen=True)
class CodecPlan:
    """A parsed codec spec and the collective it uses."""

    spec: str  # canonical spec string
    kind: str  # fp32 | fp16 | bf16 | int8 | sign | topk

    @staticmethod
    def parse(spec: str) -> "CodecPlan":
        if not isinstance(spec, str):
            raise TypeError(f"gradzip: codec spec must be a str, got {type(spec).__name__}")
        canonical = _ops.canonical_spec(spec)
        return CodecPlan(canonical, canonical.split(":", 1)[0])

    @property
    def two_phase(self) -> bool:
        return self.kind in TWO_PHASE_KINDS


@lru_cache(maxsize=4096)
def encoded_bytes(n: int, spec: str) -> int:
    return _ops.encoded_bytes(n, spec)


def shard_bounds(n: int, world: int) -> List[int]:
    """Start offsets of the W shards plus n: sizes n // W + 1 for the first n % W shards."""
    base, extra = divmod(n, world)
    starts = [0]
    for j in range(world):
        starts.append(starts[-1] + base + (1 if j < extra else 0))
    return starts


def aligned(nbytes: int) -> int:
    """Slot size of a payload inside an exchanged buffer: every payload starts 16-byte aligned,
    as the CUDA decoders require (a bf16 or top-k payload can have any length)."""
    return (nbytes + 15) & ~15


# Codecs whose scales are per block: their blocks restart at every tensor boundary of a bucket (a
# block spanning a large-gradient and a small-gradient tensor gives the small one the large one's
# scale: its error, fed back, then dominates its residual). Element-wise casts gain nothing from it.
BLOCK_SCALED_KINDS = ("int8", "sign")
# A tensor piece shorter than this is merged into its neighbour: below it the 32-byte header of a
# message of its own costs more than a shared scale.
MIN_PIECE = 64


def piece_lengths(lo: int, hi: int, cuts: tuple) -> tuple:
    """Lengths of the pieces of [lo, hi) cut at the sorted offsets ``cuts`` (tensor boundaries),
    where no piece is shorter than MIN_PIECE (unless [lo, hi) is)."""
    lens, start = [], lo
    for c in cuts:
        if c - start >= MIN_PIECE and hi - c >= MIN_PIECE:
            lens.append(c - start)
            start = c
    lens.append(hi - start)
    return tuple(lens)


def message_bytes(lens: tuple, spec: str) -> int:
    """Bytes of a sequence of messages, one per piece, each in a 16-byte aligned slot."""
    return sum(aligned(encoded_bytes(m, spec)) for m in lens)


@lru_cache(maxsize=1024)
def shard_layout(n: int, world: int, spec: str, cuts: tuple = ()):
    """(shard starts, the piece lengths of each shard, the message bytes of each shard)."""
    starts = shard_bounds(n, world)
    pieces = tuple(piece_lengths(starts[j], starts[j + 1], cuts) for j in range(world))
    return tuple(starts), pieces, tuple(message_bytes(p, spec) for p in pieces)


def piece_cuts(plan: "CodecPlan", numels) -> tuple:
    """Interior tensor boundaries of a bucket holding tensors of ``numels`` elements, for codecs
    whose blocks restart there (empty for the others)."""
    if plan is None or plan.kind not in BLOCK_SCALED_KINDS or not numels:
        return ()
    cuts, off = [], 0
    for m in list(numels)[:-1]:
        off += int(m)
        cuts.append(off)
    return tuple(cuts)


def traffic(plan: Optional[CodecPlan], n: int, world: int, rank: int, cuts: tuple = ()):
    """Bytes (sent, received) by one rank for one bucket of n elements; plan None = fp32 all-reduce
    (counted as a ring all-reduce: 2 (W-1)/W of the buffer each way)."""
    if world == 1:
        return 0, 0
    if plan is None:
        b = 2 * (world - 1) * 4 * n // world
        return b, b
    if plan.two_phase:
        _, _, sizes = shard_layout(n, world, plan.spec, cuts)
        slot = max(sizes)
        sent = sum(s for j, s in enumerate(sizes) if j != rank) + (world - 1) * slot
        received = (world - 1) * sizes[rank] + (world - 1) * slot
        return sent, received
    e = aligned(encoded_bytes(n, plan.spec))
    return (world - 1) * e, (world - 1) * e


# ---- per-bucket state ------------------------------------------------------------------------------
class BucketState:
    """What one rank keeps for one bucket between steps: ``residual`` (n, error feedback; absent
    without it), ``owner_residual`` (the shard this rank owns in a two-phase collective, kept only
    where an optimizer direction is compressed, see _two_phase) and ``moments`` (the buffers of an
    optimizer direction computed on this rank, see gradzip.optim)."""

    __slots__ = ("layout", "residual", "owner_residual", "moments", "updates", "_backups")

    def __init__(self, layout, residual, owner_residual=None, moments=(), updates: int = 0):
        self.layout = layout
        self.residual = residual
        self.owner_residual = owner_residual
        self.moments = list(moments)
        self.updates = updates  # steps the moments have seen (bias correction)
        self._backups = None

    def tensors(self) -> list:
        return [self.residual, self.owner_residual, *self.moments]

    def backups(self):
        """Persistent buffers shaped like the state, for NonfiniteGuard (allocated once: a fresh
        multi-MB CPU buffer per step would pay its page faults every step)."""
        ts = self.tensors()
        if self._backups is None or len(self._backups) != len(ts) or any(
                t is not None and b.device != t.device for t, b in zip(ts, self._backups)):
            self._backups = [None if t is None else torch.empty_like(t) for t in ts]
        return self._backups

    def to(self, device) -> None:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        self.residual, self.owner_residual = move(self.residual), move(self.owner_residual)
        self.moments = [move(t) for t in self.moments]


class StateStore:
    """Per-bucket state keyed by bucket index and checked against the bucket's layout (element
    count and parameter shapes): DDP rebuilds its buckets after the first iteration, so bucket i can
    change contents; on a mismatch the state restarts from zero."""

    def __init__(self):
        self.buckets: dict = {}

    def get(self, index: int, layout, n: int, residual: bool, owner_n: Optional[int],
            moments: int, device) -> BucketState:
        """``owner_n``: the size of this rank's shard if it keeps an owner residual, else None."""
        st = self.buckets.get(index)
        if st is None or st.layout != layout:
            zeros = lambda m: torch.zeros(m, dtype=torch.float32, device=device)  # noqa: E731
            st = BucketState(layout, zeros(n) if residual else None,
                             None if owner_n is None else zeros(owner_n),
                             [zeros(n) for _ in range(moments)])
            self.buckets[index] = st
        elif any(t is not None and t.device != torch.device(device) for t in st.tensors()):
            st.to(device)  # loaded from a checkpoint elsewhere
        have_owner = None if st.owner_residual is None else st.owner_residual.numel()
        if ((st.residual is not None) != residual or have_owner != owner_n
                or len(st.moments) != moments
                or any(t.numel() != n for t in [st.residual, *st.moments] if t is not None)):
            raise ValueError(f"gradzip: bucket {index}: the stored state does not fit this "
                             "error-feedback/optimizer setting (checkpoint from another "
                             "configuration?)")
        return st

    def state_dict(self) -> dict:
        clone = lambda t: None if t is None else t.detach().clone()  # noqa: E731
        return {i: {"layout": st.layout, "residual": clone(st.residual),
                    "owner_residual": clone(st.owner_residual), "moments": [clone(t) for t in st.moments], "updates": st.updates}
                for i, st in self.buckets.items()}

    def load_state_dict(self, d: dict) -> None:
        clone = lambda t: None if t is None else t.detach().clone()  # noqa: E731
        self.buckets = {
            int(i): BucketState(tuple(_tuplify(v["layout"])), clone(v["residual"]),
                                clone(v.get("owner_residual")), [clone(t) for t in v.get("moments", [])], int(v.get("updates", 0)))
            for i, v in d.items()}


def _tuplify(x):
    return tuple(_tuplify(v) for v in x) if isinstance(x, (list, tuple)) else x


# ---- non-finite steps -------------------------------------------------------------------------------
class NonfiniteGuard:
    """Residual updates of one step, kept revocable: ``save`` copies residuals before they are
    updated, ``flag`` records whether a reduced bucket is finite, ``commit`` (once every bucket of the
    step has been reduced) restores all saved residuals if any bucket was not. Device-side only."""

    def __init__(self):
        self._saved = []
        self._flags = []

    def save(self, tensors, backups) -> None:
        for t, b in zip(tensors, backups):
            # a residual updated twice in one step keeps its backup of before the step
            if t is not None and not any(t is u for u, _ in self._saved):
                self._saved.append((t, b.copy_(t)))

    def flag(self, reduced: torch.Tensor) -> None:
        self._flags.append(torch.isfinite(reduced).all())  # list.append: atomic under the GIL

    def commit(self) -> None:
        saved, flags = self._saved, self._flags
        self._saved, self._flags = [], []
        if not saved or not flags:
            return
        ok = flags[0] if len(flags) == 1 else torch.stack([f.to(flags[0].device) for f in flags]).all()
        for t, old in saved:
            torch.where(ok.to(t.device), t, old, out=t)


# ---- collective requests -------------------------------------------------------------------------------
class AllToAll(NamedTuple):
    """Send ``send[offsets of send_splits[j]]`` to rank j; receive ``recv_splits[i]`` bytes from
    each rank i, concatenated in rank order (a flat uint8 tensor)."""

    send: torch.Tensor
    send_splits: List[int]
    recv_splits: List[int]


class AllGather(NamedTuple):
    """Every rank contributes a tensor of the same size; the result is (W, numel), rank order."""

    tensor: torch.Tensor


# ---- the algorithms --------------------------------------------------------------------------------
Algorithm = Generator[object, object, torch.Tensor]


def _encode(x, residual, out, spec, prescale):
    if residual is None:
        _ops.encode_into(x, out, spec, prescale)
    else:
        _ops.encode_with_feedback_into(x, residual, out, spec, prescale)


def _encode_pieces(x, residual, out, spec, prescale, lens):
    """Encodes consecutive pieces of ``x`` as consecutive messages in 16-byte aligned slots."""
    at = off = 0
    for m in lens:
        e = encoded_bytes(m, spec)
        _encode(x[at:at + m], None if residual is None else residual[at:at + m],
                out[off:off + e], spec, prescale)
        at += m
        off += aligned(e)


def _decode_pieces(payload, out, spec, lens, add: bool):
    at = off = 0
    for m in lens:
        e = encoded_bytes(m, spec)
        (_ops.decode_add if add else _ops.decode_into)(payload[off:off + e], out[at:at + m])
        at += m
        off += aligned(e)


def reduce_bucket(plan: CodecPlan, world: int, rank: int, x: torch.Tensor, ef: Optional["BucketState"],
                  out: torch.Tensor, guard: Optional[NonfiniteGuard] = None,
                  cuts: tuple = ()) -> Algorithm:
    """The averaged bucket, written into ``out`` (which may be ``x``), as seen by ``rank``.
    ``x``: this rank's flat float32 gradient (or optimizer direction). ``ef``: its residuals, or
    None (no error feedback). ``guard``: makes the state updates revocable for a non-finite step
    (see NonfiniteGuard). ``cuts``: the bucket's tensor boundaries (see piece_cuts)."""
    if guard is not None and ef is not None:
        guard.save(ef.tensors(), ef.backups())
    if plan.two_phase:
        yield from _two_phase(plan.spec, world, rank, x, ef, out, cuts)
    else:
        yield from _all_gather(plan.spec, world, x, ef, out)
    if guard is not None:
        guard.flag(out)
    return out


def _two_phase(spec, world, rank, x, ef, out, cuts):
    n = x.numel()
    residual = None if ef is None else ef.residual
    starts, pieces, sizes = shard_layout(n, world, spec, cuts)
    prescale = 1.0 / world
    send = torch.zeros(sum(sizes), dtype=torch.uint8, device=x.device)
    off = 0
    for j in range(world):
        lo, hi = starts[j], starts[j + 1]
        _encode_pieces(x[lo:hi], None if residual is None else residual[lo:hi],
                       send[off:off + sizes[j]], spec, prescale, pieces[j])
        off += sizes[j]
    mine = sizes[rank]
    recv = yield AllToAll(send, list(sizes), [mine] * world)

    # Owner: sum the W contributions to my shard in rank order, in fp32, then re-encode the sum.
    acc = torch.zeros(starts[rank + 1] - starts[rank], dtype=torch.float32, device=x.device)
    for i in range(world):
        _decode_pieces(recv[i * mine:(i + 1) * mine], acc, spec, pieces[rank], add=True)
    # The owner's own residual exists only where an optimizer direction is compressed (smooth from
    # step to step, as the momentum 1-bit Adam compresses): there it helps. On raw gradients,
    # feeding back the error of re-quantising a sum of quantised messages compounds the two
    # errors: under SGD with momentum the worker residual of sign grew to 30x the gradient
    # (tests/python/test_error_feedback.py). Zeros: the padding between messages and of the
    # fixed-size all-gather slot is never decoded.
    reencoded = torch.zeros(max(sizes), dtype=torch.uint8, device=x.device)
    _encode_pieces(acc, None if ef is None else ef.owner_residual, reencoded, spec, 1.0,
                   pieces[rank])
    gathered = yield AllGather(reencoded)

    for j in range(world):
        _decode_pieces(gathered[j], out[starts[j]:starts[j + 1]], spec, pieces[j], add=False)


def _all_gather(spec, world, x, ef, out):
    e = encoded_bytes(x.numel(), spec)
    payload = torch.zeros(aligned(e), dtype=torch.uint8, device=x.device)
    _encode(x, None if ef is None else ef.residual, payload[:e], spec, 1.0 / world)
    gathered = yield AllGather(payload)
    out.zero_()
    for j in range(world):
        _ops.decode_add(gathered[j, :e], out)


# ---- driver 1: W simulated ranks in one process --------------------------------------------------------
def run_simulated(algorithms: List[Algorithm]) -> None:
    """Runs one algorithm per rank in lockstep, performing each exchange in memory."""
    world = len(algorithms)
    values: List[object] = [None] * world
    while True:
        requests = []
        for r, alg in enumerate(algorithms):
            try:
                requests.append(alg.send(values[r]))
            except StopIteration:
                requests.append(None)
        if all(q is None for q in requests):
            return
        if any(q is None for q in requests) or len({type(q) for q in requests}) != 1:
            raise RuntimeError("gradzip: simulated ranks issued different collectives")
        if isinstance(requests[0], AllToAll):
            offsets = []
            for q in requests:
                o, acc = [], 0
                for s in q.send_splits:
                    o.append(acc)
                    acc += s
                offsets.append(o)
            values = [torch.cat([requests[i].send[offsets[i][r]:offsets[i][r] + requests[i].send_splits[r]]
                                 for i in range(world)]) for r in range(world)]
        else:
            stacked = torch.stack([q.tensor for q in requests])
            values = [stacked] * world


# ---- driver 2: torch.distributed, asynchronous ----------------------------------------------------------
class Sequencer:
    """Launches callback-issued collectives in a fixed order on every rank.

    A bucket's second collective is launched from the first one's completion callback. With Gloo
    those complete on worker threads in any order, so launching directly would let ranks enqueue
    the second collectives of different buckets in different orders (a hang or crossed data). Each
    bucket takes a ticket when its hook runs (DDP calls hooks in bucket order, on every rank); a
    callback submits its launch under that ticket, and launches happen in ticket order."""

    def __init__(self):
        self._lock = threading.RLock()  # re-entrant: a launch may complete and call back inline
        self._next_ticket = 0
        self._next_launch = 0
        self._pending: dict = {}

    def reserve(self) -> int:
        with self._lock:
            t = self._next_ticket
            self._next_ticket += 1
            return t

    def submit(self, ticket: int, launch: Callable[[], None]) -> None:
        with self._lock:
            self._pending[ticket] = launch
            while self._next_launch in self._pending:
                fn = self._pending.pop(self._next_launch)
                self._next_launch += 1
                fn()


class DistExchange:
    """Runs requests as torch.distributed collectives: the first request of a bucket on ``group``
    right away (the hook's thread), later ones on ``group2`` in ticket order (see Sequencer)."""

    def __init__(self, group, group2, sequencer: Sequencer):
        self.group = group
        self.group2 = group2
        self.sequencer = sequencer

    def launch(self, request, group) -> torch.futures.Future:
        import torch.distributed as dist

        if isinstance(request, AllToAll):
            out = torch.empty(sum(request.recv_splits), dtype=torch.uint8, device=request.send.device)
            work = dist.all_to_all_single(out, request.send, request.recv_splits, request.send_splits,
                                          group=group, async_op=True)
        elif isinstance(request, AllGather):
            world = dist.get_world_size(group)
            out = torch.empty((world, request.tensor.numel()), dtype=request.tensor.dtype,
                              device=request.tensor.device)
            work = dist.all_gather(list(out.unbind(0)), request.tensor, group=group, async_op=True)
        else:
            raise TypeError(f"gradzip: unknown collective request {request!r}")

        def unwrap(fut):
            fut.value()  # raises if the collective failed
            return out

        return work.get_future().then(unwrap)


def drive_async(algorithm: Algorithm, exchange: DistExchange, result: torch.futures.Future,
                ticket: Optional[int]) -> None:
    """Runs one algorithm over torch.distributed; sets ``result`` to its return value (or to the
    exception). ``ticket``: the Sequencer ticket for its second collective (None if it has none)."""
    state = {"calls": 0, "ticket_used": False}

    def fail(exc):
        # Release the ticket so that later buckets are not blocked behind a failed one.
        if ticket is not None and not state["ticket_used"]:
            state["ticket_used"] = True
            exchange.sequencer.submit(ticket, lambda: None)
        if not result.done():
            result.set_exception(exc)

    def advance(value):
        try:
            request = algorithm.send(value)
        except StopIteration as stop:
            if ticket is not None and not state["ticket_used"]:
                state["ticket_used"] = True
                exchange.sequencer.submit(ticket, lambda: None)
            result.set_result(stop.value)
            return
        except BaseException as exc:  # noqa: BLE001 - handed to the future's waiter
            fail(exc)
            return
        first = state["calls"] == 0
        state["calls"] += 1

        def launch(group):
            try:
                fut = exchange.launch(request, group)
            except BaseException as exc:  # noqa: BLE001
                fail(exc)
                return

            def resume(f):
                try:
                    v = f.value()
                except BaseException as exc:  # noqa: BLE001
                    fail(exc)
                    return
                advance(v)

            fut.then(resume)

        if first:
            launch(exchange.group)
        elif ticket is not None and not state["ticket_used"]:
            state["ticket_used"] = True
            exchange.sequencer.submit(ticket, lambda: launch(exchange.group2))
        else:
            fail(RuntimeError("gradzip: an algorithm issued more collectives than planned"))

    advance(None)
