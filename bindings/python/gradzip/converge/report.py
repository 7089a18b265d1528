"""Suite outputs: summary.csv, summary.md and the PNG plots, from the per-run results."""
from __future__ import annotations

import csv
import json
from pathlib import Path

COLUMNS = ("codec", "error_feedback", "bytes_per_step", "compression_ratio", "abs_rel", "rmse",
           "delta1", "wall_s")
EXTRA = ("sq_rel", "rmse_log", "delta2", "delta3", "codec_ms", "final_loss")


def rows(results: list[dict]) -> list[dict]:
    out = []
    for r in results:
        row = {k: r[k] for k in COLUMNS}
        out.append(row | {k: r[k] for k in EXTRA})
    return out


def write_csv(path: Path, table: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        for r in table:
            w.writerow([_fmt(k, r[k], csv=True) for k in COLUMNS])


def _fmt(key: str, v, csv: bool = False) -> str:
    if v is None:
        return "" if csv else "n/a"
    if isinstance(v, str):
        return v
    if isinstance(v, bool):
        return str(v).lower() if csv else ("yes" if v else "no")
    if key == "bytes_per_step":
        return str(int(round(v)))
    if key == "compression_ratio":
        return f"{v:.1f}" if not csv else f"{v:.3f}"
    if key in ("wall_s",):
        return f"{v:.1f}"
    if key in ("codec_ms",):
        return f"{v:.2f}"
    return f"{v:.4f}"


def markdown(table: list[dict], columns=COLUMNS) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in table:
        lines.append("| " + " | ".join(_fmt(k, r[k]) for k in columns) + " |")
    return "\n".join(lines) + "\n"


def write_markdown(path: Path, table: list[dict], title: str) -> str:
    main = markdown(table)
    extra = markdown(table, ("codec", "error_feedback") + EXTRA)
    path.write_text(f"# {title}\n\n{main}\nAll metrics (codec_ms: mean time of the simulated "
                    f"W-worker reduction per step):\n\n{extra}")
    return main


def read_steps(path: Path) -> dict[str, list[dict]]:
    by_run: dict[str, list[dict]] = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        by_run.setdefault(rec["run"], []).append(rec)
    return by_run


def plot(out: Path, table: list[dict], steps_path: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = [out / "abs_rel_vs_bytes.png", out / "loss_curves.png"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colours = {}
    for r in table:
        c = colours.setdefault(r["codec"], f"C{len(colours)}")  # one colour per codec
        hollow = not r["error_feedback"] and r["codec"] != "fp32"
        ax.scatter(r["bytes_per_step"], r["abs_rel"], s=60, color=c,
                   facecolors="none" if hollow else c, linewidths=1.5)
        label = f"{r['codec']}{' (no EF)' if hollow else ''}"
        ax.annotate(label, (r["bytes_per_step"], r["abs_rel"]), textcoords="offset points",
                    xytext=(6, 4), fontsize=8, color=c)
    ax.set_xscale("log")
    ax.set_xlabel("bytes on the wire per worker per step (log)")
    ax.set_ylabel("AbsRel on held-out scenes (lower is better)")
    ax.set_title("Accuracy vs bandwidth (hollow: without error feedback)")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, recs in read_steps(steps_path).items():
        recs.sort(key=lambda r: r["step"])
        ema, ys = None, []
        for r in recs:  # smoothed: the per-step loss of 16 images is noisy
            ema = r["loss"] if ema is None else 0.9 * ema + 0.1 * r["loss"]
            ys.append(ema)
        ax.plot([r["step"] for r in recs], ys, label=name,
                linestyle="--" if name.endswith("-noef") else "-")
    ax.set_xlabel("step")
    ax.set_ylabel("SILog training loss (EMA 0.9)")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(paths[1], dpi=120)
    plt.close(fig)
    return paths
