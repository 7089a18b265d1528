"""``python -m gradzip_converge --suite NAME --out DIR``: train every codec of a suite, report.

Finished runs are skipped and an interrupted run resumes from its last checkpoint when the same
command is run again (a run whose settings, code or environment changed starts over; see
provenance.py). ``--seeds N`` repeats every run for the seeds S..S+N-1 (S from ``--seed``); the
seed sets both the initial weights and the data. ``--jobs J`` trains J (run, seed) pairs at once,
each in its own process, with the same results as one after the other. ``--strategy ddp`` (or
``--ddp``) under ``torchrun`` trains with real DistributedDataParallel and gradzip's
``compress_hook`` instead of simulated workers, ``--strategy fsdp`` with FSDP2 (``fully_shard``)
and gradzip's compressed reduce-scatter (one rank per worker; Gloo on CPU, NCCL on GPU).
"""
from __future__ import annotations

import argparse
import multiprocessing
import signal
import sys
from dataclasses import replace
from pathlib import Path

import torch

from .output import Progress, clear_results, summarise, write_suite_json
from .local_training import train_local
from .suites import SUITES, get_suite
from .training import (OPTIMIZERS, RunConfig, RunFiles, data_key, load_data, optimizer_name,
                       setup_process, train_simulated)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gradzip_converge", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", default="cpu-default", help=f"one of: {', '.join(SUITES)}")
    p.add_argument("--out", type=Path, help="output folder (results, checkpoints, plots)")
    p.add_argument("--list", action="store_true", help="list the suites and exit")
    p.add_argument("--codecs", help="comma-separated subset of the suite's runs, e.g. fp32,int8,"
                                    "sign-noef; a codec spec the suite lacks (lowrank:2) runs "
                                    "on the suite's settings with error feedback")
    p.add_argument("--steps", type=int, help="override the number of training steps")
    p.add_argument("--workers", type=int, help="override the number of simulated workers")
    p.add_argument("--device", choices=("cpu", "cuda"), help="override the suite's device")
    p.add_argument("--data", help="nyu:FILE.mat | kitti:DEPTH_ROOT,RAW_ROOT | folder:DIR "
                                  "(default: procedural scenes; a language model's: "
                                  "stdlib-docstrings)")
    p.add_argument("--weights", help="encoder weights, .pth or .safetensors (e.g. DINOv2's)")
    p.add_argument("--seed", type=int, help="the first seed (default: the suite's, 0)")
    p.add_argument("--seeds", type=int, default=1, help="train every run for N seeds (default 1)")
    p.add_argument("--jobs", type=int, default=1,
                   help="(run, seed) pairs trained at once, each in its own process with "
                        "--threads threads (default 1)")
    p.add_argument("--eval-every", type=int, help="override the test-set evaluation interval")
    p.add_argument("--fresh", action="store_true", help="discard earlier results in --out")
    p.add_argument("--strategy", choices=("simulated", "ddp", "fsdp"), default="simulated",
                   help="simulated workers in one process (default), or real DDP / FSDP2 under "
                        "torchrun (see above)")
    p.add_argument("--param-codec", help="--strategy fsdp: FSDP's parameter all-gathers in this "
                                        "codec (bf16, fp16, int8[:block=N]; gradzip.fsdp's "
                                        "param_codec); default: FSDP's own fp32 all-gather")
    p.add_argument("--uncompressed-numel", type=int, metavar="N",
                   help="int8/sign runs send 1-D tensors and those under N elements in fp32 "
                        "(CompressionState's uncompressed_numel; run names get +uN)")
    p.add_argument("--optimizer", choices=("recipe", *OPTIMIZERS),
                   help="the optimizer of the runs that do not set their own (default: recipe, "
                        "gradzip.optim.compresses_direction's choice for each codec under AdamW; "
                        "run names get +NAME)")
    p.add_argument("--compress-warmup", type=int, metavar="N",
                   help="the first N steps averaged uncompressed (bytes counted) in the runs that "
                        "do not set their own (default: the optimizer's need; run names get +wN)")
    p.add_argument("--max-grad-norm", type=float, metavar="C",
                   help="clip gradients at norm C in the runs that do not set their own: "
                        "clip_grad_norm_ on the averaged gradient, or each worker's gradient in "
                        "the reduction for gradzip.optim's optimizers (run names get +gclipC)")
    p.add_argument("--residual-dtype", choices=("fp32", "bf16"),
                   help="the error-feedback residuals' dtype in the runs that do not set their "
                        "own: bf16 is the compact state, half the bytes (run names get +resbf16)")
    p.add_argument("--ranks-per-node", type=int, metavar="R",
                   help="the workers are nodes of R ranks, reduced in two levels (exact inside a "
                        "node, the codec between nodes: gradzip.two_level); simulated workers "
                        "only, not with gradzip.optim's optimizers (run names get +NxR)")
    p.add_argument("--ddp", action="store_const", const="ddp", dest="strategy",
                   help="the same as --strategy ddp")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads for torch and the gradzip codecs (default 1: on a shared "
                        "2-core machine 2 threads ran 15x slower than 1, oversubscribed)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def overrides(args) -> dict:
    o = {"steps": args.steps, "workers": args.workers, "data": args.data,
         "weights": args.weights, "seed": args.seed, "eval_every": args.eval_every,
         "param_codec": args.param_codec, "uncompressed_numel": args.uncompressed_numel,
         "optimizer": args.optimizer, "compress_warmup": args.compress_warmup,
         "max_grad_norm": args.max_grad_norm, "residual_dtype": args.residual_dtype,
         "ranks_per_node": args.ranks_per_node}
    return {k: v for k, v in o.items() if v is not None}


def select(configs: list[RunConfig], codecs: str | None, base: RunConfig | None = None
           ) -> list[RunConfig]:
    """The suite's runs named in ``codecs``; a name that is not a run but a codec spec becomes a
    run of ``base`` (the suite's settings) in that codec, with error feedback."""
    if not codecs:
        return configs
    wanted = [c.strip() for c in codecs.split(",") if c.strip()]
    names = {c.name: c for c in configs}
    extra = {w: replace(base, codec=w, error_feedback=True) for w in wanted
             if w not in names and base is not None and _is_codec(w)}
    unknown = [w for w in wanted if w not in names and w not in extra]
    if unknown:
        raise SystemExit(f"--codecs: {', '.join(unknown)} not in this suite ({', '.join(names)}) "
                         "and not a codec spec")
    return [names[w] if w in names else extra[w] for w in wanted]


def _is_codec(spec: str) -> bool:
    from gradzip.plan import CodecPlan  # compiled extension: imported only here

    try:
        CodecPlan.parse(spec)
    except ValueError:
        return False
    return True


def with_seeds(configs: list[RunConfig], n: int) -> list[RunConfig]:
    """Every run for the seeds S..S+n-1 (S: the runs' seed), in table order: run by run."""
    return [replace(c, seed=c.seed + i) for c in configs for i in range(n)]


_data: dict = {}  # this process's data set by data_key, one at a time (4k scenes are 0.5 GB)


def run_job(cfg: RunConfig, out: Path, device: torch.device, quiet: bool = True) -> dict:
    """One (run, seed): its result if finished, else trained (or resumed) on its data."""
    if (res := RunFiles(out, cfg).done()) is not None:
        return res  # without loading the data
    if data_key(cfg) not in _data:
        _data.clear()
        _data[data_key(cfg)] = load_data(cfg, out / "data")
    bar = Progress(cfg, quiet)
    try:
        train = train_local if cfg.local_steps else train_simulated
        return train(cfg, out, _data[data_key(cfg)], device, progress=bar)
    finally:
        bar.close()


def _pool_job(job: tuple) -> tuple[int, dict]:
    i, *rest = job
    return i, run_job(*rest)


def _setup_worker(device: torch.device, threads: int) -> None:
    # Ctrl-C reaches the whole process group: the parent alone handles it (and ends the pool)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    setup_process(device, threads)


def run_all(configs: list[RunConfig], out: Path, device: torch.device, args) -> list[dict]:
    """Results in the order of ``configs``; trained seed by seed, so that consecutive jobs of a
    process share their data."""
    order = sorted(range(len(configs)), key=lambda i: configs[i].seed)
    results = [None] * len(configs)
    if args.jobs == 1:
        for i in order:
            results[i] = run_job(configs[i], out, device, args.quiet)
        return results
    # spawn: each worker is a fresh interpreter, set up like this one (threads, CUDA flags).
    # On a terminal the workers' bars would overwrite each other: one line per finished run here;
    # elsewhere the workers print their progress lines.
    bars = sys.stdout.isatty()
    ctx = multiprocessing.get_context("spawn")
    # The workers start with Ctrl-C ignored (an ignored signal stays ignored across exec, and
    # Python then installs no KeyboardInterrupt handler): a worker still importing when the
    # terminal's SIGINT reaches the process group would otherwise print a traceback.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        pool = ctx.Pool(args.jobs, _setup_worker, (device, args.threads))
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        jobs = [(i, configs[i], out, device, args.quiet or bars) for i in order]
        for i, res in pool.imap_unordered(_pool_job, jobs):
            results[i] = res
            if bars and not args.quiet:
                print(f"{res['run']:>14} s{res['seed']}: done", file=sys.stderr)
    finally:
        # ended and joined here, also on Ctrl-C: a pool left to the interpreter's exit leaves its
        # semaphores to the resource tracker's "leaked semaphore" warning
        pool.terminate()
        pool.join()
    return results


def main(argv=None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:
        # Ctrl-C: each run's results and checkpoints are on disk as they were written
        print("\ninterrupted: finished runs are kept; run the same command again to resume the "
              "others from their last checkpoints", file=sys.stderr, flush=True)
        return 130


def _main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        for s in SUITES.values():
            print(f"{s.name:12} {s.about}")
        return 0
    if args.out is None:
        raise SystemExit("--out DIR is required")
    if min(args.threads, args.seeds, args.jobs) < 1:
        raise SystemExit("--threads, --seeds and --jobs must be >= 1")
    if args.compress_warmup is not None and args.compress_warmup < 0:
        raise SystemExit("--compress-warmup must be >= 0")
    if args.max_grad_norm is not None and not args.max_grad_norm > 0:
        raise SystemExit("--max-grad-norm must be > 0")
    if args.strategy != "simulated" and args.jobs != 1:
        raise SystemExit(f"--jobs does not apply to --strategy {args.strategy} (torchrun starts "
                         "one process per rank)")
    if args.param_codec and args.strategy != "fsdp":
        raise SystemExit("--param-codec applies to --strategy fsdp (FSDP's parameter all-gather)")
    args.argv = sys.argv[1:] if argv is None else list(argv)
    # the progress bars and the plots: if one is missing, fail before training
    import matplotlib  # noqa: F401
    import tqdm  # noqa: F401
    suite = get_suite(args.suite)
    configs = with_seeds(select(suite.configs(**overrides(args)), args.codecs,
                                replace(suite.base, **overrides(args))), args.seeds)
    if args.strategy == "fsdp" and any(c.cast_sum for c in configs):
        raise SystemExit("a cast_sum (@fp32 runs) applies to the all-reduce; FSDP's reduce-scatter "
                         "always sums in fp32")
    if any(c.local_steps and c.residual_dtype != "fp32" for c in configs):
        raise SystemExit("the compact residual (+resbf16) applies to the per-step reduction; "
                         "local-steps runs (+H) keep their outer residual in fp32")
    if any(c.ranks_per_node > 1 and (c.local_steps or args.strategy != "simulated")
           for c in configs):
        raise SystemExit("two-level runs (+NxR) run with simulated workers and per-step "
                         "reduction only (gradzip.two_level.TwoLevelState is the multi-rank hook)")
    for c in configs:
        try:
            optimizer_name(c)
        except ValueError as e:
            raise SystemExit(str(e)) from None
    if args.strategy != "simulated" and any(c.local_steps for c in configs):
        raise SystemExit("local-steps runs (+H) run with simulated workers only; "
                         "gradzip.local_steps.LocalSteps is the multi-rank outer loop")
    if args.strategy == "fsdp" and any(c.warmup_codec for c in configs):
        raise SystemExit("a warm-up codec (+wN:CODEC runs) applies to the all-reduce; under "
                         "--strategy fsdp the warm-up is FSDP's own reduce-scatter")
    device = torch.device(args.device or suite.device)
    setup_process(device, args.threads)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"suite {suite.name} needs a CUDA device and none is available "
                         "(use --device cpu to force the CPU)")
    if args.strategy != "simulated":
        from .distributed import main_distributed

        return main_distributed(args, suite, configs, device)
    out: Path = args.out
    if args.fresh:
        clear_results(out)
    out.mkdir(parents=True, exist_ok=True)
    write_suite_json(out, suite, device, args)
    return summarise(out, suite.name, run_all(configs, out, device, args))
