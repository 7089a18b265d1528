"""The codec spec grammar, the codecs' facts and the wire format's sizes in plain Python, and the
smallest bucket compressed by default: what the cost model needs when the compiled extension is
absent (``python -m gradzip.costmodel`` on a machine without it).

The rules are the C++ library's: the spec parser (codecs/spec.cpp, and parse_lowrank of
bindings/torch/lowrank_reduction.cpp), the codecs' facts (the traits of
include/gradzip/codec/<codec>.hpp, see codec/visit.hpp) as the bucket reduction applies them
(bindings/torch/bucket_reduction.cpp), and the sizes (include/gradzip/wire.hpp). This is their only
Python copy: gradzip.plan and the cost model both use it, and tests/python/test_wire.py checks it
against the extension on every codec, every spec of the fuzz corpus and a spread of sizes, and its
constants against ``torch.ops.gradzip.wire_constants()``.
Imports nothing from gradzip or torch.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

HEADER_BYTES = 32
MAX_COUNT = 1 << 48  # largest element count of a message
TOPK_MAX_COUNT = 0xFFFFFFFF  # top-k indices stay below 2^32
TOPK_INDEX_CHUNK = 1 << 16  # a top-k index travels as its chunk's end and a u16 offset in it
# How top-k's values travel (values=...): the header's flags and the bytes per kept value; int8
# adds one f32 scale per index chunk.
TOPK_VALUE_FLAGS = {"fp32": 0, "fp16": 1, "int8": 2}
TOPK_VALUE_BYTES = {"fp32": 4, "fp16": 2, "int8": 1}
MIN_BLOCK, MAX_BLOCK = 32, 65536
DEFAULT_INT8_BLOCK = 256
DEFAULT_SIGN_BLOCK = 1024
KINDS = ("fp32", "fp16", "bf16", "int8", "sign", "topk")
# Buckets (DDP) and reduce-scatter groups (FSDP) below this many elements go uncompressed by
# default: there the headers and launches cost more than the bytes saved. gradzip.ddp, gradzip.fsdp
# and the cost model take it from here.
MIN_COMPRESS_NUMEL = 4096

# The codecs' facts (their traits' members, include/gradzip/codec/visit.hpp), by kind.
# block_scaled: a bucket is cut at its tensors' boundaries, so only these codecs send some tensors
# uncompressed (``uncompressed_numel``).
BLOCK_SCALED_KINDS = ("int8", "sign")
# In their buckets a tensor (or a shard's part of one) of fewer elements travels in fp32: a block
# of its own would cost a header for a few bytes, and one shared with a neighbour tensor would give
# it the neighbour's scale (bindings/torch/bucket_reduction.hpp, kMinPiece).
MIN_PIECE = 64
# A CPU bucket of more elements is reduced as consecutive chunks whose phases overlap each other's
# collectives (bindings/torch/compressed_allreduce.hpp, kChunk).
CHUNK = 1 << 21
# summable: the payload is the values, in a dtype a backend's all-reduce sums.
SUMMABLE_KINDS = ("fp32", "fp16", "bf16")
LOSSLESS_KINDS = ("fp32",)  # decode(encode(x)) == x: error feedback has nothing to keep
# all_gathered: an all-reduce all-gathers every rank's message of the whole bucket.
ALL_GATHERED_KINDS = ("topk",)

CAST_SUMS = ("wire", "fp32")  # CompressionState(cast_sum=...): where fp32/fp16/bf16 buckets are summed


def allreduce_collective(kind: str, cast_sum: str) -> str:
    """How an all-reduced bucket of this codec kind travels (bindings/torch/bucket_reduction.hpp,
    BucketLayout): "cast_allreduce", one all-reduce of the payload in the wire dtype (a summable
    codec with cast_sum "wire"); "allgather" (top-k); "lowrank", two all-reduces of low-rank
    factors (lowrank_reduction.hpp); else "two_phase", the all-to-all and all-gather with an fp32
    sum."""
    if cast_sum not in CAST_SUMS:
        raise ValueError(f"gradzip: cast_sum must be one of {CAST_SUMS}, got {cast_sum!r}")
    if kind in SUMMABLE_KINDS and cast_sum == "wire":
        return "cast_allreduce"
    if kind in ALL_GATHERED_KINDS and cast_sum == "wire":
        return "allgather"
    return "lowrank" if kind == "lowrank" else "two_phase"


# ---- spec grammar -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Spec:
    """A parsed gradzip codec spec: fp32 | fp16 | bf16 | int8[:block=N] | sign[:block=N] |
    topk:RATIO[:values=fp32|fp16|int8] | lowrank:RANK."""

    kind: str  # KINDS, or "lowrank"
    block: int = 0  # int8, sign
    ratio: float = 0.0  # topk
    values: str = "fp32"  # topk: TOPK_VALUE_BYTES's keys
    rank: int = 0  # lowrank


_UNSIGNED = re.compile(r"[0-9]+")  # std::from_chars of an unsigned integer, the whole string
# std::from_chars of a double (chars_format::general), the whole string; "inf" and "nan" parse
# there too but are never a ratio in (0, 1]
_DECIMAL = re.compile(r"-?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")
_OPTION = {"int8": "block", "sign": "block", "topk": "values"}  # the one option each codec takes


def parse_spec(spec: str) -> Spec:
    """The spec's parts, as the extension parses them (gradzip::Codec::parse, and parse_lowrank for
    lowrank:RANK); a ValueError naming the bad part where that throws."""

    def bad(why: str):
        raise ValueError(f"gradzip: bad codec spec {spec!r}: {why}")

    if spec.startswith("lowrank"):
        r = spec[len("lowrank"):]
        digits = r[1:]  # at most 9 of them, as parse_lowrank's
        if not (r.startswith(":") and _UNSIGNED.fullmatch(digits) and len(digits) <= 9
                and int(digits) >= 1):
            bad("expected lowrank:RANK with RANK an integer >= 1")
        return Spec("lowrank", rank=int(digits))
    name, *parts = spec.split(":")
    if name not in KINDS:
        bad(f"unknown codec {name!r} (expected {', '.join(KINDS[:-1])} or {KINDS[-1]})")
    fields = {"kind": name}
    if name in BLOCK_SCALED_KINDS:
        fields["block"] = DEFAULT_INT8_BLOCK if name == "int8" else DEFAULT_SIGN_BLOCK
    if name == "topk":
        if not parts or not parts[0]:
            bad("topk needs a ratio, e.g. topk:0.01")
        ratio = float(parts[0]) if _DECIMAL.fullmatch(parts[0]) else math.nan
        if not 0.0 < ratio <= 1.0:
            bad(f"ratio {parts[0]!r} must be a number in (0, 1]")
        fields["ratio"], parts = ratio, parts[1:]
    seen = set()
    for opt in parts:
        key, eq, value = opt.partition("=")
        if not eq or key != _OPTION.get(name) or key in seen:
            bad(f"option {opt!r}: {name} takes {_OPTION.get(name, 'no option')}=..., once")
        seen.add(key)
        if key == "block":
            if not (_UNSIGNED.fullmatch(value) and valid_block(int(value))):
                bad(f"block={value} must be a multiple of 32 in [32, 65536]")
            fields["block"] = int(value)
        elif value in TOPK_VALUE_BYTES:
            fields["values"] = value
        else:
            bad(f"values={value!r} must be fp32, fp16 or int8")
    return Spec(**fields)


def valid_block(block: int) -> bool:
    """int8/sign block sizes: multiples of 32 in [32, 65536]."""
    return MIN_BLOCK <= block <= MAX_BLOCK and block % 32 == 0


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def align16(a: int) -> int:
    return (a + 15) & ~15


def topk_k(ratio: float, n: int) -> int:
    """Elements top-k keeps out of n: min(n, max(1, ceil(ratio * n))), 0 for n == 0."""
    return 0 if n == 0 else min(n, max(1, math.ceil(ratio * n)))


def payload_bytes(kind: str, n: int, param: int, values: str = "fp32") -> int:
    """Bytes after the header; param: the block (int8, sign) or k (top-k)."""
    if kind == "fp32":
        return 4 * n
    if kind in ("fp16", "bf16"):
        return 2 * n
    if kind == "int8":
        return align16(4 * ceil_div(n, param)) + n
    if kind == "sign":
        return align16(4 * ceil_div(n, param)) + 4 * ceil_div(n, 32)
    if kind == "topk":  # chunk ends, u16 offsets, values (int8: padded, then a scale per chunk)
        chunks = ceil_div(n, TOPK_INDEX_CHUNK)
        head = align16(4 * chunks) + align16(2 * param)
        if values == "int8":
            return head + align16(param) + 4 * chunks
        return head + param * TOPK_VALUE_BYTES[values]
    raise ValueError(f"{kind} has no gradzip wire format")


def encoded_bytes(kind: str, n: int, block: int = 0, ratio: float = 0.0,
                  values: str = "fp32") -> int:
    """Header + payload bytes of one message of n elements (gradzip::Codec::encoded_bytes; a
    ValueError where that raises: n outside the limits)."""
    if not 0 <= n <= MAX_COUNT:
        raise ValueError(f"gradzip: element count {n} out of range [0, 2^48]")
    if kind == "topk":
        if n > TOPK_MAX_COUNT:
            raise ValueError(f"gradzip: top-k supports at most 2^32 - 1 elements, got {n}")
        param = topk_k(ratio, n)
    else:
        param = block if kind in ("int8", "sign") else 0
    return HEADER_BYTES + payload_bytes(kind, n, param, values)


def message_slot_bytes(nbytes: int) -> int:
    """Bytes a message of nbytes takes in a buffer of messages (the all-reduce's shards and
    all-gather slots): each one starts on a 16-byte boundary."""
    return align16(nbytes)


def travels_uncompressed(shape, uncompressed_numel: int) -> bool:
    """Whether a tensor of this shape travels in fp32 inside a compressed bucket: with
    ``uncompressed_numel`` > 0 (0: never), the 1-D ones (biases, norms) and those of fewer
    elements. Their gradients' scales and statistics differ from the weights', and on few elements
    a block's header and error cost more than the fp32 bytes."""
    return uncompressed_numel > 0 and (len(shape) <= 1 or math.prod(shape) < uncompressed_numel)
