"""Smoke test of bench/netem/run.sh: a tiny 2-rank run over a shaped veth between two network
namespaces, its cleanup on interruption, and its argument checks. The namespace tests skip, with
the reason, where the machine does not allow `ip netns` (not root, no iproute2, no CAP_SYS_ADMIN)."""

import csv
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "bench" / "netem" / "run.sh"


def _netns_unavailable() -> str | None:
    """The reason `ip netns` cannot be used here, or None."""
    if os.geteuid() != 0:
        return "not root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' not installed (iproute2)"
    probe = f"gzprobe-{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"'ip netns add' not permitted: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


REASON = _netns_unavailable()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"netem smoke test: {REASON}")


def _env():
    return dict(os.environ, PYTHON=sys.executable)


def _our_namespaces(pid: int) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.split()[0].endswith(f"-{pid}")]


@needs_netns
def test_tiny_run_writes_results_and_cleans_up(tmp_path):
    out = tmp_path / "netem"
    hooks = ["none", "int8", "topk:0.01", "fsdp-none", "fsdp-int8", "fsdp-int8+params=bf16"]
    p = subprocess.Popen(["bash", str(RUN), "--rate", "10gbit", "--out",
                          str(out), "--model", "vit-t14", "--size", "56", "--steps", "2",
                          "--warmup", "2", "--hooks", ",".join(hooks), "--time-limit", "240"],
                         env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log, _ = p.communicate(timeout=300)
    assert p.returncode == 0, log
    assert _our_namespaces(p.pid) == [], "namespaces left behind"
    with open(out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["hook", "step_time_s_median", "bytes_per_step", "speedup_vs_allreduce"]
    by = {r["hook"]: r for r in rows}
    assert list(by) == hooks
    assert float(by["none"]["speedup_vs_allreduce"]) == pytest.approx(1.0)
    sent = {h: float(by[h]["bytes_per_step"]) for h in hooks}
    # vit-t14 has ~0.95M parameters: plain all-reduce sends ~3.8 MB per step from each rank
    assert 3.5e6 < sent["none"] < 4.5e6
    assert sent["int8"] < 0.35 * sent["none"] and sent["topk:0.01"] < 0.05 * sent["none"]
    # FSDP: two fp32 all-gathers of the parameters (forward, backward) and one reduce-scatter of
    # the gradient per step; int8 shrinks only the reduce-scatter (to about a quarter)
    assert float(by["fsdp-none"]["speedup_vs_allreduce"]) == pytest.approx(1.0)
    assert sent["fsdp-int8"] < 0.85 * sent["fsdp-none"]
    # +params=bf16: the all-gathers, two thirds of fsdp-int8's bytes, in half the bytes
    assert sent["fsdp-int8+params=bf16"] < 0.8 * sent["fsdp-int8"]
    md = (out / "results.md").read_text()
    assert "predicted comm s" in md and "## Targets" in md
    assert (out / "costmodel.csv").exists()


@needs_netns
def test_language_model_and_local_steps(tmp_path):
    """--model lm-t (the harness's text and batches) and a local:CODEC:H hook: no DDP, a sync of
    the int8 outer gradient every 2 steps, so about an eighth of the all-reduce's bytes."""
    out = tmp_path / "netem"
    hooks = ["none", "local:int8:2"]
    r = subprocess.run(["bash", str(RUN), "--rate", "10gbit", "--out", str(out), "--model", "lm-t",
                        "--steps", "4", "--warmup", "2", "--hooks", ",".join(hooks),
                        "--time-limit", "240"], env=_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    with open(out / "results.csv", newline="") as f:
        sent = {row["hook"]: float(row["bytes_per_step"]) for row in csv.DictReader(f)}
    assert 0.08 * sent["none"] < sent["local:int8:2"] < 0.2 * sent["none"]
    assert "local:int8:2" in (out / "results.md").read_text()


@needs_netns
def test_two_nodes_of_two_ranks(tmp_path):
    """--ranks-per-node 2: two ranks in each namespace, the flat int8 hook against the two-level
    one, which sends one node's int8 shards over the link instead of each rank's: about half the
    bytes leave a node."""
    out = tmp_path / "netem"
    hooks = ["int8", "two-level:int8"]
    r = subprocess.run(["bash", str(RUN), "--rate", "10gbit", "--out", str(out), "--model",
                        "vit-t14", "--size", "56", "--steps", "2", "--warmup", "2", "--hooks",
                        ",".join(hooks), "--ranks-per-node", "2", "--time-limit", "280"],
                       env=_env(), capture_output=True, text=True, timeout=320)
    assert r.returncode == 0, r.stdout + r.stderr
    with open(out / "results.csv", newline="") as f:
        sent = {row["hook"]: float(row["bytes_per_step"]) for row in csv.DictReader(f)}
    assert 0.3 * sent["int8"] < sent["two-level:int8"] < 0.75 * sent["int8"], sent
    md = (out / "results.md").read_text()
    assert "4 ranks (Gloo, 2 per network namespace)" in md and "the flat int8 step" in md


@needs_netns
def test_interrupt_removes_namespaces(tmp_path):
    # SIGINT at its default in the child: a test run from a background job inherits it ignored,
    # and bash cannot trap a signal ignored at entry
    p = subprocess.Popen(["bash", str(RUN), "--rate", "1gbit", "--out", str(tmp_path / "x"),
                          "--model", "vit-t14", "--size", "56", "--hooks", "none"],
                         env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while not (tmp_path / "x" / "logs" / "none.rank0.log").exists():
        assert time.monotonic() < deadline and p.poll() is None, "run.sh did not start its ranks"
        time.sleep(0.2)
    assert len(_our_namespaces(p.pid)) == 2
    p.send_signal(signal.SIGINT)
    assert p.wait(timeout=60) != 0
    assert _our_namespaces(p.pid) == []


@pytest.mark.parametrize("args, message", [
    (["--out", "x"], "usage"),
    (["--rate", "fast", "--out", "x"], "--rate fast"),
    (["--rate", "1gbit", "--out", "x", "--delay", "soon"], "--delay soon"),
    (["--rate", "1gbit", "--out", "x", "--steps", "-1"], "--steps"),
    (["--rate", "1gbit", "--out", "x", "--bogus"], "unknown argument"),
    (["--rate", "1gbit", "--out", "x", "--hooks", "none,zstd"], "hook 'zstd'"),
    (["--rate", "1gbit", "--out", "x", "--hooks", "local:int8:0"], "local:CODEC:H"),
    (["--rate", "1gbit", "--out", "x", "--hooks", "local:int9:5"], "int9"),
])
def test_bad_arguments_exit_2(args, message):
    r = subprocess.run(["bash", str(RUN), *args], env=_env(), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2
    assert message in r.stderr
