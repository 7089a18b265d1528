"""The optional-dependency extras of pyproject.toml: they list every third-party package gradzip's
modules and notebooks import, the pins of requirements.txt satisfy them, and a missing package is
reported with the extra that provides it (while `import gradzip` and gradzip.ddp need none)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest

from gradzip import _extras
from package_source import ROOT, imports, modules

tomllib = pytest.importorskip("tomllib")
requirements = pytest.importorskip("packaging.requirements")

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS = PROJECT["optional-dependencies"]
STDLIB = sys.stdlib_module_names


def dist_names(reqs) -> set[str]:
    """Distribution names of requirement strings; gradzip[a,b] expands to those extras."""
    names = set()
    for text in reqs:
        req = requirements.Requirement(text)
        if req.name == "gradzip":
            for extra in req.extras:
                names |= dist_names(EXTRAS[extra])
        else:
            names.add(req.name.lower())
    return names


CORE = dist_names(PROJECT["dependencies"])


def extra_of(module: str) -> str | None:
    """The extra a module's optional imports belong to."""
    return "converge" if module.startswith("gradzip.converge") else None


def third_party(base: str) -> bool:
    top = base.partition(".")[0]
    return bool(top) and top not in STDLIB and top != "gradzip"


def required(tree):
    """(module, extra, node) for each ``require("module", "extra")`` call."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "require":
            args = [a.value for a in node.args if isinstance(a, ast.Constant)]
            assert len(args) >= 2, f"line {node.lineno}: require() needs literal module and extra"
            yield args[0], args[1], node


def test_modules_import_optional_packages_through_require():
    problems = []
    for name, (path, tree) in modules().items():
        at = f"{path.relative_to(ROOT)}:"
        for base, _, node in imports(name, path, tree):
            if third_party(base) and _extras.distribution(base) not in CORE:
                problems.append(f"{at}{node.lineno}: imports {base} directly; use "
                                f"gradzip._extras.require so that a missing one names the extra")
        for module, extra, node in required(tree):
            dist = _extras.distribution(module)
            if extra not in EXTRAS or dist not in dist_names(EXTRAS[extra]):
                problems.append(f"{at}{node.lineno}: {dist} is not in the extra {extra!r}")
            elif extra_of(name) not in (None, extra):
                problems.append(f"{at}{node.lineno}: {name} belongs to {extra_of(name)!r}")
    assert not problems, "\n".join(problems)


def test_converge_extra_lists_every_package_converge_imports():
    """Every third-party package of gradzip.converge (direct or through require) is torch or in
    the converge extra, and the extra lists nothing the harness does not use."""
    used = set()
    for name, (path, tree) in modules().items():
        if extra_of(name) != "converge":
            continue
        used |= {_extras.distribution(b) for b, _, _ in imports(name, path, tree) if third_party(b)}
        used |= {_extras.distribution(m) for m, _, _ in required(tree)}
    assert used - CORE == dist_names(EXTRAS["converge"])
    assert {"numpy", "tqdm", "matplotlib", "pillow", "h5py", "safetensors"} <= used


def test_costmodel_needs_only_the_core_dependencies():
    mods = modules()
    for name in ("gradzip.costmodel", "gradzip.costmodel.__main__", "gradzip.costmodel_cli",
                 "gradzip.converge.models"):  # costmodel_cli builds models on the meta device
        path, tree = mods[name]
        used = {_extras.distribution(b) for b, _, _ in imports(name, path, tree) if third_party(b)}
        assert used <= CORE, name
        assert not list(required(tree)), name


def test_notebooks_extra_lists_what_the_notebooks_import():
    used = set()
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(nb.read_text())["cells"]:
            if cell["cell_type"] != "code":
                continue
            tree = ast.parse("".join(cell["source"]))
            used |= {_extras.distribution(b) for b, _, _ in imports("__main__", nb, tree)
                     if third_party(b)}
    assert used, "no imports found in notebooks/"
    have = dist_names(EXTRAS["notebooks"])
    assert used - CORE <= have
    assert {"nbconvert", "ipykernel"} <= have  # scripts/notebooks.sh executes them


def test_all_is_every_extra():
    everything = set().union(*(dist_names(v) for k, v in EXTRAS.items() if k != "all"))
    assert dist_names(EXTRAS["all"]) == everything


def test_requirements_pins_satisfy_the_extras():
    pins = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = requirements.Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", line
            pins[req.name.lower()] = spec.version
    for text in PROJECT["dependencies"] + [r for v in EXTRAS.values() for r in v]:
        req = requirements.Requirement(text)
        if req.name == "gradzip":
            continue
        assert req.name.lower() in pins, f"{text}: not pinned in requirements.txt"
        assert req.specifier.contains(pins[req.name.lower()]), \
            f"{text}: requirements.txt pins {pins[req.name.lower()]}"


def test_require_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "numpy", None)  # as if numpy were not installed
    with pytest.raises(ImportError) as e:
        _extras.require("numpy", "converge")
    assert str(e.value) == "gradzip.converge needs numpy: pip install 'gradzip[converge]'"
    assert not isinstance(e.value, ModuleNotFoundError) and e.value.name == "numpy"

    monkeypatch.setitem(sys.modules, "PIL.Image", None)
    with pytest.raises(ImportError, match=r"needs pillow: pip install 'gradzip\[converge\]'"):
        _extras.require("PIL.Image", "converge")
    with pytest.raises(ImportError, match=r"^bandwidth.ipynb needs no_such_module_xyz: "
                                          r"pip install 'gradzip\[notebooks\]'$"):
        _extras.require("no_such_module_xyz.sub", "notebooks", "bandwidth.ipynb")
    assert _extras.require("json", "converge") is json


def test_require_keeps_errors_of_an_installed_module(tmp_path, monkeypatch):
    """A module that is there but imports something missing is not reported as the extra's."""
    (tmp_path / "gz_broken_mod.py").write_text("import gz_missing_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError) as e:
        _extras.require("gz_broken_mod", "converge")
    assert e.value.name == "gz_missing_dependency"


BLOCK = """
import sys
for m in {blocked!r}:
    sys.modules[m] = None
"""


def run_without_extras(code: str) -> subprocess.CompletedProcess:
    """Runs ``code`` in a fresh interpreter in which every package of the extras is missing."""
    reverse = {d: m for m, d in _extras.DISTRIBUTIONS.items()}
    blocked = sorted(reverse.get(d, d) for k, v in EXTRAS.items() for d in dist_names(v))
    return subprocess.run([sys.executable, "-c", BLOCK.format(blocked=blocked) + code],
                          capture_output=True, text=True, timeout=300)


def test_gradzip_ddp_and_costmodel_import_without_extras():
    r = run_without_extras(
        "import gradzip, gradzip.ddp, gradzip.costmodel, gradzip.costmodel_cli\n"
        "from gradzip.costmodel_cli import main\n"
        "sys.exit(main(['--model', 'vit-t14', '--workers', '8', '--gbps', '10']))\n")
    assert r.returncode == 0, r.stderr
    assert "Break-even link rate" in r.stdout


def test_converge_without_extras_names_the_extra():
    r = run_without_extras("import runpy\n"
                           "sys.argv = ['gradzip.converge', '--list']\n"
                           "runpy.run_module('gradzip.converge', run_name='__main__')\n")
    assert r.returncode != 0
    assert r.stderr.strip().splitlines()[-1] == \
        "ImportError: gradzip.converge needs numpy: pip install 'gradzip[converge]'"
    assert "ModuleNotFoundError" not in r.stderr
