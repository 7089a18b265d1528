"""The tail comparison of a stored suite output, from its evals.jsonl alone: per run, the task's
tail metric averaged over each seed's last evaluations, paired with fp32's of the same seed (what
summary.csv's `<tail>_last3_vs_fp32_pct` column holds for suites run since it exists).

    python bench/converge/paired_tail.py bench/converge/cpu-sgd [more folders]
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

from gradzip_converge.compression import BASELINE
from gradzip_converge.report import TAIL, eval_curves, tail_vs_fp32
from gradzip_converge.tasks import DEPTH, LANGUAGE
from gradzip_converge.training import read_jsonl


def table(folder: Path) -> str:
    evals = read_jsonl(folder / "evals.jsonl")
    task = LANGUAGE if "val_loss" in evals[0] else DEPTH
    curves = eval_curves(evals)
    runs = list(dict.fromkeys(e["run"] for e in evals))
    lines = [f"{folder}: {task.tail}, mean of the last {TAIL} evaluations, vs fp32 of the same "
             "seed (%)", "| run | seeds | mean ± std | per seed |", "|---|---:|---|---|"]
    for run in runs:
        if run == BASELINE:
            continue
        diffs = [tail_vs_fp32(curves, run, seed, task.tail)
                 for r, seed in curves if r == run and (BASELINE, seed) in curves]
        if not diffs:
            continue
        spread = f" ± {statistics.stdev(diffs):.1f}" if len(diffs) > 1 else ""
        lines.append(f"| {run} | {len(diffs)} | {statistics.fmean(diffs):+.1f}{spread} | "
                     + ", ".join(f"{d:+.1f}" for d in diffs) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    print("\n\n".join(table(Path(f)) for f in sys.argv[1:]))
