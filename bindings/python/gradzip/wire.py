"""The wire format's sizes in plain Python, and the smallest bucket compressed by default: what the
cost model needs when the compiled extension is absent (``python -m gradzip.costmodel`` on a
machine without it).

The rules are include/gradzip/wire.hpp's (the C++ library, the CUDA decoders and the extension's
``encoded_bytes`` all use that one definition); this is their only Python copy, and
tests/python/test_wire.py checks it against the extension on every codec and a spread of sizes.
Imports nothing from gradzip or torch.
"""

from __future__ import annotations

import math

HEADER_BYTES = 32
MAX_COUNT = 1 << 48  # largest element count of a message
TOPK_MAX_COUNT = 0xFFFFFFFF  # top-k indices are u32
MIN_BLOCK, MAX_BLOCK = 32, 65536
DEFAULT_INT8_BLOCK = 256
DEFAULT_SIGN_BLOCK = 1024
KINDS = ("fp32", "fp16", "bf16", "int8", "sign", "topk")
# Buckets (DDP) and reduce-scatter groups (FSDP) below this many elements go uncompressed by
# default: there the headers and launches cost more than the bytes saved. gradzip.ddp, gradzip.fsdp
# and the cost model take it from here.
MIN_COMPRESS_NUMEL = 4096

# Codecs that cut a bucket at its tensors' boundaries (bindings/torch/bucket_reduction.hpp): only
# they send some tensors uncompressed (``uncompressed_numel``).
PIECEWISE_KINDS = ("int8", "sign")

CAST_SUMS = ("wire", "fp32")  # CompressionState(cast_sum=...): where fp32/fp16/bf16 buckets are summed


def sums_on_wire(kind: str, cast_sum: str) -> bool:
    """Whether an all-reduced bucket of this codec kind is summed by one all-reduce of its payload
    in the wire dtype (the casts fp32/fp16/bf16 with cast_sum "wire"), rather than by the
    two-phase fp32 sum or top-k's all-gather (bindings/torch/bucket_reduction.hpp,
    BucketLayout::wire_sum)."""
    if cast_sum not in CAST_SUMS:
        raise ValueError(f"gradzip: cast_sum must be one of {CAST_SUMS}, got {cast_sum!r}")
    return kind in ("fp32", "fp16", "bf16") and cast_sum == "wire"


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


def payload_bytes(kind: str, n: int, param: int, fp16_values: bool = False) -> int:
    """Bytes after the header; param: the block (int8, sign) or k (top-k)."""
    if kind == "fp32":
        return 4 * n
    if kind in ("fp16", "bf16"):
        return 2 * n
    if kind == "int8":
        return align16(4 * ceil_div(n, param)) + n
    if kind == "sign":
        return align16(4 * ceil_div(n, param)) + 4 * ceil_div(n, 32)
    if kind == "topk":
        return param * (4 + (2 if fp16_values else 4))
    raise ValueError(f"{kind} has no gradzip wire format")


def encoded_bytes(kind: str, n: int, block: int = 0, ratio: float = 0.0,
                  fp16_values: bool = False) -> int:
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
    return HEADER_BYTES + payload_bytes(kind, n, param, fp16_values)


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
