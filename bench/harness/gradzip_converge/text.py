"""Real English text every machine that runs the harness has: the docstrings of the Python
standard library the harness runs under.

The docstrings of every module, class and function, read with ``ast`` from the standard library's
``.py`` files in sorted path order (each file's in ``ast.walk`` order), joined by blank lines:
about 1.6 MB of technical prose under Python 3.11, with code examples in it. The directories
that vary between installations of one Python version are left out: third-party packages
(site-packages) and the test suites, which some distributions do not install. The text still
depends on the Python version, so runs record its SHA-256 (``fingerprint``).
"""
from __future__ import annotations

import ast
import functools
import hashlib
import os
import sysconfig
import warnings
from pathlib import Path

STDLIB_DOCSTRINGS = "stdlib-docstrings"
TEXTS = (STDLIB_DOCSTRINGS,)
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test"}
DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def stdlib_sources(root: Path) -> list[Path]:
    """The standard library's .py files under ``root``, sorted by their relative paths' parts (a
    folder's files before the next name: ``a/z.py`` before ``a.py``)."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]  # not walked at all: site-packages is big
        found += [Path(folder, f) for f in files if f.endswith(".py")]
    return sorted(found, key=lambda p: p.relative_to(root).parts)


def docstrings(source: bytes) -> list[str]:
    """The docstrings of one source file, in ``ast.walk`` order (breadth first)."""
    try:
        with warnings.catch_warnings():  # invalid escapes in old sources: not ours to report
            warnings.simplefilter("ignore")
            tree = ast.parse(source)
    except (SyntaxError, ValueError):  # a file of another Python version, or broken on purpose
        return []
    return [d for node in ast.walk(tree) if isinstance(node, DOCUMENTED)
            and (d := ast.get_docstring(node))]


def docstring_text(root: Path) -> bytes:
    """The docstrings of the sources under ``root``, UTF-8 encoded (the model reads bytes)."""
    docs = [d for path in stdlib_sources(root) for d in docstrings(path.read_bytes())]
    if not docs:
        raise ValueError(f"no docstrings found under {root}: the standard library's sources are "
                         "not installed")
    return "\n\n".join(docs).encode()


@functools.cache
def load_text(name: str) -> bytes:
    """The named text; read once per process (~2 s)."""
    if name != STDLIB_DOCSTRINGS:
        raise ValueError(f"unknown text {name!r}; known: {', '.join(TEXTS)}")
    return docstring_text(Path(sysconfig.get_paths()["stdlib"]))


def fingerprint(name: str) -> dict:
    """What identifies the text a run trained on: its name, size and SHA-256."""
    data = load_text(name)
    return {"text": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
