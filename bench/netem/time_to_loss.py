"""Time to a validation loss over a shaped link: the convergence harness's curves (validation loss
against steps, every seed of every run of a suite folder) times the step times bench/netem
measured for the same model at each link rate.

    python bench/netem/time_to_loss.py --runs bench/converge/cpu-lm-local \\
        --netem 100mbit=DIR1 1gbit=DIR2 10gbit=DIR3 --out DIR [--tolerance 0.03]

The target is the fp32 run's final validation loss (mean over its seeds) times 1 + tolerance; runs
trained on other seeds than fp32's are left out (a mean over other seeds is not comparable), and
every run is read at fp32's evaluation steps only. A run reaches it at the first evaluation whose loss (mean over the run's seeds) is at or below it;
its time is that step count times its hook's step time at the rate (``results.csv``: the median
step, a local-steps hook's mean step, which carries one sync every H steps). Harness runs map to
netem hooks by name: fp32 -> none, bf16 without error feedback -> torch-bf16 (PyTorch's hook does
that arithmetic), lowrank:R -> powersgd:R (PyTorch's PowerSGD; gradzip's lowrank has its
arithmetic), CODEC+HN... -> local:CODEC:N, any other codec -> the gradzip hook of that spec. Writes
``time_to_loss.csv`` and ``time_to_loss.md`` (and ``time_to_loss.png`` with matplotlib); a run or
hook missing on either side is listed as such, not guessed.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import re
import statistics
import sys
from pathlib import Path


def hook_of(run: str) -> str:
    """The netem hook whose step time belongs to the harness run named ``run``."""
    base, _, local = run.partition("+H")  # CODEC+HN+ilr...: the outer settings do not change it
    if local:
        return f"local:{base}:{re.match(r'[0-9]+', local).group()}"
    if run == "fp32":
        return "none"
    if run == "bf16-noef":
        return "torch-bf16"
    if run.startswith("lowrank:"):
        return "powersgd:" + run.split(":")[1]
    return run.replace("-noef", "")


def curves(folder: Path) -> dict[str, tuple[frozenset, list[tuple[int, float]]]]:
    """Per run: its seeds, and (step, validation loss averaged over them) at the steps every
    seed was evaluated."""
    by_run: dict[str, dict[int, dict[int, float]]] = {}
    for log in sorted((folder / "runs").glob("*.evals.jsonl")):
        for line in log.read_text().splitlines():
            e = json.loads(line)
            by_run.setdefault(e["run"], {}).setdefault(e["step"], {})[e["seed"]] = e["val_loss"]
    out = {}
    for run, steps in by_run.items():
        seeds = frozenset().union(*steps.values())
        out[run] = (seeds, [(s, statistics.mean(v.values())) for s, v in sorted(steps.items())
                            if set(v) == seeds])
    return out


def step_times(folder: Path) -> dict[str, float]:
    with open(folder / "results.csv", newline="") as f:
        return {r["hook"]: float(r["step_time_s_median"]) for r in csv.DictReader(f)}


def first_reach(curve: list[tuple[int, float]], target: float) -> int | None:
    return next((s for s, v in curve if v <= target), None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=Path, required=True, nargs="+",
                    help="harness suite folders (their runs/*.evals.jsonl)")
    ap.add_argument("--netem", required=True, nargs="+", metavar="RATE=DIR",
                    help="bench/netem output folders, each with its link rate")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tolerance", type=float, default=0.03,
                    help="the target: fp32's final validation loss times 1 + this")
    args = ap.parse_args(argv)
    runs: dict[str, list] = {}
    for folder in args.runs:
        runs.update(curves(folder))
    if "fp32" not in runs:
        print("time_to_loss: no fp32 run in --runs (the target is its final loss)", file=sys.stderr)
        return 2
    rates = []
    for item in args.netem:
        rate, sep, folder = item.partition("=")
        if not sep:
            print(f"time_to_loss: --netem {item!r}: expected RATE=DIR", file=sys.stderr)
            return 2
        rates.append((rate, step_times(Path(folder))))
    seeds, fp32 = runs["fp32"]
    skipped = sorted(run for run, (s, _) in runs.items() if s != seeds)
    # every run read at fp32's evaluation steps only: a finer grid would reach the target sooner
    grid = {step for step, _ in fp32}
    runs = {run: [(step, v) for step, v in curve if step in grid]
            for run, (s, curve) in runs.items() if s == seeds}
    target = fp32[-1][1] * (1.0 + args.tolerance)
    rows = []
    for run, curve in runs.items():
        reach = first_reach(curve, target)
        row = {"run": run, "hook": hook_of(run), "final_val_loss": curve[-1][1], "steps": reach}
        for rate, times in rates:
            t = times.get(row["hook"])
            row[rate] = math.nan if t is None or reach is None else reach * t
        rows.append(row)
    base = next(r for r in rows if r["run"] == "fp32")
    args.out.mkdir(parents=True, exist_ok=True)
    names = [rate for rate, _ in rates]
    with open(args.out / "time_to_loss.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "hook", "final_val_loss", "steps_to_target",
                    *[f"seconds_at_{r}" for r in names]])
        for r in rows:
            w.writerow([r["run"], r["hook"], f"{r['final_val_loss']:.4f}", r["steps"] or "",
                        *[f"{r[n]:.2f}" for n in names]])
    md = [f"Target: validation loss {target:.4f} (fp32's final {fp32[-1][1]:.4f} "
          f"+ {100 * args.tolerance:g} %, mean over seeds {sorted(seeds)}); time = steps to reach "
          "it x the hook's step time."
          + (f" Left out (not run on the same seeds): {', '.join(skipped)}." if skipped else ""),
          "",
          "| run | hook | final val loss | steps to target | "
          + " | ".join(f"s at {n} (vs fp32)" for n in names) + " |",
          "|---|---|---:|---:|" + "---:|" * len(names)]
    for r in sorted(rows, key=lambda r: (r["steps"] is None, r["run"])):
        cells = []
        for n in names:
            if math.isnan(r[n]):
                cells.append("not reached" if r["steps"] is None else "no step time")
            else:
                cells.append(f"{r[n]:.1f} ({base[n] / r[n]:.1f}x)" if base[n] == base[n]
                             else f"{r[n]:.1f}")
        md.append(f"| {r['run']} | {r['hook']} | {r['final_val_loss']:.4f} | "
                  f"{r['steps'] or 'never'} | " + " | ".join(cells) + " |")
    (args.out / "time_to_loss.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return 0
    fig, axes = plt.subplots(1, len(rates), figsize=(5 * len(rates), 4), squeeze=False)
    for ax, (rate, times) in zip(axes[0], rates):
        for run, curve in sorted(runs.items()):
            t = times.get(hook_of(run))
            if t is not None:
                ax.plot([s * t for s, _ in curve], [v for _, v in curve], label=run)
        ax.axhline(target, color="grey", linestyle=":")
        ax.set(title=f"link {rate}", xlabel="wall seconds (2 ranks)", ylabel="val loss",
               xscale="log")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out / "time_to_loss.png", dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
