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

Algorithms (DESIGN.md):

* ``two_phase`` (fp32, fp16, bf16, int8, sign): the bucket is split into W shards; every rank
  encodes each shard with its error feedback and prescale 1/W; all-to-all sends shard j to rank j;
  the owner decodes the W contributions in rank order, summing in fp32, re-encodes the sum with its
  second ("owner") residual; all-gather; every rank decodes every shard. The casts use it too,
  rather than a 16-bit all-reduce: it moves the same bytes as a ring all-reduce (2 (W-1)/W of the
  16-bit buffer per rank), but accumulates in fp32 in a fixed order, so the sum neither loses
  precision nor overflows as W grows, the result is bitwise reproducible and identical on all ranks
  on any backend, and the simulation matches it exactly.
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


@lru_cache(maxsize=1024)
def shard_layout(n: int, world: int, spec: str):
    """(shard starts, encoded bytes of each shard)."""
    starts = shard_bounds(n, world)
    sizes = [encoded_bytes(starts[j + 1] - starts[j], spec) for j in range(world)]
    return tuple(starts), tuple(sizes)


def traffic(plan: Optional[CodecPlan], n: int, world: int, rank: int):
    """Bytes (sent, received) by one rank for one bucket of n elements; plan None = fp32 all-reduce
    (counted as a ring all-reduce: 2 (W-1)/W of the buffer each way)."""
    if world == 1:
        return 0, 0
    if plan is None:
        b = 2 * (world - 1) * 4 * n // world
        return b, b
    if plan.two_phase:
        _, sizes = shard_layout(n, world, plan.spec)
        slot = aligned(max(sizes))
        sent = sum(aligned(s) for j, s in enumerate(sizes) if j != rank) + (world - 1) * slot
        received = (world - 1) * aligned(sizes[rank]) + (world - 1) * slot
        return sent, received
    e = aligned(encoded_bytes(n, plan.spec))
    return (world - 1) * e, (world - 1) * e


# ---- error-feedback state ---------------------------------------------------------------------------
class BucketEF:
    """Residuals of one bucket: ``residual`` (n, this rank's) and, for two-phase codecs,
    ``owner_residual`` (the shard this rank owns)."""

    __slots__ = ("layout", "residual", "owner_residual", "_backups")

    def __init__(self, layout, residual: torch.Tensor, owner_residual: Optional[torch.Tensor]):
        self.layout = layout
        self.residual = residual
        self.owner_residual = owner_residual
        self._backups = None

    def backups(self):
        """Persistent buffers shaped like the residuals, for NonfiniteGuard (allocated once: a
        fresh multi-MB CPU buffer per step would pay its page faults every step)."""
        if self._backups is None or self._backups[0].device != self.residual.device:
            self._backups = [torch.empty_like(self.residual),
                             None if self.owner_residual is None else torch.empty_like(self.owner_residual)]
        return self._backups


class EFStore:
    """Per-bucket residuals keyed by bucket index and checked against the bucket's layout (element
    count and parameter shapes): DDP rebuilds its buckets after the first iteration, so bucket i can
    change contents; on a mismatch the residuals restart from zero."""

    def __init__(self):
        self.buckets: dict = {}

    def get(self, index: int, layout, n: int, owner_n: Optional[int], device) -> BucketEF:
        ef = self.buckets.get(index)
        if ef is None or ef.layout != layout or ef.residual.numel() != n:
            owner = None if owner_n is None else torch.zeros(owner_n, dtype=torch.float32, device=device)
            ef = BucketEF(layout, torch.zeros(n, dtype=torch.float32, device=device), owner)
            self.buckets[index] = ef
        elif ef.residual.device != torch.device(device):  # loaded from a checkpoint elsewhere
            ef.residual = ef.residual.to(device)
            if ef.owner_residual is not None:
                ef.owner_residual = ef.owner_residual.to(device)
        if (owner_n is not None) != (ef.owner_residual is not None) or (
                owner_n is not None and ef.owner_residual.numel() != owner_n):
            raise ValueError(f"gradzip: bucket {index}: the stored owner residual does not fit this "
                             "codec/world size (checkpoint from another configuration?)")
        return ef

    def state_dict(self) -> dict:
        return {i: {"layout": ef.layout, "residual": ef.residual.detach().clone(),
                    "owner_residual": None if ef.owner_residual is None
                    else ef.owner_residual.detach().clone()}
                for i, ef in self.buckets.items()}

    def load_state_dict(self, d: dict) -> None:
        self.buckets = {
            int(i): BucketEF(tuple(_tuplify(v["layout"])), v["residual"].detach().clone(),
                             None if v["owner_residual"] is None else v["owner_residual"].detach().clone())
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


def reduce_bucket(plan: CodecPlan, world: int, rank: int, x: torch.Tensor, ef: Optional[BucketEF],
                  out: torch.Tensor, guard: Optional[NonfiniteGuard] = None) -> Algorithm:
    """The averaged bucket, written into ``out`` (which may be ``x``), as seen by ``rank``.
    ``x``: this rank's flat float32 gradient. ``ef``: its residuals, or None (no error feedback).
    ``guard``: makes the residual updates revocable for a non-finite step (see NonfiniteGuard)."""
    if guard is not None and ef is not None:
        guard.save([ef.residual, ef.owner_residual], ef.backups())
    if plan.two_phase:
        yield from _two_phase(plan.spec, world, rank, x, ef, out)
    else:
        yield from _all_gather(plan.spec, world, x, ef, out)
    if guard is not None:
        guard.flag(out)
    return out


def _two_phase(spec, world, rank, x, ef, out):
    n = x.numel()
    starts, sizes = shard_layout(n, world, spec)
    prescale = 1.0 / world
    slots = [aligned(s) for s in sizes]
    send = torch.zeros(sum(slots), dtype=torch.uint8, device=x.device)
    off = 0
    for j in range(world):
        lo, hi = starts[j], starts[j + 1]
        _encode(x[lo:hi], None if ef is None else ef.residual[lo:hi], send[off:off + sizes[j]],
                spec, prescale)
        off += slots[j]
    mine, my_slot = sizes[rank], slots[rank]
    recv = yield AllToAll(send, slots, [my_slot] * world)

    # Owner: sum the W contributions to my shard in rank order, in fp32, then re-encode the sum.
    acc = torch.zeros(starts[rank + 1] - starts[rank], dtype=torch.float32, device=x.device)
    for i in range(world):
        _ops.decode_add(recv[i * my_slot:i * my_slot + mine], acc)
    slot = aligned(max(sizes))
    reencoded = torch.empty(slot, dtype=torch.uint8, device=x.device)
    reencoded[mine:].zero_()  # padding of the fixed-size all-gather slot: never decoded
    _encode(acc, None if ef is None else ef.owner_residual, reencoded[:mine], spec, 1.0)
    gathered = yield AllGather(reencoded)

    for j in range(world):
        _ops.decode_into(gathered[j, :sizes[j]], out[starts[j]:starts[j + 1]])


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
