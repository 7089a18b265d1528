"""What a result depends on besides its RunConfig: the code that computed it and the environment
it ran in. A finished run (or a checkpoint) recorded under another key is redone, so a result on
disk always belongs to the code and the machine set-up that would compute it now."""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch

import gradzip


def code_hash() -> str:
    """SHA-256 (16 hex digits) of every .py file of the gradzip package and its compiled ops, and
    of every .py file of this harness: a result depends on the library and on the harness."""
    h = hashlib.sha256()
    for root in (Path(gradzip.__file__).resolve().parent, Path(__file__).resolve().parent):
        for p in sorted(root.rglob("*.py")) + sorted(root.glob("_gradzip_ops*.so")):
            # named from its package on: a rename, also into the other package, changes the code
            h.update(Path(root.name, p.relative_to(root)).as_posix().encode() + b"\0")
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def cpu_isa() -> str:
    """The SIMD level gradzip's CPU codecs run at; read from /proc/cpuinfo (in gradzip's names)
    when the extension is not built."""
    try:
        return gradzip.cpu_isa()
    except ImportError:
        pass
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines()
                  if ln.startswith("flags")), [])
    return "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "portable"


def environment() -> dict:
    """The code version and the environment; part of every result's cache key."""
    return {"gradzip": gradzip.__version__, "code": code_hash(), "torch": torch.__version__,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "mkl": torch.backends.mkl.is_available(),
            "mkldnn": torch.backends.mkldnn.is_available(), "cpu_isa": cpu_isa(),
            "torch_threads": torch.get_num_threads()}
