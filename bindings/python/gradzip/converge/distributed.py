"""Mode (a): real DistributedDataParallel under torchrun, gradients reduced by ``compress_hook``.

    torchrun --nproc-per-node 4 -m gradzip.converge --ddp --suite cpu-default --out DIR

One rank per worker (the suite's worker count becomes the world size); rank w trains on shard w
of the step's global batch, exactly the shard simulated worker w gets, so the two modes run the
same experiment. Gloo on CPU, NCCL on GPU (one device per local rank). The uncompressed baseline
goes through the hook's own uncompressed path (PyTorch's allreduce_hook arithmetic) so that its
traffic is counted the same way. Rank 0 writes the files; each rank checkpoints its own
error-feedback residuals next to the shared checkpoint (a shared file system is assumed for
multi-node resume). Codec time is not separable from the overlapped backward here and is
reported as n/a.
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

from .compression import _NEVER, BASELINE, MIN_COMPRESS_NUMEL
from .output import Progress, clear_results, summarise, write_suite_json
from .training import (RunConfig, RunFiles, batch_indices, data_key, eval_due, evaluate, finish,
                       load_data, make_model, make_optimizer, shard_loss)


def _broadcast(obj, src: int = 0):
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def train_ddp(cfg: RunConfig, out: Path, data, device, progress=None) -> dict | None:
    from gradzip.ddp import CompressionState, compress_hook
    from gradzip.optim import CompressedAdamW

    rank, world = dist.get_rank(), dist.get_world_size()
    files = RunFiles(out, cfg) if rank == 0 else None
    done = _broadcast(files.done() if rank == 0 else None)
    if done is not None:
        return done
    train, test = data
    model = make_model(cfg, device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
              bucket_cap_mb=cfg.bucket_cap_mb)
    baseline = cfg.codec == BASELINE
    opt, sched = make_optimizer(cfg, model)
    state = CompressionState(cfg.codec, error_feedback=cfg.error_feedback and not baseline,
                             min_compress_numel=_NEVER if baseline else MIN_COMPRESS_NUMEL,
                             optimizer=opt if isinstance(opt, CompressedAdamW) else None)
    ddp.register_comm_hook(state, compress_hook)
    rank_ckpt = out / "checkpoints" / f"{cfg.name.replace(':', '_')}-s{cfg.seed}.rank{rank}.pt"
    start, wall = 0, 0.0
    ckpt = _broadcast(files.load_checkpoint() if rank == 0 else None)
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        state.load_state_dict(torch.load(rank_ckpt, map_location=device, weights_only=False))
        start, wall = ckpt["step"], ckpt["wall_s"]
    if rank == 0:
        files.truncate_logs(start)
    n_train, b = train["rgb"].shape[0], cfg.batch_per_worker
    log = open(files.steps, "a") if rank == 0 else None
    model.train()
    for step in range(start, cfg.steps):
        t0 = time.perf_counter()
        idx = batch_indices(cfg.seed, step, n_train, world * b)[rank * b:(rank + 1) * b]
        loss = shard_loss(ddp, cfg, train, idx, device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)  # for the log only: the mean over workers, as simulated
        wall += time.perf_counter() - t0
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
            if eval_due(cfg, step + 1):  # the other ranks wait in the next step's all-reduce
                files.log_eval(step + 1, evaluate(model, cfg, test, device))
        if (step + 1) % cfg.checkpoint_every == 0 and step + 1 < cfg.steps:
            torch.save(state.state_dict(), rank_ckpt)
            dist.barrier()  # every rank's residuals are on disk before the shared checkpoint
            if rank == 0:
                log.flush()
                files.save_checkpoint({"step": step + 1, "wall_s": wall,
                                       "model": model.state_dict(), "opt": opt.state_dict(),
                                       "sched": sched.state_dict()})
            dist.barrier()
    res = None
    if rank == 0:
        log.close()
        res = finish(files, cfg, numel=sum(p.numel() for p in model.parameters()), wall=wall)
        files.ckpt.unlink(missing_ok=True)
    dist.barrier()
    rank_ckpt.unlink(missing_ok=True)
    return _broadcast(res)


def main_ddp(args, suite, configs: list[RunConfig], device: torch.device) -> int:
    if "RANK" not in os.environ:
        raise SystemExit("--ddp runs under torchrun, e.g. torchrun --nproc-per-node 4 "
                         "-m gradzip.converge --ddp --suite cpu-smoke --out DIR")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        configs = [replace(c, workers=world) for c in configs]
        out: Path = args.out / "ddp"
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
                results[cfg] = train_ddp(cfg, out, data, device, progress=bar)
            finally:
                bar.close()
        if rank == 0:
            summarise(out, f"{suite.name} (DDP, {backend}, world {world})", configs,
                      [results[c] for c in configs])
    finally:
        dist.destroy_process_group()
    return 0
