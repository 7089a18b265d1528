"""bench/netem/time_to_loss.py on hand-made curves and step times: the target, the first
evaluation that reaches it, the hook each run maps to, and what it leaves unreached."""
import csv
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("time_to_loss", ROOT / "bench/netem/time_to_loss.py")
ttl = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ttl)


def test_hooks_of_the_harness_runs():
    assert ttl.hook_of("fp32") == "none"
    assert ttl.hook_of("bf16-noef") == "torch-bf16"
    assert ttl.hook_of("lowrank:4") == "powersgd:4"
    assert ttl.hook_of("int8+H10") == "local:int8:10"
    assert ttl.hook_of("int8+H50+ilr0.004+olr1+om0") == "local:int8:50"
    assert ttl.hook_of("topk:0.02:values=fp16+H50") == "local:topk:0.02:values=fp16:50"
    assert ttl.hook_of("sign") == "sign"


def _evals(folder, run, seed, losses):
    runs = folder / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    with open(runs / f"{run.replace(':', '_')}-s{seed}.evals.jsonl", "w") as f:
        for step, v in losses:
            f.write(json.dumps({"run": run, "seed": seed, "step": step, "val_loss": v}) + "\n")


def test_time_to_the_target_loss(tmp_path):
    runs = tmp_path / "suite"
    for seed, shift in ((0, 0.0), (1, 0.2)):  # fp32 ends at mean 2.1: target 2.1 * 1.05
        _evals(runs, "fp32", seed, [(100, 3.0 + shift), (200, 2.5 + shift), (300, 2.0 + shift)])
        _evals(runs, "int8+H10", seed, [(100, 2.9), (200, 2.15 + shift / 4), (300, 2.1)])
        _evals(runs, "sign", seed, [(100, 3.5), (200, 3.0), (300, 2.9)])
    netem = tmp_path / "netem"
    netem.mkdir()
    (netem / "results.csv").write_text("hook,step_time_s_median,bytes_per_step,x\n"
                                       "none,1.0,0,1\nlocal:int8:10,0.25,0,4\nsign,0.5,0,2\n")
    out = tmp_path / "out"
    assert ttl.main(["--runs", str(runs), "--netem", f"1gbit={netem}", "--out", str(out),
                     "--tolerance", "0.05"]) == 0
    with open(out / "time_to_loss.csv", newline="") as f:
        rows = {r["run"]: r for r in csv.DictReader(f)}
    assert rows["fp32"]["steps_to_target"] == "300"  # 2.1 <= 2.205 first at 300
    assert float(rows["fp32"]["seconds_at_1gbit"]) == pytest.approx(300.0)
    assert rows["int8+H10"]["steps_to_target"] == "200"  # mean 2.175 at 200
    assert float(rows["int8+H10"]["seconds_at_1gbit"]) == pytest.approx(200 * 0.25)
    assert rows["sign"]["steps_to_target"] == ""  # never reached
    md = (out / "time_to_loss.md").read_text()
    assert "not reached" in md and "(6.0x)" in md


def test_without_an_fp32_run_it_refuses(tmp_path):
    _evals(tmp_path / "suite", "sign", 0, [(100, 3.0)])
    assert ttl.main(["--runs", str(tmp_path / "suite"), "--netem", f"1gbit={tmp_path}",
                     "--out", str(tmp_path / "o")]) == 2
