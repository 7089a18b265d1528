"""gradzip: gradient compression codecs with fused error feedback, for PyTorch.

The ops run on CPU tensors (and on CUDA tensors, on the current stream, when gradzip was built with
CUDA). Codec specs: ``fp32 | fp16 | bf16 | int8[:block=N] | sign[:block=N] | topk:RATIO[:values=fp16|int8]``.

    payload = gradzip.encode(x, "int8")               # uint8 tensor: 32-byte header + payload
    y = gradzip.decode(payload)                       # float32 tensor, x.numel() elements
    p = gradzip.encode_with_feedback(g, residual, "topk:0.01")  # residual updated in place

Bad input raises ``TypeError`` (wrong dtype) or ``ValueError`` (bad spec, layout, device, sizes, or
a corrupt payload), with the reason. The DDP communication hook is in :mod:`gradzip.ddp`.
"""

from __future__ import annotations

import glob
import os
from importlib import metadata

import torch

try:
    __version__ = metadata.version("gradzip")  # CMakeLists.txt's project VERSION (pyproject.toml)
except metadata.PackageNotFoundError:  # a source checkout on sys.path, never installed
    __version__ = "0+unknown"


class _MissingOps:
    """Stands in for the ops when the compiled library is absent (a source checkout): the pure
    Python parts of the package (cost model, harness) still import; any op raises ImportError."""

    def __init__(self, reason: str):
        self._reason = reason

    def __getattr__(self, name):
        raise ImportError(self._reason)


def _load_ops():
    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, "_gradzip_ops*.so")))
    if not found:
        return _MissingOps(
            f"gradzip: the compiled ops library (_gradzip_ops*.so) is missing in {here}; "
            "install the package with `python -m pip install --no-build-isolation .`")
    torch.ops.load_library(found[0])
    from . import _fake  # noqa: F401  (registers the ops' fake implementations)
    return torch.ops.gradzip


_ops = _load_ops()

__all__ = [
    "encode", "decode", "decode_add", "encode_with_feedback", "encoded_bytes", "canonical_spec",
    "header", "set_num_threads", "num_threads", "cpu_isa", "cuda_available",
]


def _as_float(t: torch.Tensor, name: str) -> torch.Tensor:
    """Upcasts bf16/fp16 inputs (the codecs read float32); other dtypes reach the op's TypeError."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"gradzip: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype in (torch.float16, torch.bfloat16):
        return t.float()
    return t


def _check_spec(spec) -> str:
    if not isinstance(spec, str):
        raise TypeError(f"gradzip: spec must be a str, got {type(spec).__name__}")
    return spec


def encoded_bytes(n: int, spec: str) -> int:
    """Exact size in bytes of the encoded message (header + payload) for n elements."""
    return _ops.encoded_bytes(int(n), _check_spec(spec))


def canonical_spec(spec: str) -> str:
    """The canonical form of a codec spec (raises ValueError when it does not parse)."""
    return _ops.canonical_spec(_check_spec(spec))


def encode(tensor: torch.Tensor, spec: str, prescale: float = 1.0,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """Encodes ``tensor * prescale`` (float32; bf16/fp16 are upcast) into a uint8 payload."""
    tensor = _as_float(tensor, "tensor")
    if out is None:
        return _ops.encode(tensor, _check_spec(spec), float(prescale))
    _ops.encode_into(tensor, out, _check_spec(spec), float(prescale))
    return out


def encode_with_feedback(grad: torch.Tensor, residual: torch.Tensor, spec: str,
                         prescale: float = 1.0, out: torch.Tensor | None = None) -> torch.Tensor:
    """Error-feedback encode: ``c = grad * prescale + residual; p = encode(c);
    residual = c - decode(p)`` in one pass (``residual`` float32, updated in place). Returns p."""
    grad = _as_float(grad, "grad")
    if out is None:
        return _ops.encode_with_feedback(grad, residual, _check_spec(spec), float(prescale))
    _ops.encode_with_feedback_into(grad, residual, out, _check_spec(spec), float(prescale))
    return out


def decode(payload: torch.Tensor, out: torch.Tensor | None = None,
           n: int | None = None) -> torch.Tensor:
    """Decodes a payload into a new float32 tensor (or into ``out``). On CUDA, pass ``n`` (the
    element count) to avoid reading the header back to the host."""
    if out is not None:
        _ops.decode_into(payload, out)
        return out
    return _ops.decode(payload, -1 if n is None else int(n))


def decode_add(payload: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out += decode(payload)`` in element order (bitwise reproducible). Returns out."""
    _ops.decode_add(payload, out)
    return out


_HEADER_FIELDS = ("magic", "version", "codec", "dtype", "count", "param", "flags", "payload_bytes")


def header(payload: torch.Tensor) -> dict:
    """The payload's validated wire header as a dict."""
    return dict(zip(_HEADER_FIELDS, _ops.header(payload)))


def set_num_threads(n: int) -> None:
    """CPU threads used by the host codecs (results do not depend on it)."""
    _ops.set_num_threads(int(n))


def num_threads() -> int:
    return _ops.num_threads()


def cpu_isa() -> str:
    """The SIMD level the CPU path picked: "avx512", "avx2" or "portable"."""
    return _ops.cpu_isa()


def cuda_available() -> bool:
    """True when gradzip's CUDA branch is compiled in and a device is usable."""
    return _ops.cuda_available()
