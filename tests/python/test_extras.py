"""What the two distributions declare: gradzip's modules import only its dependencies (torch), the
convergence harness (gradzip-converge, bench/harness/pyproject.toml) lists every third-party
package it imports, the notebooks extra what the notebooks import, and the pins of requirements.txt
satisfy them all."""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest

from package_source import PACKAGES, ROOT, imports, modules

tomllib = pytest.importorskip("tomllib")
requirements = pytest.importorskip("packaging.requirements")

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
HARNESS = tomllib.loads((ROOT / "bench" / "harness" / "pyproject.toml").read_text())["project"]
EXTRAS = PROJECT["optional-dependencies"]
STDLIB = sys.stdlib_module_names
# Import names whose distribution (the name pip installs) differs.
DISTRIBUTIONS = {"PIL": "pillow"}


def distribution(module: str) -> str:
    """The distribution that provides ``module`` (``PIL.Image`` -> ``pillow``)."""
    top = module.partition(".")[0]
    return DISTRIBUTIONS.get(top, top)


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


def third_party(base: str) -> bool:
    top = base.partition(".")[0]
    return bool(top) and top not in STDLIB and top not in PACKAGES


def used_by(names) -> set[str]:
    """The third-party distributions the modules ``names`` import, inside functions too."""
    mods = modules()
    return {distribution(b) for name in names for b, _, _ in imports(name, *mods[name])
            if third_party(b)}


def package_modules(package: str) -> list[str]:
    return [name for name in modules() if name.partition(".")[0] == package]


def test_gradzip_imports_only_its_dependencies():
    assert used_by(package_modules("gradzip")) <= CORE


def test_harness_lists_every_package_it_imports():
    """Every third-party package of gradzip_converge is torch or in its dependencies, and they list
    nothing the harness does not use, besides gradzip itself."""
    used = used_by(package_modules("gradzip_converge"))
    assert {"numpy", "tqdm", "matplotlib", "pillow", "h5py", "safetensors"} <= used
    assert used - CORE == dist_names(HARNESS["dependencies"])
    assert "gradzip" in {requirements.Requirement(r).name for r in HARNESS["dependencies"]}


def test_costmodel_needs_only_the_core_dependencies():
    # costmodel_cli builds the harness's models on the meta device
    assert used_by(["gradzip.costmodel", "gradzip.costmodel.__main__", "gradzip.costmodel_cli",
                    "gradzip_converge.zoo", "gradzip_converge.models"]) <= CORE


def test_notebooks_extra_lists_what_the_notebooks_import():
    used = set()
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(nb.read_text())["cells"]:
            if cell["cell_type"] != "code":
                continue
            tree = ast.parse("".join(cell["source"]))
            used |= {distribution(b) for b, _, _ in imports("__main__", nb, tree)
                     if third_party(b)}
    assert used, "no imports found in notebooks/"
    have = dist_names(EXTRAS["notebooks"])
    assert used - CORE <= have
    assert {"nbconvert", "ipykernel"} <= have  # scripts/notebooks.sh executes them


def test_all_is_every_extra():
    everything = set().union(*(dist_names(v) for k, v in EXTRAS.items() if k != "all"))
    assert dist_names(EXTRAS["all"]) == everything


def test_requirements_pins_satisfy_the_dependencies():
    pins = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = requirements.Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", line
            pins[req.name.lower()] = spec.version
    for text in (PROJECT["dependencies"] + [r for v in EXTRAS.values() for r in v]
                 + HARNESS["dependencies"]):
        req = requirements.Requirement(text)
        if req.name == "gradzip":
            continue
        assert req.name.lower() in pins, f"{text}: not pinned in requirements.txt"
        assert req.specifier.contains(pins[req.name.lower()]), \
            f"{text}: requirements.txt pins {pins[req.name.lower()]}"


BLOCK = """
import sys
for m in {blocked!r}:
    sys.modules[m] = None


class Absent:  # the error an import of a top-level module that is not installed raises
    def find_spec(self, name, path=None, target=None):
        if name in {absent!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)


sys.meta_path.insert(0, Absent())
"""


def run_with_torch_alone(code: str, absent=()) -> subprocess.CompletedProcess:
    """Runs ``code`` in a fresh interpreter in which every package of the extras and of the
    harness's dependencies but torch (and the top-level modules ``absent``) is missing."""
    reverse = {d: m for m, d in DISTRIBUTIONS.items()}
    dists = set().union(*map(dist_names, EXTRAS.values()), dist_names(HARNESS["dependencies"]))
    blocked = sorted(reverse.get(d, d) for d in dists - CORE)
    setup = BLOCK.format(blocked=blocked, absent=list(absent))
    return subprocess.run([sys.executable, "-c", setup + code], capture_output=True, text=True,
                          timeout=300)


COSTMODEL = ("import gradzip, gradzip.ddp, gradzip.costmodel, gradzip.costmodel_cli\n"
             "from gradzip.costmodel_cli import main\n"
             "sys.exit(main(['--model', 'vit-t14', '--workers', '8', '--gbps', '10']))\n")


def test_gradzip_ddp_and_costmodel_need_torch_alone():
    r = run_with_torch_alone(COSTMODEL)
    assert r.returncode == 0, r.stderr
    assert "Break-even link rate" in r.stdout


def test_costmodel_without_the_harness_says_where_its_models_are():
    r = run_with_torch_alone(COSTMODEL, absent=["gradzip_converge"])
    assert r.returncode == 2
    assert "the models come with the convergence harness: pip install ./bench/harness" in r.stderr
    assert "Traceback" not in r.stderr
