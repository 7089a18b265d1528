"""The runnable examples of README.md and docs/*.md: every ```python block preceded by a line
``<!-- run: COMMAND -->`` is written to example.py and run as ``COMMAND example.py`` (e.g.
``torchrun --nproc-per-node 2``), as a user would copy it; it must exit 0 and, where it prints
``loss A -> B``, have trained (B < A / 2)."""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"<!-- run: (.+?) -->\n```python\n(.*?)```", re.S)


def examples():
    return [(cmd.strip(), code) for doc in DOCS for cmd, code in BLOCK.findall(doc.read_text())]


def _run(cmd, code, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(code)
    argv = shlex.split(cmd)
    if argv[0] == "torchrun":  # the venv's, on a free port
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", *argv[1:]]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    return subprocess.run([*argv, str(script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)


def test_the_readme_has_runnable_examples():
    assert any("accelerate" in code for _, code in examples())


@pytest.mark.parametrize("cmd,code", examples(), ids=lambda v: v.split("\n")[0][:40])
def test_readme_example_runs_and_trains(cmd, code, tmp_path):
    if "from accelerate" in code:
        pytest.importorskip("accelerate")
    done = _run(cmd, code, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    losses = re.search(r"loss ([0-9.]+) -> ([0-9.]+)", done.stdout)
    if losses:
        first, last = map(float, losses.groups())
        assert last < first / 2, done.stdout


def test_accelerate_clip_grad_norm_in_the_readme_loop_fails_at_the_first_step(tmp_path):
    pytest.importorskip("accelerate")
    (cmd, code), = [(c, k) for c, k in examples() if "from accelerate" in k]
    clipped = re.sub(r"# no accelerator\.clip_grad_norm_ here.*\n",
                     "accelerator.clip_grad_norm_(model.parameters(), 1.0)\n", code)
    clipped = clipped.replace("max_grad_norm=1.0", "")
    assert clipped != code
    done = _run(cmd, clipped, tmp_path)
    assert done.returncode != 0
    assert "max_grad_norm=C" in done.stderr, done.stderr[-3000:]
