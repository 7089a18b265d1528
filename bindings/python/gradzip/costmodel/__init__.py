"""An alpha-beta cost model of gradient communication, per DDP bucket, for every hook.

Each collective is modelled as ring/pairwise steps of `alpha + bytes / beta` (alpha: per-message
latency, beta: goodput of one link direction, links full duplex):

  ring all-reduce of S bytes      2 (p-1) alpha + 2 (p-1)/p * S / beta
  ring all-gather, s bytes each     (p-1) alpha +   (p-1)   * s / beta
  pairwise all-to-all, s per peer   (p-1) alpha +   (p-1)   * s / beta
  two-phase (int8, sign; the      all-to-all of encoded shards, then all-gather of the re-encoded
  casts and top-k with            shard: ~2 E(n) bytes whatever p is
  cast_sum="fp32")

plus the codec's own compute (fused error-feedback encode, decode-add), from measured throughput
(`measure_codec_speed`, through gradzip's ops) or from a memory-bandwidth parameter and the bytes
each pass must move. Buckets are communicated one after the other; the model gives the time a step
spends communicating if nothing overlaps with the backward pass (an upper bound on the step's
overhead) and the bytes each rank sends.

The collective each hook uses is gradzip.plan's (both take it, and the spec grammar, from
gradzip.wire): gradzip's fp16 and bf16 (cast_sum "wire", the hook's default) as one 16-bit ring
all-reduce of the payload, as PyTorch's 16-bit hooks (the header is not sent), and fp32 as DDP's
fp32 all-reduce; two-phase for int8, sign, and the casts and top-k with cast_sum "fp32" (fp32
accumulation, plus a header per shard; top-k: each shard's k pairs, whatever p); all-gather of
fixed-size payloads for top-k with cast_sum "wire" (p - 1 of them received); and buckets under
`min_compress_numel` elements as a plain fp32 all-reduce. PyTorch's hooks: `none` is DDP's fp32 ring all-reduce,
`torch-fp16`/`torch-bf16` a 16-bit all-reduce, PowerSGD three all-reduces per bucket
(uncompressed tensors, P, Q); gradzip's lowrank:R two (P with the uncompressed tensors, Q), per
DDP bucket and per FSDP2 parameter group alike (gradzip.fsdp reduces a group's unsharded gradient
as the DDP hook reduces a bucket of the same tensors: `bucket_cost` of the group's shapes).

`python -m gradzip.costmodel` (costmodel/__main__.py) prints the projection table of
gradzip/costmodel_cli.py, which imports this module and not the other way round.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Iterable, Sequence

from gradzip import wire

# --- codecs: names and wire sizes -----------------------------------------------------------------

# Hook names the benchmark uses that are not gradzip codec specs: PyTorch's all-reduce hooks.
TORCH_HOOKS = {"none": "fp32", "allreduce": "fp32", "torch-fp16": "fp16", "torch-bf16": "bf16"}


@dataclass(frozen=True)
class Codec:
    """A parsed codec or hook name: gradzip's fp32 | fp16 | bf16 | int8[:block=N] | sign[:block=N]
    | topk:RATIO[:values=fp16|int8] | lowrank:RANK, or PyTorch's none | torch-fp16 | torch-bf16 |
    powersgd[:RANK].
    collective: allreduce (PyTorch's hooks) | cast_allreduce | two_phase | allgather | powersgd |
    lowrank.
    cast_sum: gradzip's fp32/fp16/bf16 and top-k as ``CompressionState(cast_sum=...)`` ("wire":
    cast_allreduce, one all-reduce of the payload in the wire dtype, or top-k's allgather; "fp32":
    two_phase). uncompressed_numel: as
    ``CompressionState(uncompressed_numel=...)``, the tensors int8/sign send in fp32."""

    kind: str
    collective: str = "two_phase"
    block: int = 0
    ratio: float = 0.0
    values: str = "fp32"  # topk
    rank: int = 0  # powersgd, lowrank
    uncompressed_numel: int = 0

    @staticmethod
    def parse(name: str, cast_sum: str = "wire", uncompressed_numel: int = 0) -> "Codec":
        """``name``: a hook name or codec spec; ``SPEC@fp32`` is that codec with cast_sum "fp32"
        (e.g. ``topk:0.02@fp32``, top-k's two-phase exchange)."""
        name, given = split_cast_sum(name)
        codec = Codec._parse(name, given or cast_sum)
        return replace(codec, uncompressed_numel=uncompressed_numel) if uncompressed_numel else codec

    @staticmethod
    def _parse(name: str, cast_sum: str) -> "Codec":
        if name in TORCH_HOOKS:
            return Codec(TORCH_HOOKS[name], collective="allreduce")
        head, *opts = name.split(":")
        if head == "powersgd":
            rank = _int(opts[0], name) if opts else 1
            if rank < 1 or len(opts) > 1:
                raise ValueError(f"codec {name!r}: expected powersgd[:RANK] with RANK >= 1")
            return Codec("powersgd", "powersgd", rank=rank)
        s = wire.parse_spec(name)  # gradzip's own codecs: the extension's grammar
        return Codec(s.kind, wire.allreduce_collective(s.kind, cast_sum), s.block, s.ratio,
                     s.values, s.rank)

    def topk_k(self, n: int) -> int:
        return wire.topk_k(self.ratio, n)

    def encoded_bytes(self, n: int) -> int:
        """Header + payload bytes of one gradzip message of n elements."""
        return wire.encoded_bytes(self.kind, n, self.block, self.ratio, self.values)

    def uncompressed_elements(self, shapes: Iterable[Shape]) -> int:
        """Elements of a bucket of these tensors that travel in fp32 (uncompressed_numel, and the
        tensors shorter than a piece; a shard boundary's short fragments are not counted)."""
        if self.kind not in wire.BLOCK_SCALED_KINDS:
            return 0
        return sum(numel(s) for s in shapes if numel(s) < wire.MIN_PIECE
                   or wire.travels_uncompressed(s, self.uncompressed_numel))


def split_cast_sum(name: str) -> tuple[str, str | None]:
    """A hook name ``SPEC@SUM`` as (SPEC, SUM), SUM a CompressionState cast_sum ("fp32": the
    two-phase exchange); a plain name as (name, None)."""
    name, at, cast_sum = name.strip().partition("@")
    if at and cast_sum not in wire.CAST_SUMS:
        raise ValueError(f"codec {name}@{cast_sum}: expected SPEC@fp32 or SPEC@wire")
    return name, (cast_sum if at else None)


def _int(s: str, name: str) -> int:
    try:
        return int(s)
    except ValueError:
        raise ValueError(f"codec {name!r}: {s!r} is not an integer") from None


# --- links and collectives ------------------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    """One direction of each worker's link. efficiency: goodput / line rate (TCP/IP and Ethernet
    framing: 1448 payload bytes in a 1514-byte frame is 0.956)."""

    gbps: float
    latency_s: float = 50e-6
    efficiency: float = 0.95

    @property
    def bytes_per_s(self) -> float:
        return self.gbps * 1e9 / 8 * self.efficiency


@dataclass(frozen=True)
class Cost:
    """Time and bytes a collective (or a sum of them) costs one rank."""

    seconds: float = 0.0
    sent_bytes: float = 0.0
    messages: int = 0  # latency-bound steps

    def __add__(self, o: "Cost") -> "Cost":
        return Cost(self.seconds + o.seconds, self.sent_bytes + o.sent_bytes,
                    self.messages + o.messages)


def _steps(count: int, step_bytes: float, link: Link) -> Cost:
    return Cost(count * (link.latency_s + step_bytes / link.bytes_per_s), count * step_bytes, count)


def ring_allreduce(nbytes: float, p: int, link: Link) -> Cost:
    """Reduce-scatter then all-gather around a ring: 2(p-1) steps of S/p bytes."""
    return Cost() if p <= 1 else _steps(2 * (p - 1), nbytes / p, link)


def ring_allgather(nbytes_each: float, p: int, link: Link) -> Cost:
    """Every rank's s bytes reach every other rank: p-1 steps of s bytes."""
    return Cost() if p <= 1 else _steps(p - 1, nbytes_each, link)


def alltoall(nbytes_per_peer: float, p: int, link: Link, per_node: int = 1) -> Cost:
    """Pairwise exchange: p-1 steps, each sending one peer its s bytes. ``per_node``: ranks that
    share ``link`` (a node's), their p - per_node remote peers' bytes all go through it (a ring's
    steps cross it once per node whatever per_node is)."""
    if p <= 1:
        return Cost()
    out = per_node * (p - per_node) * nbytes_per_peer  # what leaves one node
    return Cost((p - 1) * link.latency_s + out / link.bytes_per_s, out, p - 1)


def two_phase(codec: Codec, n: int, p: int, link: Link, exact: int = 0,
              per_node: int = 1) -> Cost:
    """All-to-all of encoded shards, fp32 sum at the shard owner, re-encode, all-gather; ``exact``
    of the n elements in fp32 (their own message in each shard)."""
    shard = codec.encoded_bytes(wire.ceil_div(n - exact, p)) if n > exact else 0
    if exact:
        shard += wire.encoded_bytes("fp32", wire.ceil_div(exact, p))
    return alltoall(shard, p, link, per_node) + ring_allgather(shard, p, link)


# --- codec compute --------------------------------------------------------------------------------

# Bytes per element each pass must move at the least (its memory-traffic floor): fused error-feedback encode
# (read grad + residual, write residual + payload) and decode-add (read payload + out, write out).
ENCODE_EF_BYTES = {"fp32": 0.0, "fp16": 14.0, "bf16": 14.0, "int8": 13.0, "sign": 12.1,
                   "topk": 16.0, "powersgd": 0.0, "lowrank": 0.0}
DECODE_ADD_BYTES = {"fp32": 0.0, "fp16": 10.0, "bf16": 10.0, "int8": 9.0, "sign": 8.2,
                    "topk": 8.0, "powersgd": 0.0, "lowrank": 0.0}


@dataclass(frozen=True)
class CodecSpeed:
    """Elements per second of the fused error-feedback encode and of decode-add (dense elements;
    top-k's decode-add is charged per kept element)."""

    encode_ef: float
    decode_add: float

    @staticmethod
    def from_memory_bandwidth(codec: Codec, gbytes_per_s: float) -> "CodecSpeed":
        bw = gbytes_per_s * 1e9
        e, d = ENCODE_EF_BYTES[codec.kind], DECODE_ADD_BYTES[codec.kind]
        return CodecSpeed(bw / e if e else math.inf, bw / d if d else math.inf)


def measure_codec_speed(spec: str, n: int = 1 << 22, repeats: int = 3) -> CodecSpeed:
    """Times gradzip's own ops on this machine (best of `repeats`). Needs the built extension."""
    import torch
    import gradzip

    grad = torch.randn(n)
    residual = torch.zeros(n)
    out = torch.zeros(n)
    payload = gradzip.encode_with_feedback(grad, residual, spec)  # warm-up, and a real payload
    gradzip.decode_add(payload, out)

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    t_enc = best(lambda: gradzip.encode_with_feedback(grad, residual, spec))
    t_dec = best(lambda: gradzip.decode_add(payload, out))
    decoded = Codec.parse(spec).topk_k(n) if spec.startswith("topk") else n
    return CodecSpeed(n / t_enc, decoded / t_dec)


def codec_speeds(names: Iterable[str], measure: bool = False,
                 mem_gbytes_per_s: float = 3800.0) -> dict[str, CodecSpeed | None]:
    """Codec speed for each hook name: timed through gradzip's ops (measure=True; PyTorch's
    16-bit hooks are charged gradzip's cast of the same width), or memory-bound at the given
    bandwidth. None where a hook runs no codec (DDP's all-reduce, PowerSGD, lowrank)."""
    out: dict[str, CodecSpeed | None] = {}
    for name in names:
        codec = Codec.parse(name)
        if codec.collective in ("powersgd", "lowrank") or (codec.kind == "fp32"
                                                             and codec.collective == "allreduce"):
            out[name] = None
        elif measure:
            out[name] = measure_codec_speed(codec.kind if codec.collective == "allreduce"
                                            else split_cast_sum(name)[0])
        else:
            out[name] = CodecSpeed.from_memory_bandwidth(codec, mem_gbytes_per_s)
    return out


def codec_compute_s(codec: Codec, n: int, p: int, speed: CodecSpeed | None) -> float:
    """Seconds of codec work one rank does for one bucket of n elements."""
    if speed is None or codec.collective in ("powersgd", "lowrank"):
        return 0.0  # the low-rank matmuls are not modelled
    if codec.kind == "fp32" and codec.collective == "allreduce":
        return 0.0  # DDP's own all-reduce: no codec
    if codec.collective in ("allreduce", "cast_allreduce"):  # casts: encode, decode
        return n / speed.encode_ef + n / speed.decode_add
    if codec.collective == "two_phase":
        shard = wire.ceil_div(n, p)
        # encode all shards; decode-add p copies of my shard; re-encode it; decode the gathered n.
        return (n + shard) / speed.encode_ef + (p * shard + n) / speed.decode_add
    return n / speed.encode_ef + p * codec.topk_k(n) / speed.decode_add  # all-gather (top-k)


# --- buckets and a step ---------------------------------------------------------------------------

Shape = tuple[int, ...]


def numel(shape: Shape) -> int:
    return math.prod(shape)


FIRST_BUCKET_BYTES = 2**20  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES


def ddp_buckets(shapes: Sequence[Shape], cap_bytes: int = 25 * 2**20,
                first_cap_bytes: int = FIRST_BUCKET_BYTES, element_bytes: int = 4) -> list[list[Shape]]:
    """DDP's bucket assignment after its rebuild: parameters in reverse order (the order their
    gradients become ready), a bucket closes once it reaches its cap; the first cap is small."""
    buckets: list[list[Shape]] = []
    cur: list[Shape] = []
    size = 0
    for shape in reversed(list(shapes)):
        cur.append(tuple(shape))
        size += numel(shape) * element_bytes
        if size >= (first_cap_bytes if not buckets else cap_bytes):
            buckets.append(cur)
            cur, size = [], 0
    if cur:
        buckets.append(cur)
    return buckets


def powersgd_plan(shapes: Iterable[Shape], rank: int, min_compression_rate: float = 2.0):
    """Elements PowerSGD all-reduces for one bucket: (uncompressed, P, Q), following
    torch's powerSGD_hook: tensors of ndim > 1 viewed as (shape[0], rest) are compressed when
    (rows + cols) * rank * min_compression_rate < rows * cols."""
    plain = p_elems = q_elems = 0
    for shape in shapes:
        if len(shape) <= 1:
            plain += numel(shape)
            continue
        rows, cols = shape[0], numel(shape) // shape[0]
        r = min(rows, cols, rank)
        if (rows + cols) * r * min_compression_rate < rows * cols:
            p_elems += rows * r
            q_elems += cols * r
        else:
            plain += rows * cols
    return plain, p_elems, q_elems


def _cast_bytes(codec: Codec) -> int:
    """Bytes per element a cast (an all-reduce in its dtype) sends: fp32's 4, fp16/bf16's 2."""
    return 4 if codec.kind == "fp32" else 2


def bucket_cost(codec: Codec, shapes: Sequence[Shape], p: int, link: Link,
                speed: CodecSpeed | None = None,
                min_compress_numel: int = wire.MIN_COMPRESS_NUMEL, per_node: int = 1) -> Cost:
    """Communication plus codec compute for one bucket holding tensors of the given shapes;
    ``per_node`` ranks share each ``link`` (see :func:`alltoall`)."""
    n = sum(numel(s) for s in shapes)
    c = codec.collective
    if c == "allreduce":
        comm = ring_allreduce(_cast_bytes(codec) * n, p, link)
    elif n < max(min_compress_numel, p, 1):  # gradzip sends small buckets uncompressed
        return ring_allreduce(4 * n, p, link)
    elif c == "cast_allreduce":  # the payload's values in the wire dtype; the header stays home
        comm = ring_allreduce(_cast_bytes(codec) * n, p, link)
    elif c == "two_phase":
        exact = codec.uncompressed_elements(shapes)
        comm = two_phase(codec, n, p, link, exact, per_node)
        return comm + Cost(seconds=codec_compute_s(codec, n - exact, p, speed))  # fp32: no codec
    elif c == "allgather":
        comm = ring_allgather(codec.encoded_bytes(n), p, link)
    elif c == "lowrank":  # P with the uncompressed tensors appended, then Q (if any matrix)
        plain, pe, qe = powersgd_plan(shapes, codec.rank)
        comm = ring_allreduce(4 * (plain + pe), p, link)
        if qe:
            comm = comm + ring_allreduce(4 * qe, p, link)
    else:  # powersgd: the uncompressed tensors, then P, then Q, each an all-reduce
        plain, pe, qe = powersgd_plan(shapes, codec.rank)
        comm = ring_allreduce(4 * plain, p, link)
        if pe:
            comm = comm + ring_allreduce(4 * pe, p, link) + ring_allreduce(4 * qe, p, link)
    return comm + Cost(seconds=codec_compute_s(codec, n, p, speed))


def two_level_bucket_cost(codec: Codec, shapes: Sequence[Shape], p: int, per_node: int,
                          link: Link, intra: Link, speed: CodecSpeed | None = None) -> Cost:
    """gradzip.two_level's reduction of one bucket on p ranks, ``per_node`` to a node: an fp32
    reduce-scatter and all-gather inside the node (a ring all-reduce's steps on ``intra``), and
    the codec's reduction of each rank's 1/per_node shard between the p / per_node nodes, the
    node's per_node shards' reductions sharing its ``link``. ``sent_bytes``: what leaves a node."""
    n = sum(numel(s) for s in shapes)
    inner = ring_allreduce(4 * n, per_node, intra)
    shared = Link(link.gbps / per_node, link.latency_s, link.efficiency)
    outer = bucket_cost(codec, [(wire.ceil_div(n, per_node),)], p // per_node, shared, speed)
    return Cost(inner.seconds + outer.seconds, per_node * outer.sent_bytes,
                inner.messages + outer.messages)


def step_cost(codec: Codec | str, buckets: Sequence[Sequence[Shape]], p: int, link: Link,
              speed: CodecSpeed | None = None, per_node: int = 1,
              intra: Link | None = None) -> Cost:
    """One training step's communication: the buckets one after the other, no overlap.
    ``per_node``: ranks per node (p of them in all, ``link`` each node's link to the others, its
    ``sent_bytes`` what leaves a node; traffic inside a node is not charged); ``intra``: the link
    inside a node, for gradzip.two_level's reduction (None: the flat hook)."""
    codec = Codec.parse(codec) if isinstance(codec, str) else codec
    if per_node < 1 or p % per_node:
        raise ValueError(f"{per_node} ranks per node do not divide {p} ranks")
    if per_node > 1 and p == per_node and intra is None:
        return Cost()  # one node: the slow link carries nothing
    total = Cost()
    for shapes in buckets:
        total = total + (bucket_cost(codec, shapes, p, link, speed, per_node=per_node)
                         if intra is None else
                         two_level_bucket_cost(codec, shapes, p, per_node, link, intra, speed))
    return total


@dataclass(frozen=True)
class BreakEven:
    """Where a codec stops paying against a baseline, as link bandwidth varies (p fixed).
    pays_below: the codec is faster for bandwidths below `gbps` (the usual case); if False,
    faster above it. gbps == inf with pays_below: always faster; gbps == 0 with pays_below:
    never faster."""

    gbps: float
    pays_below: bool = True

    def __str__(self) -> str:
        if self.pays_below and math.isinf(self.gbps):
            return "always"
        if self.pays_below and self.gbps == 0:
            return "never"
        return f"{'<' if self.pays_below else '>'}{_fmt_gbps(self.gbps)}"


def _fmt_gbps(g: float) -> str:
    return f"{g:.3g}" if g < 1000 else f"{g:.0f}"


def break_even(codec: Codec | str, baseline: Codec | str, buckets, p: int, link: Link,
               speed: CodecSpeed | None = None, base_speed: CodecSpeed | None = None) -> BreakEven:
    """Step comm time is a + c / bandwidth for each side; solve a_c + c_c/B = a_b + c_b/B."""
    def coeffs(cd, sp):
        t1 = step_cost(cd, buckets, p, Link(1.0, link.latency_s, link.efficiency), sp).seconds
        t2 = step_cost(cd, buckets, p, Link(2.0, link.latency_s, link.efficiency), sp).seconds
        c = 2.0 * (t1 - t2)  # t(B) = a + c/B  =>  t1 - t2 = c/2
        return t1 - c, c

    ac, cc = coeffs(codec, speed)
    ab, cb = coeffs(baseline, base_speed)
    dc, da = cb - cc, ac - ab  # codec faster at B  <=>  dc / B > da
    eps = 1e-15
    if dc > eps:
        return BreakEven(math.inf if da <= 0 else dc / da, pays_below=True)
    if dc < -eps:
        return BreakEven(0.0, True) if da >= 0 else BreakEven(dc / da, pays_below=False)
    return BreakEven(math.inf if da < 0 else 0.0, pays_below=True)


# The hooks the bandwidth benchmark runs, in the order of its table.
BENCH_HOOKS = ("none", "torch-fp16", "torch-bf16", "powersgd:2", "bf16", "int8", "sign",
               "topk:0.01", "topk:0.02@fp32")
