"""Training runs end to end: exact resume from a checkpoint, the cache key, the CLI's cpu-smoke
suite and its outputs (over seeds, reproducible byte for byte, in parallel jobs), its progress
lines off a terminal and its Ctrl-C, the DDP mode under torchrun."""
import csv
import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from converge_util import Interrupt, stop_at
from gradzip_converge import provenance
from gradzip_converge.training import (RunConfig, RunFiles, compress_warmup_steps, load_data,
                                       lr_factor, optimizer_name, read_jsonl, train_simulated)

TINY = RunConfig(model="vit-t14", image_size=28, workers=2, batch_per_worker=2, steps=8,
                 warmup_steps=2, train_scenes=8, test_scenes=4, checkpoint_every=3,
                 eval_every=2, codec="int8", error_feedback=True)


def test_schedule_warms_up_then_decays():
    f = [lr_factor(s, 10, 100, 0.1) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[10:], f[11:]))
    assert f[-1] == pytest.approx(0.1, abs=1e-3)


def _losses(out, cfg=TINY):
    return [(r["step"], r["loss"], r["bytes"]) for r in read_jsonl(RunFiles(out, cfg).steps)]


def test_interrupted_run_resumes_exactly(tmp_path):
    torch.set_num_threads(1)  # same kernels in both runs
    data = load_data(TINY)
    whole = train_simulated(TINY, tmp_path / "a", data, torch.device("cpu"))

    with pytest.raises(Interrupt):  # after the checkpoint at 6: steps 6..7 are redone
        train_simulated(TINY, tmp_path / "b", data, torch.device("cpu"), progress=stop_at(7))
    assert (tmp_path / "b" / "checkpoints" / "int8-s0.pt").is_file()
    resumed = train_simulated(TINY, tmp_path / "b", data, torch.device("cpu"))
    assert _losses(tmp_path / "a") == _losses(tmp_path / "b")  # same steps, bit for bit
    evals = read_jsonl(RunFiles(tmp_path / "a", TINY).evals)
    assert [e["step"] for e in evals] == [2, 4, 6, 8]
    assert read_jsonl(RunFiles(tmp_path / "b", TINY).evals) == evals  # the one at 8 redone
    for k in ("abs_rel", "abs_rel_med", "rmse", "delta1", "bytes_per_step"):
        assert whole[k] == resumed[k], k
    assert whole["abs_rel_med"] == evals[-1]["abs_rel_med"]  # the result is the last evaluation
    assert not (tmp_path / "b" / "checkpoints" / "int8-s0.pt").exists()
    # a finished run is not redone; a changed setting is a new run
    assert train_simulated(TINY, tmp_path / "b", data, torch.device("cpu")) == resumed
    other = replace(TINY, steps=4)
    assert train_simulated(other, tmp_path / "b", data, torch.device("cpu"))["config"]["steps"] == 4


@pytest.mark.parametrize("codec,optimizer,warmup", [
    ("sign", "frozen-variance-adamw", TINY.warmup_steps),
    ("topk:0.01:values=fp16", "frozen-variance-adamw", TINY.warmup_steps),
    ("int8", "adamw", 0), ("bf16", "adamw", 0), ("fp32", "adamw", 0)])
def test_the_recipe_picks_the_optimizer_and_its_warmup(codec, optimizer, warmup):
    """Under "recipe" the ~30x codecs train with FrozenVarianceAdamW, whose variance is measured
    over the learning rate's warm-up; the others with AdamW on compressed gradients, compressed
    from the first step. The run keeps its plain name; a warm-up set explicitly wins."""
    cfg = replace(TINY, codec=codec)
    assert (optimizer_name(cfg), compress_warmup_steps(cfg)) == (optimizer, warmup)
    assert "+" not in cfg.name
    assert compress_warmup_steps(replace(cfg, compress_warmup=5)) == 5


@pytest.mark.parametrize("codec,optimizer", [
    ("topk:0.01:values=fp16", "compressed-sgd"), ("sign", "sgd"), ("int8", "sgd"),
    ("fp32", "sgd")])
def test_the_sgd_recipe_picks_compressed_sgd_for_topk_only(codec, optimizer):
    cfg = replace(TINY, codec=codec, optimizer_family="sgd")
    assert (optimizer_name(cfg), compress_warmup_steps(cfg)) == (optimizer, 0)
    dgc = replace(cfg, momentum_masking=True, local_clip_norm=2.0)
    if optimizer == "compressed-sgd":
        assert dgc.name == f"{codec}+mask+clip2" and optimizer_name(dgc) == optimizer
    else:  # the options belong to CompressedSGD: asking torch's SGD for them is an error
        with pytest.raises(ValueError, match="CompressedSGD's options"):
            optimizer_name(dgc)
    with pytest.raises(ValueError, match="optimizer_family"):
        optimizer_name(replace(cfg, optimizer_family="adam"))


def test_the_recipe_run_is_the_run_that_spells_it_out(tmp_path):
    """cpu-default's sign run under the recipe trains exactly as cpu-recipes' run that names the
    optimizer and warm-up."""
    torch.set_num_threads(1)
    recipe = replace(TINY, codec="sign")
    spelled = replace(recipe, optimizer="frozen-variance-adamw", compress_warmup=TINY.warmup_steps)
    data = load_data(recipe)
    a = train_simulated(recipe, tmp_path / "a", data, torch.device("cpu"))
    b = train_simulated(spelled, tmp_path / "b", data, torch.device("cpu"))
    assert _losses(tmp_path / "a", recipe) == _losses(tmp_path / "b", spelled)
    assert a["abs_rel"] == b["abs_rel"] and a["total_bytes"] == b["total_bytes"]


def test_frozen_variance_run_counts_its_uncompressed_warmup(tmp_path):
    """A run with a compression warm-up sends fp32 for its first steps: the whole run's ratio
    counts them, the ratio once compressing does not; checkpointed and resumed exactly."""
    torch.set_num_threads(1)
    cfg = replace(TINY, codec="sign", optimizer="frozen-variance-adamw", compress_warmup=4)
    assert cfg.name == "sign+frozen-variance-adamw+w4"
    data = load_data(cfg)
    res = train_simulated(cfg, tmp_path / "a", data, torch.device("cpu"))
    steps = read_jsonl(RunFiles(tmp_path / "a", cfg).steps)
    assert all(r["bytes"] == r["raw_bytes"] for r in steps[:4])  # exact averages: fp32 traffic
    assert all(r["bytes"] < r["raw_bytes"] / 10 for r in steps[4:])
    assert res["total_bytes"] == sum(r["bytes"] for r in steps)
    assert res["steady_ratio"] == pytest.approx(
        sum(r["raw_bytes"] for r in steps[4:]) / sum(r["bytes"] for r in steps[4:]))
    assert 1 < res["compression_ratio"] < res["steady_ratio"] / 2
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in steps)

    with pytest.raises(Interrupt):  # after the checkpoint at 3, inside the warm-up; then compressed
        train_simulated(cfg, tmp_path / "b", data, torch.device("cpu"), progress=stop_at(5))
    resumed = train_simulated(cfg, tmp_path / "b", data, torch.device("cpu"))
    assert _losses(tmp_path / "a", cfg) == _losses(tmp_path / "b", cfg)
    assert resumed["abs_rel"] == res["abs_rel"]


def test_a_bf16_warmup_counts_half_the_warmup_bytes(tmp_path):
    """``+wN:bf16``: the warm-up steps' buckets travel in bf16 (counted so), the compressed steps
    after it send what an fp32 warm-up's send."""
    torch.set_num_threads(1)
    fp32 = replace(TINY, codec="sign", optimizer="frozen-variance-adamw", compress_warmup=4)
    cfg = replace(fp32, warmup_codec="bf16")
    assert cfg.name == "sign+frozen-variance-adamw+w4:bf16"
    data = load_data(cfg)
    res = train_simulated(cfg, tmp_path / "a", data, torch.device("cpu"))
    ref = train_simulated(fp32, tmp_path / "b", data, torch.device("cpu"))
    steps = read_jsonl(RunFiles(tmp_path / "a", cfg).steps)
    fp32_steps = read_jsonl(RunFiles(tmp_path / "b", fp32).steps)
    assert all(0.45 < r["bytes"] / r["raw_bytes"] < 0.55 for r in steps[:4])
    assert [r["bytes"] for r in steps[4:]] == [r["bytes"] for r in fp32_steps[4:]]
    assert res["compression_ratio"] > ref["compression_ratio"]
    assert res["steady_ratio"] == ref["steady_ratio"]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in steps)


def test_result_under_another_code_version_is_redone(tmp_path):
    torch.set_num_threads(1)
    cfg = replace(TINY, steps=4)
    data = load_data(cfg)
    first = train_simulated(cfg, tmp_path, data, torch.device("cpu"))
    assert first["environment"]["code"] and first["environment"]["torch_threads"] == 1
    trained = []
    assert train_simulated(cfg, tmp_path, data, torch.device("cpu"),
                           progress=lambda s, loss: trained.append(s)) == first
    assert trained == []  # finished under the current key: not redone
    files = RunFiles(tmp_path, cfg)
    stale = json.loads(files.result.read_text())
    stale["environment"]["code"] = "0123456789abcdef"  # as if written by other code
    files.result.write_text(json.dumps(stale))
    again = train_simulated(cfg, tmp_path, data, torch.device("cpu"),
                            progress=lambda s, loss: trained.append(s))
    assert trained == [1, 2, 3, 4]  # retrained, from scratch, to the same result
    for k in ("abs_rel", "abs_rel_med", "bytes_per_step", "final_loss"):
        assert again[k] == first[k], k
    assert again["environment"] == first["environment"] and files.done() == again
    assert len(read_jsonl(files.steps)) == 4  # the stale run's log lines are gone


def test_code_hash_covers_the_library_and_the_harness(tmp_path, monkeypatch):
    """The code part of the key is both packages: copies of them hash alike, and a change to a .py
    file of either one changes it."""
    import gradzip

    copies = {}
    for name, src in (("gradzip", gradzip.__file__), ("gradzip_converge", provenance.__file__)):
        copies[name] = shutil.copytree(Path(src).parent, tmp_path / name,
                                       ignore=shutil.ignore_patterns("__pycache__"))
    here = provenance.code_hash()
    monkeypatch.setattr(provenance, "gradzip",
                        SimpleNamespace(__file__=str(copies["gradzip"] / "__init__.py")))
    monkeypatch.setattr(provenance, "__file__", str(copies["gradzip_converge"] / "provenance.py"))
    seen = [provenance.code_hash()]
    assert seen == [here]
    for changed in (copies["gradzip"] / "wire.py", copies["gradzip_converge"] / "suites.py"):
        changed.write_text(changed.read_text() + "# changed\n")
        seen.append(provenance.code_hash())
    assert len(set(seen)) == 3


def _cli(args, timeout=600, env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "gradzip_converge", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


SMOKE = ["--suite", "cpu-smoke", "--seeds", "2"]
DETERMINISTIC = ("summary.csv", "aggregate.csv", "summary.md", "evals.jsonl")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """The cpu-smoke suite over seeds 0 and 1, one job after the other."""
    out = tmp_path_factory.mktemp("smoke")
    r = _cli([*SMOKE, "--out", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r.stdout


def _csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_cpu_smoke_suite(smoke):
    out, stdout = smoke
    assert "| run | bytes/step | ratio, whole run | ratio, compressing | AbsRel |" in stdout
    # stdout is not a terminal: one line per run start, evaluation and end, no progress bar
    progress = [line.split(": ", 1) for line in stdout.splitlines() if " s0: " in line or " s1: " in line]
    assert [(name.strip(), what.split(" loss")[0]) for name, what in progress] == [
        (f"{run} s{seed}", what) for seed in (0, 1) for run in ("fp32", "int8")
        for what in ("training, 30 steps", "step 10/30", "step 20/30", "step 30/30", "done")]
    assert all(" AbsRel " in what for _, what in progress if what.startswith("step"))
    rows = _csv(out / "summary.csv")
    assert list(rows[0]) == ["run", "codec", "error_feedback", "seed", "bytes_per_step",
                             "total_bytes", "compression_ratio", "steady_ratio", "abs_rel",
                             "abs_rel_med", "sq_rel", "rmse", "rmse_log", "delta1", "delta2",
                             "delta3", "final_loss",
                             "abs_rel_vs_fp32_pct", "abs_rel_med_last3_vs_fp32_pct",
                             "steps_to_target", "code"]
    table = {(r["run"], int(r["seed"])): r for r in rows}
    assert list(table) == [("fp32", 0), ("fp32", 1), ("int8", 0), ("int8", 1)]
    for seed in (0, 1):
        fp32, int8 = table["fp32", seed], table["int8", seed]
        assert float(fp32["compression_ratio"]) == pytest.approx(1.0)
        assert 3.5 < float(int8["compression_ratio"]) < 4.0  # 1 byte + block scales vs 4
        assert int(int8["bytes_per_step"]) < int(fp32["bytes_per_step"])
        for row in (fp32, int8):  # no compression warm-up: the whole run compresses alike
            assert float(row["steady_ratio"]) == pytest.approx(float(row["compression_ratio"]))
            assert int(row["total_bytes"]) == pytest.approx(30 * int(row["bytes_per_step"]), abs=30)
        assert float(fp32["abs_rel_vs_fp32_pct"]) == 0
        assert float(int8["abs_rel_vs_fp32_pct"]) == pytest.approx(
            100 * (float(int8["abs_rel"]) / float(fp32["abs_rel"]) - 1), abs=1e-3)
        assert fp32["steps_to_target"] in ("10", "20", "30")  # fp32 reaches its own final
        # the tail: abs_rel_med averaged over the last three evaluations (steps 10, 20, 30)
        evals = [e for e in read_jsonl(out / "evals.jsonl") if e["seed"] == seed]
        tail = {run: sum(e["abs_rel_med"] for e in evals if e["run"] == run) / 3
                for run in ("fp32", "int8")}
        assert float(fp32["abs_rel_med_last3_vs_fp32_pct"]) == 0
        assert float(int8["abs_rel_med_last3_vs_fp32_pct"]) == pytest.approx(
            100 * (tail["int8"] / tail["fp32"] - 1), abs=1e-3)
    assert table["fp32", 0]["abs_rel"] != table["fp32", 1]["abs_rel"]  # other weights, data
    for row in rows:
        assert 0 < float(row["abs_rel"]) < 10 and 0 <= float(row["delta1"]) <= 1
        assert 0 < float(row["abs_rel_med"]) < 10
    agg = {r["run"]: r for r in _csv(out / "aggregate.csv")}
    assert list(agg) == ["fp32", "int8"]
    a = agg["int8"]
    x = [float(table["int8", s]["abs_rel"]) for s in (0, 1)]
    assert a["seeds"] == "2" and float(a["abs_rel_mean"]) == pytest.approx(sum(x) / 2, rel=1e-5)
    assert float(a["abs_rel_std"]) == pytest.approx(abs(x[0] - x[1]) / 2**0.5, rel=1e-4)  # ddof 1
    assert a["abs_rel_vs_fp32_pct_mean"] and a["target_reached"] in ("0", "1", "2")
    timings = _csv(out / "timings.csv")
    assert list(timings[0]) == ["run", "seed", "wall_s", "codec_ms"] and len(timings) == 4
    assert all(float(t["wall_s"]) > 0 for t in timings)
    steps = read_jsonl(out / "steps.jsonl")
    assert len(steps) == 4 * 30 and {(s["run"], s["seed"]) for s in steps} == set(table)
    evals = read_jsonl(out / "evals.jsonl")
    assert [(e["run"], e["seed"], e["step"]) for e in evals] == [
        (run, seed, step) for run, seed in table for step in (10, 20, 30)]
    assert json.loads((out / "suite.json").read_text())["environment"]["torch_threads"] == 1
    for name in ("summary.md", "abs_rel_vs_bytes.png", "loss_curves.png", "steps_to_target.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "steps_to_target.png").read_bytes()[:4] == b"\x89PNG"
    # rerunning finds every run finished and only reports, to the same bytes
    before = {n: (out / n).read_bytes() for n in DETERMINISTIC}
    again = _cli([*SMOKE, "--out", str(out)], timeout=120)
    assert again.returncode == 0 and len(read_jsonl(out / "steps.jsonl")) == 120
    assert {n: (out / n).read_bytes() for n in DETERMINISTIC} == before


def test_results_are_reproducible_byte_for_byte_and_in_parallel(smoke, tmp_path):
    # a fresh process and a fresh folder (no cached scenes), two jobs at once
    r = _cli([*SMOKE, "--out", str(tmp_path), "--jobs", "2"])
    assert r.returncode == 0, r.stderr[-3000:]
    for name in DETERMINISTIC:
        assert (tmp_path / name).read_bytes() == (smoke[0] / name).read_bytes(), name


def test_ctrl_c_keeps_finished_runs_and_exits_130_without_traceback(tmp_path):
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) during two parallel jobs: one
    line saying how to resume, exit code 130, no traceback from the pool's workers, no leaked
    semaphores."""
    cmd = [sys.executable, "-m", "gradzip_converge", "--suite", "cpu-smoke", "--out", str(tmp_path),
           "--jobs", "2"]
    # SIGINT at its default in the child: a test run from a background job inherits it ignored,
    # and Python then installs no KeyboardInterrupt handler
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert "training" in p.stdout.readline()  # a run has started in a worker
        os.killpg(p.pid, signal.SIGINT)
        _, stderr = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 130, stderr[-3000:]
    assert stderr.strip().splitlines() == [
        "interrupted: finished runs are kept; run the same command again to resume the others "
        "from their last checkpoints"], stderr[-3000:]


def test_cli_errors_are_clear(tmp_path):
    r = _cli(["--suite", "nope", "--out", str(tmp_path)], timeout=60)
    assert r.returncode != 0 and "unknown suite 'nope'" in r.stderr
    # neither one of the suite's runs nor a codec spec (a codec spec runs on the suite's settings)
    r = _cli(["--suite", "cpu-smoke", "--out", str(tmp_path), "--codecs", "fp17"], timeout=60)
    assert r.returncode != 0 and "fp17 not in this suite" in r.stderr
    assert "not a codec spec" in r.stderr
    r = _cli(["--list"], timeout=60)
    assert r.returncode == 0 and "cpu-default" in r.stdout


@pytest.mark.parametrize("strategy,extra", [("ddp", []), ("fsdp", []),
                                            ("fsdp", ["--param-codec", "int8"])])
def test_distributed_modes_under_torchrun(tmp_path, strategy, extra):
    # --standalone: torchrun takes a free port itself (a port picked beforehand can be taken)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "gradzip_converge", "--strategy", strategy,
           "--suite", "cpu-smoke",
           "--out", str(tmp_path), "--steps", "4", "--quiet"] + extra
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
    assert f"{strategy.upper()}, gloo, world 2" in stdout
    with open(tmp_path / strategy / "summary.csv") as f:
        rows = {row["codec"]: row for row in csv.DictReader(f)}
    assert float(rows["int8"]["compression_ratio"]) > 3.5
    if extra:  # the parameter codec is part of every run's name
        assert rows["int8"]["run"] == "int8+params=int8", rows["int8"]["run"]


def test_optimizer_and_warmup_options_reach_the_runs_that_do_not_set_them():
    """--optimizer and --compress-warmup set the runs of a codec spec (and the suite's runs without
    settings of their own); the run names say so."""
    from gradzip_converge.cli import overrides, parse_args, select
    from gradzip_converge.suites import get_suite

    args = parse_args(["--suite", "cpu-recipes", "--out", "x", "--optimizer",
                       "frozen-variance-adamw", "--compress-warmup", "7",
                       "--codecs", "lowrank:2,fp32,sign+frozen-variance-adamw+w60"])
    suite = get_suite("cpu-recipes")
    runs = select(suite.configs(**overrides(args)), args.codecs,
                  replace(suite.base, **overrides(args)))
    assert [r.name for r in runs] == ["lowrank:2+frozen-variance-adamw+w7",
                                      "fp32+frozen-variance-adamw+w7",
                                      "sign+frozen-variance-adamw+w60"]
    assert compress_warmup_steps(runs[0]) == 7 and optimizer_name(runs[0]) == "frozen-variance-adamw"
    with pytest.raises(SystemExit):
        parse_args(["--out", "x", "--optimizer", "lamb"])


def test_two_level_runs_are_named_and_refused_where_they_cannot_run(tmp_path):
    from gradzip_converge.cli import overrides, parse_args, select
    from gradzip_converge.suites import get_suite

    args = parse_args(["--suite", "cpu-default", "--out", "x", "--ranks-per-node", "2",
                       "--codecs", "fp32,int8,topk:0.01"])
    suite = get_suite("cpu-default")
    runs = select(suite.configs(**overrides(args)), args.codecs,
                  replace(suite.base, **overrides(args)))
    assert [r.name for r in runs] == ["fp32", "int8+2x2", "topk:0.01+2x2"]
    # the sign recipe is FrozenVarianceAdamW, whose state is the whole bucket's
    r = _cli(["--suite", "cpu-smoke", "--out", str(tmp_path), "--codecs", "sign",
              "--ranks-per-node", "2"], timeout=60)
    assert r.returncode != 0 and "--optimizer adamw" in r.stderr
    r = _cli(["--suite", "cpu-smoke", "--out", str(tmp_path), "--codecs", "int8",
              "--ranks-per-node", "2", "--strategy", "ddp"], timeout=60)
    assert r.returncode != 0 and "simulated workers" in r.stderr


def test_the_fsdp_recipe_is_torchs_adamw_unless_the_run_names_the_frozen_variance_adam():
    """Under FSDP (sharded) the recipe of sign stays torch's AdamW (it trained sign better there);
    a run that names FrozenVarianceAdamW gets it; CompressedSGD, which has no FSDP form, becomes
    torch's SGD."""
    from gradzip.optim import FrozenVarianceAdamW
    from gradzip_converge.training import make_optimizer

    model = torch.nn.Linear(3, 2)
    sign = replace(RunConfig(), codec="sign", error_feedback=True)
    assert optimizer_name(sign) == "frozen-variance-adamw"
    assert type(make_optimizer(sign, model, sharded=True)[0]) is torch.optim.AdamW
    assert type(make_optimizer(sign, model)[0]) is FrozenVarianceAdamW
    named = replace(sign, optimizer="frozen-variance-adamw")
    assert type(make_optimizer(named, model, sharded=True)[0]) is FrozenVarianceAdamW
    sgd = replace(sign, codec="topk:0.01", optimizer="compressed-sgd")
    assert type(make_optimizer(sgd, model, sharded=True)[0]) is torch.optim.SGD
