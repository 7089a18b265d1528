"""The source of the gradzip package and of the convergence harness (gradzip_converge, a
distribution of its own) read with ast, nothing imported: their modules, and what each one imports
anywhere in the file (inside functions too), relative imports made absolute."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"gradzip": ROOT / "bindings" / "python" / "gradzip",
            "gradzip_converge": ROOT / "bench" / "harness" / "gradzip_converge"}


def modules() -> dict[str, tuple[Path, ast.Module]]:
    """Dotted module name (a package by its __init__.py) -> (path, syntax tree)."""
    found = {}
    for package in PACKAGES.values():
        for path in sorted(package.rglob("*.py")):
            parts = path.relative_to(package.parent).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = (path, ast.parse(path.read_text(), str(path)))
    return found


def imports(name: str, path: Path, tree: ast.Module):
    """(module, names, node) for each import statement of module ``name``: ``import a.b`` gives
    ("a.b", None), ``from .x import y, z`` gives ("<package>.x", ["y", "z"])."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            yield base, [a.name for a in node.names], node
