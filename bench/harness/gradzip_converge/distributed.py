"""Real data parallelism under torchrun: DistributedDataParallel with gradzip's ``compress_hook``
(``--strategy ddp``), or FSDP2 (``fully_shard`` on every transformer block and the root) with
gradzip's compressed reduce-scatter (``--strategy fsdp``, :mod:`gradzip.fsdp`).

    torchrun --nproc-per-node 4 -m gradzip_converge --strategy ddp --suite cpu-default --out DIR

One rank per worker (the suite's worker count becomes the world size); rank w trains on shard w
of the step's global batch, exactly the shard simulated worker w gets, so the modes run the
same experiment. Gloo on CPU, NCCL on GPU (one device per local rank). The uncompressed baseline
goes through gradzip's own uncompressed path (PyTorch's allreduce_hook arithmetic; FSDP's own
reduce-scatter) so that its traffic is counted the same way. Under FSDP the recipe's optimizer
is torch's (AdamW on the compressed gradients trained sign better there than FrozenVarianceAdamW);
``--optimizer frozen-variance-adamw`` trains with gradzip.fsdp's optimizer= (its moments
sharded), and CompressedSGD, which needs the DDP hook, becomes torch's SGD. Rank 0
writes the files; each rank checkpoints what it holds alone (its error-feedback residuals; under
FSDP also its parameter and optimizer shards) next to the shared checkpoint (a shared file system
is assumed for multi-node resume). Codec time is not separable from the overlapped backward here
and is reported as n/a.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from .compression import RESIDUAL_DTYPES, baseline_or_codec
from .output import Progress, clear_results, summarise, write_suite_json
from .tasks import task_of
from .training import (RunConfig, RunFiles, batch_indices, clip_averaged, compress_warmup_steps,
                       data_key, eval_due, finish, hook_optimizer, load_data, log_eval,
                       make_model, make_optimizer, reduction_clip)


def _broadcast(obj, src: int = 0):
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


class _DDP:
    """The model in DistributedDataParallel with compress_hook; the replicas' weights and
    optimizer are in the shared checkpoint."""

    name, sharded = "DDP", False

    def __init__(self, cfg: RunConfig, device):
        from gradzip.ddp import CompressionState, compress_hook

        self.model = make_model(cfg, device)
        self.forward = DDP(self.model, device_ids=[device.index] if device.type == "cuda" else None,
                           bucket_cap_mb=cfg.bucket_cap_mb)
        self.opt, self.sched = make_optimizer(cfg, self.model)
        self.state = CompressionState(
            cfg.codec, **baseline_or_codec(cfg.codec, cfg.error_feedback),
            warmup_steps=compress_warmup_steps(cfg) if hook_optimizer(self.opt) else
            cfg.compress_warmup or 0, optimizer=hook_optimizer(self.opt),
            warmup_codec=cfg.warmup_codec, uncompressed_numel=cfg.uncompressed_numel,
            max_grad_norm=reduction_clip(cfg, self.opt), cast_sum=cfg.cast_sum,
            residual_dtype=RESIDUAL_DTYPES[cfg.residual_dtype])
        self.forward.register_comm_hook(self.state, compress_hook)


class _FSDP:
    """The model under FSDP2 (each transformer block and the root sharded) with gradzip's compressed
    reduce-scatter; each rank checkpoints its own parameter and optimizer shards."""

    name, sharded = "FSDP", True

    def __init__(self, cfg: RunConfig, device):
        from torch.distributed.fsdp import fully_shard

        import gradzip.fsdp

        self.model = self.forward = make_model(cfg, device)
        # the transformer blocks: a ViT encoder's, or a language model's
        blocks = getattr(getattr(self.model, "encoder", self.model), "blocks", None)
        if blocks is None:
            raise ValueError(f"--strategy fsdp shards a transformer's blocks; {cfg.model} has none")
        for block in blocks:
            fully_shard(block)
        fully_shard(self.model)
        self.opt, self.sched = make_optimizer(cfg, self.model, sharded=True)
        if reduction_clip(cfg, self.opt) is not None:
            raise ValueError(f"{cfg.name}: max_grad_norm with {type(self.opt).__name__} under "
                             "--strategy fsdp: p.grad holds its update, and gradzip.fsdp clips no "
                             "rank's gradient (the DDP hook's max_grad_norm)")
        self.state = gradzip.fsdp.compress(
            self.model, cfg.codec, **baseline_or_codec(cfg.codec, cfg.error_feedback),
            warmup_steps=compress_warmup_steps(cfg) if hook_optimizer(self.opt) else
            cfg.compress_warmup or 0, optimizer=hook_optimizer(self.opt),
            param_codec=cfg.param_codec, uncompressed_numel=cfg.uncompressed_numel,
            residual_dtype=RESIDUAL_DTYPES[cfg.residual_dtype])


STRATEGIES = {"ddp": _DDP, "fsdp": _FSDP}


def train_distributed(cfg: RunConfig, out: Path, data, device, strategy, progress=None) -> dict | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    files = RunFiles(out, cfg) if rank == 0 else None
    done = _broadcast(files.done() if rank == 0 else None)
    if done is not None:
        return done
    train, test = data
    task = task_of(cfg.model)
    run = strategy(cfg, device)
    model, opt, sched, state = run.model, run.opt, run.sched, run.state
    rank_ckpt = out / "checkpoints" / f"{cfg.name.replace(':', '_')}-s{cfg.seed}.rank{rank}.pt"
    start, wall = 0, 0.0
    ckpt = _broadcast(files.load_checkpoint() if rank == 0 else None)
    if ckpt is not None:
        mine = torch.load(rank_ckpt, map_location=device, weights_only=False)
        held = mine if run.sharded else ckpt
        model.load_state_dict(held["model"])
        opt.load_state_dict(held["opt"])
        sched.load_state_dict(ckpt["sched"])
        state.load_state_dict(mine["gradzip"])
        start, wall = ckpt["step"], ckpt["wall_s"]
    if rank == 0:
        files.truncate_logs(start)
    n_train, b = task.train_size(cfg, train), cfg.batch_per_worker
    log = open(files.steps, "a") if rank == 0 else None
    model.train()
    for step in range(start, cfg.steps):
        t0 = time.perf_counter()
        idx = batch_indices(cfg.seed, step, n_train, world * b)[rank * b:(rank + 1) * b]
        loss = task.shard_loss(run.forward, cfg, train, idx, device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        clip_averaged(cfg, opt, list(model.parameters()))
        opt.step()
        sched.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)  # for the log only: the mean over workers, as simulated
        wall += time.perf_counter() - t0
        # FSDP's forward all-gathers the parameters: every rank evaluates; DDP's replicas: rank 0
        # (the others wait in the next step's all-reduce)
        evaluating = eval_due(cfg, step + 1) and (run.sharded or rank == 0)
        metrics = task.evaluate(model, cfg, test, device) if evaluating else None
        if rank == 0:
            stats = state.stats
            loss_v = float(mean_loss) / world
            log.write(json.dumps({
                "run": cfg.name, "seed": cfg.seed, "codec": cfg.codec,
                "error_feedback": cfg.error_feedback, "step": step, "loss": loss_v,
                "lr": sched.get_last_lr()[0], "bytes": stats["bytes_sent"],
                "raw_bytes": stats["raw_bytes"], "codec_ms": None,
                "wall_s": wall}) + "\n")
            if progress is not None:
                progress(step + 1, loss_v)
            if metrics is not None:
                log_eval(files, progress, step + 1, metrics)
        if (step + 1) % cfg.checkpoint_every == 0 and step + 1 < cfg.steps:
            mine = {"gradzip": state.state_dict()}
            if run.sharded:
                mine.update(model=model.state_dict(), opt=opt.state_dict())
            torch.save(mine, rank_ckpt)
            dist.barrier()  # every rank's part is on disk before the shared checkpoint
            if rank == 0:
                log.flush()
                shared = {"step": step + 1, "wall_s": wall, "sched": sched.state_dict()}
                if not run.sharded:
                    shared.update(model=model.state_dict(), opt=opt.state_dict())
                files.save_checkpoint(shared)
            dist.barrier()
    res = None
    if rank == 0:
        log.close()
        res = finish(files, cfg, numel=sum(p.numel() for p in model.parameters()), wall=wall)
        files.ckpt.unlink(missing_ok=True)
    dist.barrier()
    rank_ckpt.unlink(missing_ok=True)
    return _broadcast(res)


def main_distributed(args, suite, configs: list[RunConfig], device: torch.device) -> int:
    if "RANK" not in os.environ:
        raise SystemExit(f"--strategy {args.strategy} runs under torchrun, e.g. torchrun "
                         f"--nproc-per-node 4 -m gradzip_converge --strategy {args.strategy} "
                         "--suite cpu-smoke --out DIR")
    strategy = STRATEGIES[args.strategy]
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        configs = [replace(c, workers=world) for c in configs]
        out: Path = args.out / args.strategy
        if rank == 0:
            if args.fresh:
                clear_results(out)
            out.mkdir(parents=True, exist_ok=True)
            write_suite_json(out, suite, device, args)
        dist.barrier()
        results, key = {}, None
        for cfg in sorted(configs, key=lambda c: c.seed):  # seed by seed: one data set at a time
            if data_key(cfg) != key:
                key, data = data_key(cfg), None
                if rank == 0:
                    data = load_data(cfg, out / "data")
                dist.barrier()  # rank 0 has rendered (and cached) the scenes; the others read them
                if rank != 0:
                    data = load_data(cfg, out / "data")
            bar = Progress(cfg, args.quiet or rank != 0)
            try:
                results[cfg] = train_distributed(cfg, out, data, device, strategy, progress=bar)
            finally:
                bar.close()
        if rank == 0:
            summarise(out, f"{suite.name} ({strategy.name}, {backend}, world {world})",
                      [results[c] for c in configs])
        # Gloo's worker thread drops a finished collective's tensors a moment after its wait()
        # returns; if the last of them (broadcast_object_list's, made in Python) is dropped while
        # the interpreter shuts down, releasing it takes the GIL and aborts the process. A barrier
        # (its tensor made in C++) lets that release happen first.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0
