"""``python -m gradzip.converge --suite NAME --out DIR``: train every codec of a suite, report.

Finished runs are skipped and an interrupted run resumes from its last checkpoint when the same
command is run again (a run whose settings changed starts over). ``--ddp`` under ``torchrun``
trains with real DistributedDataParallel and gradzip's ``compress_hook`` instead of simulated
workers (one rank per worker; Gloo on CPU, NCCL on GPU).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch

from . import report
from .suites import SUITES, get_suite
from .training import RunConfig, load_data, train_simulated


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gradzip.converge", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", default="cpu-default", help=f"one of: {', '.join(SUITES)}")
    p.add_argument("--out", type=Path, help="output folder (results, checkpoints, plots)")
    p.add_argument("--list", action="store_true", help="list the suites and exit")
    p.add_argument("--codecs", help="comma-separated subset of the suite's runs, e.g. fp32,int8,"
                                    "sign-noef")
    p.add_argument("--steps", type=int, help="override the number of training steps")
    p.add_argument("--workers", type=int, help="override the number of simulated workers")
    p.add_argument("--device", choices=("cpu", "cuda"), help="override the suite's device")
    p.add_argument("--data", help="nyu:FILE.mat | kitti:DEPTH_ROOT,RAW_ROOT | folder:DIR "
                                  "(default: procedural scenes)")
    p.add_argument("--weights", help="encoder weights, .pth or .safetensors (e.g. DINOv2's)")
    p.add_argument("--seed", type=int)
    p.add_argument("--fresh", action="store_true", help="discard earlier results in --out")
    p.add_argument("--ddp", action="store_true", help="real DDP under torchrun (see above)")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads for torch and the gradzip codecs (default 1: on a shared "
                        "2-core machine 2 threads ran 15x slower than 1, oversubscribed)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def overrides(args) -> dict:
    o = {"steps": args.steps, "workers": args.workers, "data": args.data,
         "weights": args.weights, "seed": args.seed}
    return {k: v for k, v in o.items() if v is not None}


def select(configs: list[RunConfig], codecs: str | None) -> list[RunConfig]:
    if not codecs:
        return configs
    wanted = [c.strip() for c in codecs.split(",") if c.strip()]
    names = {c.name: c for c in configs}
    unknown = [w for w in wanted if w not in names]
    if unknown:
        raise SystemExit(f"--codecs: {', '.join(unknown)} not in this suite ({', '.join(names)})")
    return [names[w] for w in wanted]


class Progress:
    def __init__(self, cfg: RunConfig, quiet: bool):
        from tqdm import tqdm

        self.bar = tqdm(total=cfg.steps, desc=f"{cfg.name:>14}", unit="step", disable=quiet,
                        dynamic_ncols=True, file=sys.stderr)

    def __call__(self, step: int, loss: float) -> None:
        self.bar.n = step
        self.bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


def set_threads(n: int) -> None:
    torch.set_num_threads(n)
    try:
        import gradzip

        gradzip.set_num_threads(n)
    except ImportError:  # extension not built: only the baseline can run anyway
        pass


def clear_results(out: Path) -> None:
    shutil.rmtree(out / "runs", ignore_errors=True)
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    (out / "steps.jsonl").unlink(missing_ok=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        for s in SUITES.values():
            print(f"{s.name:12} {s.about}")
        return 0
    if args.out is None:
        raise SystemExit("--out DIR is required")
    if args.threads < 1:
        raise SystemExit("--threads must be >= 1")
    set_threads(args.threads)
    suite = get_suite(args.suite)
    configs = select(suite.configs(**overrides(args)), args.codecs)
    device = torch.device(args.device or suite.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"suite {suite.name} needs a CUDA device and none is available "
                         "(use --device cpu to force the CPU)")
    if args.ddp:
        from .distributed import main_ddp

        return main_ddp(args, suite, configs, device)
    out: Path = args.out
    if args.fresh:
        clear_results(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "suite.json").write_text(json.dumps(
        {"suite": suite.name, "device": str(device), "argv": sys.argv[1:] if argv is None
         else list(argv), "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count()},
        indent=1))
    data = load_data(configs[0])  # every run of a suite shares its data settings
    results = []
    for cfg in configs:
        bar = Progress(cfg, args.quiet)
        try:
            results.append(train_simulated(cfg, out, data, device, progress=bar))
        finally:
            bar.close()
    return summarise(out, suite.name, results)


def summarise(out: Path, suite_name: str, results: list[dict]) -> int:
    table = report.rows(results)
    report.write_csv(out / "summary.csv", table)
    md = report.write_markdown(out / "summary.md", table, f"gradzip convergence: {suite_name}")
    report.plot(out, table, out / "steps.jsonl")
    print(f"\n{suite_name}: {results[0]['config']['model']}, "
          f"{results[0]['config']['workers']} workers, {results[0]['config']['steps']} steps "
          f"({results[0]['params']:,} parameters)\n")
    print(md)
    print(f"written: {out}/summary.csv, summary.md, steps.jsonl, abs_rel_vs_bytes.png, "
          "loss_curves.png")
    return 0
