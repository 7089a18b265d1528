"""Training runs end to end: exact resume from a checkpoint, the CLI's cpu-smoke suite and its
outputs, the DDP mode under torchrun."""
import csv
import json
import os
import signal
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from dist_util import free_port
from gradzip.converge.training import RunConfig, load_data, lr_factor, train_simulated

TINY = RunConfig(model="vit-t14", image_size=28, workers=2, batch_per_worker=2, steps=8,
                 warmup_steps=2, train_scenes=8, test_scenes=4, checkpoint_every=3,
                 codec="int8", error_feedback=True)


def test_schedule_warms_up_then_decays():
    f = [lr_factor(s, 10, 100, 0.1) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[10:], f[11:]))
    assert f[-1] == pytest.approx(0.1, abs=1e-3)


def _losses(out):
    recs = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["bytes"]) for r in recs]


class Interrupt(Exception):
    pass


def test_interrupted_run_resumes_exactly(tmp_path):
    torch.set_num_threads(1)  # same kernels in both runs
    data = load_data(TINY)
    whole = train_simulated(TINY, tmp_path / "a", data, torch.device("cpu"))

    def stop_at_7(step, loss):
        if step == 7:  # after the checkpoint at 6: steps 6..7 are redone
            raise Interrupt

    with pytest.raises(Interrupt):
        train_simulated(TINY, tmp_path / "b", data, torch.device("cpu"), progress=stop_at_7)
    assert (tmp_path / "b" / "checkpoints" / "int8.pt").is_file()
    resumed = train_simulated(TINY, tmp_path / "b", data, torch.device("cpu"))
    assert _losses(tmp_path / "a") == _losses(tmp_path / "b")  # same steps, bit for bit
    for k in ("abs_rel", "rmse", "delta1", "bytes_per_step"):
        assert whole[k] == resumed[k], k
    assert not (tmp_path / "b" / "checkpoints" / "int8.pt").exists()
    # a finished run is not redone; a changed setting is a new run
    assert train_simulated(TINY, tmp_path / "b", data, torch.device("cpu")) == resumed
    other = replace(TINY, steps=4)
    assert train_simulated(other, tmp_path / "b", data, torch.device("cpu"))["config"]["steps"] == 4


def _cli(args, timeout=600, env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "gradzip.converge", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_cpu_smoke_suite(tmp_path):
    r = _cli(["--suite", "cpu-smoke", "--out", str(tmp_path), "--quiet"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| codec | error_feedback | bytes_per_step |" in r.stdout  # the table is printed
    with open(tmp_path / "summary.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["codec", "error_feedback", "bytes_per_step", "compression_ratio",
                       "abs_rel", "rmse", "delta1", "wall_s"]
    table = {row[0]: dict(zip(rows[0], row)) for row in rows[1:]}
    assert set(table) == {"fp32", "int8"}
    assert float(table["fp32"]["compression_ratio"]) == pytest.approx(1.0)
    assert 3.5 < float(table["int8"]["compression_ratio"]) < 4.0  # 1 byte + block scales vs 4
    assert int(table["int8"]["bytes_per_step"]) < int(table["fp32"]["bytes_per_step"])
    for row in table.values():
        assert 0 < float(row["abs_rel"]) < 10 and 0 <= float(row["delta1"]) <= 1
    steps = [json.loads(x) for x in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert len(steps) == 2 * 30 and {s["codec"] for s in steps} == {"fp32", "int8"}
    for name in ("summary.md", "abs_rel_vs_bytes.png", "loss_curves.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert (tmp_path / "abs_rel_vs_bytes.png").read_bytes()[:4] == b"\x89PNG"
    # rerunning finds both runs finished and only reports
    again = _cli(["--suite", "cpu-smoke", "--out", str(tmp_path), "--quiet"], timeout=120)
    assert again.returncode == 0 and len((tmp_path / "steps.jsonl").read_text().splitlines()) == 60


def test_cli_errors_are_clear(tmp_path):
    r = _cli(["--suite", "nope", "--out", str(tmp_path)], timeout=60)
    assert r.returncode != 0 and "unknown suite 'nope'" in r.stderr
    r = _cli(["--suite", "cpu-smoke", "--out", str(tmp_path), "--codecs", "fp16"], timeout=60)
    assert r.returncode != 0 and "fp16 not in this suite" in r.stderr
    r = _cli(["--list"], timeout=60)
    assert r.returncode == 0 and "cpu-default" in r.stdout


def test_ddp_mode_under_torchrun(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), "-m", "gradzip.converge", "--ddp", "--suite", "cpu-smoke",
           "--out", str(tmp_path), "--steps", "4", "--quiet"]
    # own session: on a timeout the whole group (torchrun and its ranks) is killed, not orphaned
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, GLOO_SOCKET_IFNAME="lo"), start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise
    assert p.returncode == 0, stderr[-3000:]
    assert "DDP, gloo, world 2" in stdout
    with open(tmp_path / "ddp" / "summary.csv") as f:
        rows = {row["codec"]: row for row in csv.DictReader(f)}
    assert float(rows["int8"]["compression_ratio"]) > 3.5
