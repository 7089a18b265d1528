"""The harness's local-steps runs (RunConfig.local_steps): bytes only on sync steps, against the
per-step fp32 all-reduce; evaluations of the anchor; an exact resume; what they refuse."""
import math
from dataclasses import replace

import pytest
import torch

from converge_util import Interrupt, stop_at
from gradzip_converge.cli import main
from gradzip_converge.compression import Reducer
from gradzip_converge.local_training import train_local
from gradzip_converge.suites import get_suite
from gradzip_converge.text import STDLIB_DOCSTRINGS
from gradzip_converge.training import (RunConfig, RunFiles, load_data, make_model, optimizer_name,
                                       read_jsonl)

TINY = RunConfig(model="lm-t", data=STDLIB_DOCSTRINGS, workers=2, batch_per_worker=2, steps=8,
                 warmup_steps=2, checkpoint_every=3, eval_every=4, codec="int8",
                 local_steps=2)


@pytest.fixture(scope="module")
def data():
    return load_data(TINY)


def test_local_run_sends_on_sync_steps_only_and_resumes_exactly(tmp_path, data):
    torch.set_num_threads(1)
    assert optimizer_name(TINY) == "adamw"  # torch's optimizer trains each replica
    assert TINY.name == "int8+H2+ilr0.001"
    whole = train_local(TINY, tmp_path / "a", data, torch.device("cpu"))
    steps = read_jsonl(RunFiles(tmp_path / "a", TINY).steps)
    # the fp32 baseline's bytes of a step, measured by the per-step reducer
    params = [p for p in make_model(TINY, torch.device("cpu")).parameters()]
    fp32 = Reducer("fp32", 2, param_numels=[p.numel() for p in params])
    fp32.reduce([torch.zeros(sum(p.numel() for p in params))] * 2)
    assert all(r["raw_bytes"] == fp32.raw_bytes_per_step for r in steps)
    assert [r["synced"] for r in steps] == [s % 2 == 1 for s in range(8)]
    assert all((r["bytes"] > 0) == r["synced"] for r in steps)
    assert 3.0 < steps[1]["raw_bytes"] / steps[1]["bytes"] < 4.0  # int8 of the outer gradient
    assert whole["compression_ratio"] == pytest.approx(
        sum(r["raw_bytes"] for r in steps) / sum(r["bytes"] for r in steps))
    assert whole["compression_ratio"] > 6.0  # every other step sends nothing
    evals = read_jsonl(RunFiles(tmp_path / "a", TINY).evals)
    assert [e["step"] for e in evals] == [4, 8]
    assert whole["val_loss"] == evals[-1]["val_loss"] < math.log(256)

    with pytest.raises(Interrupt):  # after the checkpoint at 3 (mid-interval): 3..4 are redone
        train_local(TINY, tmp_path / "b", data, torch.device("cpu"), progress=stop_at(5))
    resumed = train_local(TINY, tmp_path / "b", data, torch.device("cpu"))
    assert [(r["step"], r["loss"], r["bytes"]) for r in steps] == [
        (r["step"], r["loss"], r["bytes"]) for r in read_jsonl(RunFiles(tmp_path / "b", TINY).steps)]
    assert resumed["val_loss"] == whole["val_loss"]


def test_local_runs_are_named_apart_and_refused_where_they_cannot_run(tmp_path):
    assert replace(TINY, outer_lr=1.0, outer_momentum=0.0, lr=4e-3).name == \
        "int8+H2+ilr0.004+olr1+om0"
    assert replace(TINY, local_steps=0).name == "int8"
    suite = get_suite("cpu-lm-local")
    assert {c.local_steps for c in suite.configs()} == {0, 10, 50}
    with pytest.raises(SystemExit, match="simulated workers only"):
        main(["--suite", "cpu-lm-local", "--out", str(tmp_path), "--codecs", "int8+H10+ilr0.002",
              "--strategy", "ddp"])
