"""The language-model task of the convergence harness: its text, its model, its batches, a tiny run
end to end (recipe, resume, the summary's val-loss columns) and what it refuses."""
import csv
import hashlib
import math
from dataclasses import replace

import pytest
import torch

from converge_util import Interrupt, stop_at
from gradzip_converge import report
from gradzip_converge.char_lm import LM_CONFIGS, VOCAB, CharLM
from gradzip_converge.output import summarise
from gradzip_converge.provenance import code_hash
from gradzip_converge.suites import get_suite
from gradzip_converge.tasks import DEPTH, LANGUAGE, STRIDE, task_of, windows
from gradzip_converge.text import STDLIB_DOCSTRINGS, docstring_text, fingerprint, load_text
from gradzip_converge.training import (RunConfig, RunFiles, batch_indices, compress_warmup_steps,
                                       load_data, make_model, optimizer_name, read_jsonl,
                                       train_simulated)

TINY = RunConfig(model="lm-t", data=STDLIB_DOCSTRINGS, workers=2, batch_per_worker=2, steps=8,
                 warmup_steps=2, checkpoint_every=3, eval_every=2, codec="sign")


@pytest.fixture(scope="module")
def data():
    return load_data(TINY)


def test_docstrings_are_read_in_path_order_without_tests_or_site_packages(tmp_path):
    for rel, doc in [("b.py", "B."), ("a/z.py", "AZ."), ("a.py", "A."), ("test/t.py", "T."),
                     ("site-packages/p.py", "P."), ("a/tests/u.py", "U.")]:
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f'"""{doc}"""\nclass C:\n    """{doc} class."""\n    def f(self):\n'
                        f'        """{doc} method."""\n')
    (tmp_path / "broken.py").write_text('"""Never read."""\ndef (:\n')  # skipped, not an error
    text = docstring_text(tmp_path).decode()
    assert text.split("\n\n") == [f"{d}{s}" for d in ("AZ.", "A.", "B.")
                                  for s in ("", " class.", " method.")]
    assert docstring_text(tmp_path) == text.encode()


def test_the_stdlib_text_is_real_prose_fingerprinted_and_split(data):
    text = load_text(STDLIB_DOCSTRINGS)
    assert len(text) > 500_000 and b"Return " in text
    assert sum(b < 128 for b in text[:100_000]) > 99_000  # English: ASCII but for a few bytes
    fp = fingerprint(STDLIB_DOCSTRINGS)
    assert fp == {"text": STDLIB_DOCSTRINGS, "bytes": len(text),
                  "sha256": hashlib.sha256(text).hexdigest()}
    train, val = data[0]["text"], data[1]["text"]
    assert train.dtype == torch.uint8 and len(train) + len(val) == len(text)
    assert len(val) == math.ceil(0.1 * len(text))  # the last tenth, held out
    assert bytes(val[:1000].tolist()) == text[len(train):len(train) + 1000]
    with pytest.raises(ValueError, match="unknown text"):
        load_text("shakespeare")


@torch.no_grad()
def test_model_shapes_causality_and_initial_loss():
    for name in LM_CONFIGS:
        torch.manual_seed(0)
        model = CharLM(name)
        ctx = model.cfg.context
        x = torch.randint(VOCAB, (3, ctx))
        logits = model(x)
        assert logits.shape == (3, ctx, VOCAB)
        # small initial weights: every byte about equally likely
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.roll(-1, 1).flatten())
        assert abs(float(loss) - math.log(VOCAB)) < 0.05, (name, float(loss))
        torch.manual_seed(0)
        assert torch.equal(CharLM(name)(x), logits)  # the seed decides the weights
        y = x.clone()
        y[:, ctx // 2:] = (y[:, ctx // 2:] + 1) % VOCAB
        assert torch.equal(model(y)[:, :ctx // 2], logits[:, :ctx // 2])  # sees no later byte
        with pytest.raises(ValueError, match="longer than the context"):
            model(torch.zeros(1, ctx + 1, dtype=torch.long))


def test_batches_are_windows_chosen_by_seed_and_step(data):
    train = data[0]["text"]
    n = LANGUAGE.train_size(TINY, train=data[0])
    ctx = LM_CONFIGS["lm-t"].context
    assert STRIDE * (n - 1) + ctx + 1 <= len(train) < STRIDE * n + ctx + 1  # every window fits
    idx = batch_indices(TINY.seed, 5, n, 4)
    assert torch.equal(idx, batch_indices(TINY.seed, 5, n, 4))
    assert not torch.equal(idx, batch_indices(TINY.seed, 6, n, 4))
    assert not torch.equal(idx, batch_indices(TINY.seed + 1, 5, n, 4))
    w = windows(train, STRIDE * idx, ctx + 1)
    assert w.shape == (4, ctx + 1) and w.dtype == torch.long
    assert torch.equal(w[1], train[STRIDE * idx[1]:STRIDE * idx[1] + ctx + 1].long())


def test_tiny_run_trains_under_the_recipe_and_resumes_exactly(tmp_path, data):
    """sign under "recipe": the frozen-variance Adam after an uncompressed warm-up as long as the
    learning rate's, bytes counted; interrupted after a checkpoint and resumed bit for bit."""
    torch.set_num_threads(1)
    assert (optimizer_name(TINY), compress_warmup_steps(TINY)) == ("frozen-variance-adamw", 2)
    whole = train_simulated(TINY, tmp_path / "a", data, torch.device("cpu"))
    steps = read_jsonl(RunFiles(tmp_path / "a", TINY).steps)
    assert all(r["bytes"] == r["raw_bytes"] for r in steps[:2])
    assert all(r["bytes"] < r["raw_bytes"] / 10 for r in steps[2:])
    evals = read_jsonl(RunFiles(tmp_path / "a", TINY).evals)
    assert [e["step"] for e in evals] == [2, 4, 6, 8]
    assert whole["val_loss"] == evals[-1]["val_loss"] < math.log(VOCAB)
    assert whole["val_bpc"] == pytest.approx(whole["val_loss"] / math.log(2))
    assert whole["data"] == fingerprint(STDLIB_DOCSTRINGS)  # part of the result's key

    with pytest.raises(Interrupt):  # after the checkpoint at 3: steps 3..4 are redone
        train_simulated(TINY, tmp_path / "b", data, torch.device("cpu"), progress=stop_at(5))
    assert (tmp_path / "b" / "checkpoints" / "sign-s0.pt").is_file()
    resumed = train_simulated(TINY, tmp_path / "b", data, torch.device("cpu"))
    assert [(r["step"], r["loss"], r["bytes"]) for r in steps] == [
        (r["step"], r["loss"], r["bytes"]) for r in read_jsonl(RunFiles(tmp_path / "b", TINY).steps)]
    assert read_jsonl(RunFiles(tmp_path / "b", TINY).evals) == evals
    assert resumed["val_loss"] == whole["val_loss"]


def _csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_summary_pairs_the_val_loss_with_fp32_per_seed(tmp_path, data):
    torch.set_num_threads(1)
    configs = [replace(TINY, steps=4, codec=c, seed=s) for c in ("fp32", "int8") for s in (0, 1)]
    results = [train_simulated(c, tmp_path, data, torch.device("cpu")) for c in configs]
    assert summarise(tmp_path, "lm-test", results) == 0
    rows = _csv(tmp_path / "summary.csv")
    assert list(rows[0]) == ["run", "codec", "error_feedback", "seed", "bytes_per_step",
                             "total_bytes", "compression_ratio", "steady_ratio", "val_loss",
                             "val_bpc", "final_loss", "val_loss_vs_fp32_pct",
                             "val_loss_last3_vs_fp32_pct", "steps_to_target", "code"]
    assert {r["code"] for r in rows} == {code_hash()}  # the code each row was trained with
    table = {(r["run"], int(r["seed"])): r for r in rows}
    for seed in (0, 1):
        fp32, int8 = table["fp32", seed], table["int8", seed]
        assert float(fp32["val_loss_vs_fp32_pct"]) == 0
        assert float(int8["val_loss_vs_fp32_pct"]) == pytest.approx(
            100 * (float(int8["val_loss"]) / float(fp32["val_loss"]) - 1), abs=1e-3)
    agg = {r["run"]: r for r in _csv(tmp_path / "aggregate.csv")}
    assert agg["int8"]["seeds"] == "2" and agg["int8"]["val_loss_vs_fp32_pct_std"]
    md = (tmp_path / "summary.md").read_text()
    assert "| val loss (nats/char) | bits/char | val loss vs fp32 (%) |" in md
    assert "AbsRel" not in md
    for name in ("val_loss_vs_bytes.png", "loss_curves.png", "steps_to_target.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG", name

    # A later command over part of the runs (--codecs int8) adds to the folder's summary: the
    # fp32 rows stay (and pair), the other ones are this command's.
    evals = (tmp_path / "evals.jsonl").read_text()
    assert summarise(tmp_path, "lm-test", results[2:]) == 0
    again = _csv(tmp_path / "summary.csv")
    assert sorted((r["run"], r["seed"]) for r in again) == sorted(
        (r["run"], r["seed"]) for r in rows)
    assert {(r["run"], r["seed"]): r for r in again} == {(r["run"], r["seed"]): r for r in rows}
    assert sorted(evals.splitlines()) == sorted((tmp_path / "evals.jsonl").read_text().splitlines())


def test_depth_tables_keep_their_columns():
    assert report.summary_columns(DEPTH) == (
        "run", "codec", "error_feedback", "seed", "bytes_per_step", "total_bytes",
        "compression_ratio", "steady_ratio", "abs_rel", "abs_rel_med", "sq_rel", "rmse",
        "rmse_log", "delta1", "delta2", "delta3", "final_loss", "abs_rel_vs_fp32_pct",
        "abs_rel_med_last3_vs_fp32_pct", "steps_to_target", "code")
    assert [h for h, _ in report.main_columns(DEPTH)] == [
        "run", "bytes/step", "ratio, whole run", "ratio, compressing", "AbsRel",
        "AbsRel, median-scaled", "RMSE", "δ1", "AbsRel vs fp32 (%)",
        "AbsRel-med, last 3 evals, vs fp32 (%)", "steps to target", "code"]


def test_the_cpu_lm_suite_and_what_a_language_model_refuses(tmp_path):
    suite = get_suite("cpu-lm")
    runs = suite.configs()
    assert [r.name for r in runs] == ["fp32", "bf16", "int8", "sign", "topk:0.01:values=fp16",
                                      "sign-noef", "topk:0.01:values=fp16-noef"]
    assert {task_of(r.model) for r in runs} == {LANGUAGE}
    assert task_of("vit-t14") is DEPTH and task_of("conv-s") is DEPTH
    with pytest.raises(ValueError, match="unknown model 'lm-xl'; known: .*lm-s"):
        make_model(replace(TINY, model="lm-xl"), torch.device("cpu"))
    with pytest.raises(ValueError, match="lm-t is a language model: its data is a text"):
        load_data(replace(TINY, data="procedural"))
    with pytest.raises(ValueError, match="no pretrained encoder"):
        make_model(replace(TINY, weights="dinov2.pth"), torch.device("cpu"))


def test_a_suite_whose_fp32_run_is_named_otherwise_pairs_with_it():
    """cpu-lm-clip's reference is "fp32+gclip1" (clipped as the other runs are)."""
    results = [{"run": run, "codec": codec, "error_feedback": codec != "fp32", "seed": 0,
                "val_loss": loss}
               for run, codec, loss in (("fp32+gclip1", "fp32", 2.0), ("sign+gclip1", "sign", 2.1))]
    evals = [{"run": r["run"], "seed": 0, "step": 10, "val_loss": r["val_loss"]} for r in results]
    assert report.baseline_run(results) == "fp32+gclip1"
    assert report.tail_vs_fp32(report.eval_curves(evals), "sign+gclip1", 0, "val_loss",
                               report.baseline_run(results)) == pytest.approx(5.0)
