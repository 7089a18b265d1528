"""Suite outputs, from the per-(run, seed) results and the runs' logs.

What is computed from the training alone is deterministic, so the same command writes the same
bytes: summary.csv (one row per run and seed), aggregate.csv and summary.md (per run: mean and
standard deviation over seeds, the paired difference to fp32, steps to target). Measured times
vary from one execution to the next and go to timings.csv only. Plots: <headline>_vs_bytes.png
(abs_rel_vs_bytes.png for depth), loss_curves.png, steps_to_target.png. The metric columns are
the task's (tasks.py): its metrics, and its headline metric compared with fp32's of the same seed.
"""
from __future__ import annotations

import csv
import statistics
from pathlib import Path

from .compression import BASELINE
from .tasks import Task
from .training import read_jsonl

# Steps to target: the first evaluation at which a run's headline metric (AbsRel) is within 5 % of
# the final one of the fp32 run of the same seed, i.e. how long a codec takes to get where fp32
# ends up.
TARGET = 1.05
# The tail comparison: the task's tail metric averaged over a run's last TAIL evaluations, paired
# with fp32's of the same seed (a single final evaluation on a few hundred held-out scenes moves
# by several percent from seed to seed; the mean of the last ones moves less).
TAIL = 3

ID = ("run", "codec", "error_feedback")
# compression_ratio: over the whole run, uncompressed warm-up included; steady_ratio: once the
# compression has started. total_bytes: what one worker sent over the whole run.
BYTES = ("bytes_per_step", "total_bytes", "compression_ratio", "steady_ratio")
TIMINGS = ("run", "seed", "wall_s", "codec_ms")


def metric_columns(task: Task) -> tuple[str, ...]:
    return task.metrics + ("final_loss",)


def paired(task: Task) -> tuple[str, str, str]:
    """The columns that need the fp32 run of the same seed: the headline's final value, the tail
    metric's mean over the last TAIL evaluations, and steps to target."""
    return (f"{task.headline}_vs_fp32_pct", f"{task.tail}_last{TAIL}_vs_fp32_pct",
            "steps_to_target")


def summary_columns(task: Task) -> tuple[str, ...]:
    return ID + ("seed",) + BYTES + metric_columns(task) + paired(task) + ("code",)


def code_of(result: dict) -> str:
    """The code version a result was trained with (provenance.code_hash, part of its cache key)."""
    return result.get("environment", {}).get("code", "?")


def spread_columns(task: Task) -> tuple[str, ...]:
    """The columns reported as mean and std over seeds."""
    return metric_columns(task) + paired(task)


def aggregate_columns(task: Task) -> tuple[str, ...]:
    return (ID + ("seeds",) + BYTES
            + tuple(f"{k}_{s}" for k in spread_columns(task) for s in ("mean", "std"))
            + ("target_reached", "code"))


def main_columns(task: Task) -> tuple[tuple[str, str], ...]:
    """summary.md's per-run table: (header, key)."""
    return ((("run", "run"), ("bytes/step", "bytes_per_step"),
             ("ratio, whole run", "compression_ratio"), ("ratio, compressing", "steady_ratio"))
            + task.shown + ((f"{task.label} vs fp32 (%)", paired(task)[0]),
                            (f"{task.tail_label}, last {TAIL} evals, vs fp32 (%)",
                             paired(task)[1]),
                            ("steps to target", "steps_to_target"), ("code", "code")))


def steps_to_target(evals: list[dict], key: str, target: float) -> int | None:
    """The first evaluated step with ``key`` <= target; None if there is none."""
    return next((e["step"] for e in sorted(evals, key=lambda e: e["step"])
                 if e[key] <= target), None)


def tail_mean(evals: list[dict], key: str) -> float | None:
    """``key`` averaged over the last TAIL evaluations (all of them if fewer); None if none."""
    last = sorted(evals, key=lambda e: e["step"])[-TAIL:]
    return statistics.fmean(e[key] for e in last) if last else None


def eval_curves(evals: list[dict]) -> dict[tuple, list[dict]]:
    """The evaluations grouped by (run, seed)."""
    curves: dict[tuple, list[dict]] = {}
    for e in evals:
        curves.setdefault((e["run"], e["seed"]), []).append(e)
    return curves


def baseline_run(runs: list[dict]) -> str:
    """The name of the fp32 run the others are paired with: "fp32", or the suite's one run of
    codec fp32 under another name (e.g. "fp32+gclip1", clipped as the others are)."""
    names = {r["run"] for r in runs if r["codec"] == BASELINE}
    return names.pop() if len(names) == 1 else BASELINE


def tail_vs_fp32(curves: dict[tuple, list[dict]], run: str, seed: int, key: str,
                 baseline: str = BASELINE) -> float | None:
    """``key``'s tail mean of (run, seed) against the ``baseline`` run's of the same seed - 1, in
    percent; None without both."""
    mine = tail_mean(curves.get((run, seed), []), key)
    theirs = tail_mean(curves.get((baseline, seed), []), key)
    return None if mine is None or not theirs else 100 * (mine / theirs - 1)


def rows(results: list[dict], evals: list[dict], task: Task) -> list[dict]:
    """summary.csv: one row per result, with its paired comparison to fp32 of the same seed."""
    curves = eval_curves(evals)
    key, (vs_fp32, tail_column, _) = task.headline, paired(task)
    base = baseline_run(results)
    fp32 = {r["seed"]: r[key] for r in results if r["run"] == base}
    table = []
    for r in results:
        row = {k: r[k] for k in summary_columns(task) if k not in paired(task) + ("code",)}
        ref = fp32.get(r["seed"])
        curve = curves.get((r["run"], r["seed"]), [])
        row[vs_fp32] = None if ref is None else 100 * (r[key] / ref - 1)
        row[tail_column] = tail_vs_fp32(curves, r["run"], r["seed"], task.tail, base)
        row["steps_to_target"] = None if ref is None else steps_to_target(curve, key, TARGET * ref)
        row["code"] = code_of(r)
        table.append(row)
    return table


def mean_std(xs) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (ddof 1; None for a single value) of the values that
    are not None."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else None


def aggregate(table: list[dict], task: Task) -> list[dict]:
    """aggregate.csv: one row per run over its seeds. Steps to target is averaged over the seeds
    that reach it; ``target_reached`` counts them."""
    runs: dict[str, list[dict]] = {}
    for r in table:
        runs.setdefault(r["run"], []).append(r)
    out = []
    for rs in runs.values():
        a = {k: rs[0][k] for k in ID} | {"seeds": len(rs)}
        for k in BYTES:  # the codec's: the same for each seed
            a[k] = statistics.fmean(r[k] for r in rs)
        for k in spread_columns(task):
            a[f"{k}_mean"], a[f"{k}_std"] = mean_std(r[k] for r in rs)
        a["target_reached"] = sum(r["steps_to_target"] is not None for r in rs)
        a["code"] = "+".join(sorted({r["code"] for r in rs}))  # more than one: mixed versions
        out.append(a)
    return out


def _csv(key: str, v) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, int) or key in ("bytes_per_step", "total_bytes"):
        return str(round(v))
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def write_csv(path: Path, table: list[dict], columns: tuple[str, ...]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(columns)
        for r in table:
            w.writerow([_csv(k, r[k]) for k in columns])


def _value(key: str, v) -> str:
    if v is None:
        return "never" if key == "steps_to_target" else "n/a"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, str):
        return v
    if key in ("bytes_per_step", "total_bytes", "steps_to_target", "seed"):
        return f"{v:.0f}"
    if key in ("compression_ratio", "steady_ratio"):
        return f"{v:.1f}"
    if key.endswith("_vs_fp32_pct"):
        return f"{v:+.2f}"
    return f"{v:.4f}"


def _cell(row: dict, key: str) -> str:
    """A value, or for an aggregate row "mean ± std" (std only over more than one seed)."""
    if f"{key}_mean" not in row:
        return _value(key, row[key])
    m, s = row[f"{key}_mean"], row[f"{key}_std"]
    text = _value(key, m) if s is None else f"{_value(key, m)} ± {_value(key, s).lstrip('+')}"
    if key == "steps_to_target" and m is not None and row["target_reached"] < row["seeds"]:
        text += f" ({row['target_reached']}/{row['seeds']} seeds)"
    return text


def markdown(table: list[dict], columns: tuple[tuple[str, str], ...]) -> str:
    lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(r, k) for _, k in columns) + " |" for r in table]
    return "\n".join(lines) + "\n"


def write_markdown(path: Path, table: list[dict], agg: list[dict], title: str,
                   task: Task) -> None:
    seeds = sorted({r["seed"] for r in table})
    m = task.label
    path.write_text(
        f"# {title}\n\nSeeds: {', '.join(map(str, seeds))}. Per run: mean ± standard deviation "
        f"over the seeds (ddof 1). {task.note}{m} vs fp32: {m} / {m} of the fp32 run of the same "
        f"seed - 1, in percent (mean ± std over seeds); {task.tail_label}, last {TAIL} evals: "
        f"the same for the mean of {task.tail} over each run's last {TAIL} evaluations (steadier "
        f"from seed to seed). Steps to target: the first evaluation "
        f"with {m} <= {TARGET} x the final {m} of the fp32 run of the same seed (mean "
        f"over the seeds that reach it). Code: the code version each run was trained with "
        f"(provenance.code_hash; the folder's runs of earlier commands are listed too, each with "
        f"its own). Measured times: timings.csv.\n\n"
        f"{markdown(agg, main_columns(task))}\nEvery run and seed (summary.csv):\n\n"
        f"{markdown(table, tuple((k, k) for k in summary_columns(task)))}")


def write_all(out: Path, table: list[dict], agg: list[dict], results: list[dict],
              title: str, task: Task) -> list[Path]:
    """Every output file but the logs; returns their paths."""
    paths = [out / "summary.csv", out / "aggregate.csv", out / "timings.csv", out / "summary.md"]
    write_csv(paths[0], table, summary_columns(task))
    write_csv(paths[1], agg, aggregate_columns(task))
    write_csv(paths[2], results, TIMINGS)
    write_markdown(paths[3], table, agg, title, task)
    return paths + plot(out, agg, task)


def _by_run(recs: list[dict]) -> dict[str, list[list[dict]]]:
    """Log records -> run -> one step-ordered list per seed, runs in the order they appear."""
    runs: dict[str, dict[int, list[dict]]] = {}
    for r in recs:
        runs.setdefault(r["run"], {}).setdefault(r["seed"], []).append(r)
    return {k: [sorted(v, key=lambda r: r["step"]) for v in seeds.values()]
            for k, seeds in runs.items()}


def _band(ax, x, ys, label: str):
    """Mean over seeds (rows of ys) as a line, ± one standard deviation as a band."""
    import numpy as np

    ys = np.asarray(ys, dtype=float)
    m = ys.mean(0)
    (line,) = ax.plot(x, m, label=label, linestyle="--" if label.endswith("-noef") else "-")
    if len(ys) > 1:
        s = ys.std(0, ddof=1)
        ax.fill_between(x, m - s, m + s, color=line.get_color(), alpha=0.2, linewidth=0)


def plot(out: Path, agg: list[dict], task: Task) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = task.headline
    paths = [out / f"{key}_vs_bytes.png", out / "loss_curves.png", out / "steps_to_target.png"]
    n_seeds = max(a["seeds"] for a in agg)
    spread = f"mean ± std over {n_seeds} seeds" if n_seeds > 1 else "1 seed"

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colours = {}
    for a in agg:
        c = colours.setdefault(a["codec"], f"C{len(colours)}")  # one colour per codec
        hollow = not a["error_feedback"] and a["codec"] != BASELINE
        ax.errorbar(a["bytes_per_step"], a[f"{key}_mean"], yerr=a[f"{key}_std"] or 0, fmt="o",
                    ms=8, color=c, mfc="none" if hollow else c, mew=1.5, capsize=3)
        ax.annotate(f"{a['codec']}{' (no EF)' if hollow else ''}",
                    (a["bytes_per_step"], a[f"{key}_mean"]), textcoords="offset points",
                    xytext=(6, 4), fontsize=8, color=c)
    ax.set_xscale("log")
    ax.set_xlabel("bytes on the wire per worker per step (log)")
    ax.set_ylabel(f"{task.axis} (lower is better)")
    ax.set_title(f"Accuracy vs bandwidth ({spread}; hollow: without error feedback)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, seeds in _by_run(read_jsonl(out / "steps.jsonl")).items():
        curves = []
        for recs in seeds:  # smoothed: the per-step loss of one small batch is noisy
            ema, ys = None, []
            for r in recs:
                ema = r["loss"] if ema is None else 0.9 * ema + 0.1 * r["loss"]
                ys.append(ema)
            curves.append(ys)
        _band(ax, [r["step"] for r in seeds[0]], curves, name)
    ax.set_xlabel("step")
    ax.set_ylabel(f"{task.loss_axis} (EMA 0.9)")
    ax.set_title(f"Training loss ({spread})", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(paths[1], dpi=120)
    plt.close(fig)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, seeds in _by_run(read_jsonl(out / "evals.jsonl")).items():
        # the evaluations every seed has (seeds trained by separate commands may be evaluated
        # at different intervals)
        steps = sorted(set.intersection(*({e["step"] for e in s} for s in seeds)))
        at = [{e["step"]: e[key] for e in s} for s in seeds]
        _band(ax1, steps, [[a[step] for step in steps] for a in at], name)
    ref = next((a for a in agg if a["run"] == baseline_run(agg)), None)
    if ref is not None:
        ax1.axhline(TARGET * ref[f"{key}_mean"], color="k", linewidth=1, linestyle=":",
                    label=f"target: {TARGET} x final fp32")
    ax1.set_xlabel("step")
    ax1.set_ylabel(task.axis)
    ax1.set_title(f"Test {task.label} during training ({spread})", fontsize=10)
    ax1.legend(fontsize=8)
    ax1.grid(True, alpha=0.3)
    ys = range(len(agg))
    ax2.barh(ys, [a["steps_to_target_mean"] or 0 for a in agg],
             xerr=[a["steps_to_target_std"] or 0 for a in agg],
             color=[f"C{i}" for i in ys], capsize=3)
    for i, a in zip(ys, agg):
        label = _cell(a, "steps_to_target")
        ax2.annotate(label, (a["steps_to_target_mean"] or 0, i), textcoords="offset points",
                     xytext=(4, 0), va="center", fontsize=8)
    ax2.set_yticks(list(ys), [a["run"] for a in agg])
    ax2.invert_yaxis()
    ax2.set_xlabel("steps to reach the target (mean over the seeds that reach it)")
    ax2.set_title("Steps to target", fontsize=10)
    ax2.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(paths[2], dpi=120)
    plt.close(fig)
    return paths
