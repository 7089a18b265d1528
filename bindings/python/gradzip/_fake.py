"""Fake (meta) implementations of the tensor ops, for FakeTensor tracing (torch.compile, export,
torch.library.opcheck).

Each one only says what the op returns: the sizes come from the op library itself
(``torch.ops.gradzip.encoded_bytes``), never from a copy of its rules. Validation stays in the
kernels, which run on the real tensors; the one check made here is the device, because a tensor on
a device without a gradzip kernel (a plain meta tensor, say) reaches this fake instead of a kernel
and must be rejected as the kernels would reject it.

- ``encode``, ``encode_with_feedback``: a uint8 tensor of ``encoded_bytes(input.numel(), spec)``
  bytes on the input's device. The byte count is an exact function of the element count, so a
  symbolic element count is specialised to its value; an element count that is data (the input
  came from a ``decode`` without ``n``) gives a data-dependent byte count.
- ``encode_into``, ``encode_with_feedback_into``, ``decode_into``, ``decode_add``: nothing (they
  write into their mutable arguments).
- ``decode(payload, n)``: float32 of ``n`` elements when ``n >= 0``; with ``n = -1`` the count is
  in the payload's header, so the fake returns a tensor of a new data-dependent size
  (``ctx.new_dynamic_size()``, an unbacked symbolic size under torch.compile). Plain meta tensors
  never get that far: they are rejected by the device check.
- ``header`` has no fake: every field it returns is data.
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

_DEVICES = ("cpu", "cuda")


def _check_device(op: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device.type not in _DEVICES:
            raise ValueError(f"gradzip.{op}: {name} is on device {t.device}; "
                             "only CPU and CUDA are supported")


def _payload_like(x: torch.Tensor, spec: str) -> torch.Tensor:
    n = x.numel()
    if isinstance(n, torch.SymInt) and free_unbacked_symbols(n):
        # the element count is itself data (x came out of a decode without n): so is the size
        nbytes = torch.library.get_ctx().new_dynamic_size()
    else:
        nbytes = torch.ops.gradzip.encoded_bytes(int(n), spec)
    return x.new_empty((nbytes,), dtype=torch.uint8)


@torch.library.register_fake("gradzip::encode")
def _encode(input, spec, prescale=1.0):
    _check_device("encode", input=input)
    return _payload_like(input, spec)


@torch.library.register_fake("gradzip::encode_into")
def _encode_into(input, out, spec, prescale=1.0):
    _check_device("encode_into", input=input, out=out)


@torch.library.register_fake("gradzip::encode_with_feedback")
def _encode_with_feedback(grad, residual, spec, prescale=1.0):
    _check_device("encode_with_feedback", input=grad, residual=residual)
    return _payload_like(grad, spec)


@torch.library.register_fake("gradzip::encode_with_feedback_into")
def _encode_with_feedback_into(grad, residual, out, spec, prescale=1.0):
    _check_device("encode_with_feedback_into", input=grad, residual=residual, out=out)


@torch.library.register_fake("gradzip::decode")
def _decode(payload, n=-1):
    _check_device("decode", payload=payload)
    if n < 0:
        n = torch.library.get_ctx().new_dynamic_size()
    return payload.new_empty((n,), dtype=torch.float32)


@torch.library.register_fake("gradzip::decode_into")
def _decode_into(payload, out):
    _check_device("decode_into", payload=payload, out=out)


@torch.library.register_fake("gradzip::decode_add")
def _decode_add(payload, out):
    _check_device("decode_add", payload=payload, out=out)
