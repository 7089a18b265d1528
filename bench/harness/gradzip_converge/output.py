"""What the two modes of ``python -m gradzip_converge`` share (simulated workers in cli, real
DDP in distributed): the progress bar, the output folder's suite.json, clearing earlier results,
and the summary written and printed at the end."""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch

from . import report
from .provenance import environment
from .tasks import task_of
from .training import RunConfig, read_jsonl, run_stem


class Progress:
    """A run's progress: a tqdm bar where stdout is a terminal; elsewhere (a log file, a pipe, a
    job scheduler) one line when the run starts, one per evaluation and one when it ends, so that a
    long job shows it is alive without filling the log with bar redraws. Nothing when ``quiet``.
    No tqdm object without a bar: its lock is a multiprocessing semaphore, which a pool worker
    ended by Ctrl-C would leave to the resource tracker's "leaked semaphore" warning."""

    def __init__(self, cfg: RunConfig, quiet: bool):
        self.name, self.total = f"{cfg.name:>14} s{cfg.seed}", cfg.steps
        self.task = task_of(cfg.model)
        self.step, self.loss = 0, None
        self.lines = not quiet and not sys.stdout.isatty()
        self.bar = None
        if not quiet and not self.lines:
            from tqdm import tqdm

            self.bar = tqdm(
                total=cfg.steps, desc=self.name, unit="step", dynamic_ncols=True, file=sys.stderr)
        self.say(f"training, {cfg.steps} steps")

    def say(self, what: str) -> None:
        if self.lines:
            print(f"{self.name}: {what}", flush=True)

    def __call__(self, step: int, loss: float) -> None:
        self.step, self.loss = step, loss
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
            self.bar.refresh()

    def evaluated(self, step: int, metrics: dict) -> None:
        self.say(f"step {step}/{self.total} loss {self.loss:.4f} {self.task.label} "
                 f"{metrics[self.task.headline]:.4f}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.step == self.total:
            self.say("done")


def with_stored_results(out: Path, results: list[dict]) -> list[dict]:
    """``results``, then the other results in ``out/runs`` (by run name, then seed)."""
    have = {(r["run"], r["seed"]) for r in results}
    stored = [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))]
    extra = [r for r in stored if (r["run"], r["seed"]) not in have]
    return list(results) + sorted(extra, key=lambda r: (r["run"], r["seed"]))


def clear_results(out: Path) -> None:
    """Everything but the cached scenes (out/data), which are keyed by what they depend on."""
    shutil.rmtree(out / "runs", ignore_errors=True)
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    for name in ("steps.jsonl", "evals.jsonl"):
        (out / name).unlink(missing_ok=True)


def write_suite_json(out: Path, suite, device: torch.device, args) -> None:
    (out / "suite.json").write_text(json.dumps(
        {"suite": suite.name, "device": str(device), "argv": args.argv, "seeds": args.seeds,
         "jobs": args.jobs, "cpus": os.cpu_count(), "environment": environment()}, indent=1))


def summarise(out: Path, suite_name: str, results: list[dict]) -> int:
    """Writes and prints the summary of ``out``: this command's ``results``, then
    every other run stored in ``out/runs`` by earlier commands (other --codecs or --seeds), so that
    a suite's one summary covers its folder; each row names the code it was trained with."""
    results = with_stored_results(out, results)
    for name in ("steps", "evals"):  # the runs' own logs, concatenated in table order
        with open(out / f"{name}.jsonl", "w") as f:
            for r in results:
                log = out / "runs" / f"{run_stem(r['run'], r['seed'])}.{name}.jsonl"
                f.write(log.read_text() if log.is_file() else "")
    task = task_of(results[0]["config"]["model"])  # a suite's runs share their model
    table = report.rows(results, read_jsonl(out / "evals.jsonl"), task)
    agg = report.aggregate(table, task)
    written = report.write_all(out, table, agg, results, f"gradzip convergence: {suite_name}",
                               task)
    cfg = results[0]["config"]
    seeds = sorted({r["seed"] for r in results})
    print(f"\n{suite_name}: {cfg['model']}, {cfg['workers']} workers, {cfg['steps']} steps "
          f"({results[0]['params']:,} parameters), seeds {', '.join(map(str, seeds))}\n")
    print(report.markdown(agg, report.main_columns(task)))
    print(f"written in {out}: {', '.join(p.name for p in written)}, steps.jsonl, evals.jsonl")
    return 0
