"""One run with local steps (``RunConfig.local_steps`` = H > 0): W replicas of the model, each
trained on its worker's shard of the global batch by its own torch optimizer (and its own
learning-rate schedule, the run's), synced every H steps by
:class:`gradzip.local_steps.SimulatedLocalSteps` with the run's codec carrying the outer gradient.

The batches are the per-step runs' (``batch_indices``), so both see the same samples; a step's
bytes are the sync's on a sync step and nothing otherwise, against the fp32 all-reduce that DDP
would send every step (``raw_bytes``), so the whole-run ratio compares with the per-step codecs'
directly. Evaluations are of the anchor (the parameters every replica restarted from at the last
sync), as DiLoCo evaluates its global model; the final step is a sync when H divides the run's
steps (the suites' choices), else the anchor misses the last steps' work.
"""
from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import torch

from .compression import baseline_or_codec, fp32_step_bytes
from .tasks import task_of
from .training import (RunConfig, RunFiles, batch_indices, eval_due, finish, load_trainer,
                       log_eval, make_model, make_optimizer, trainer_state)


def _anchor_model(model: torch.nn.Module, anchor: list) -> torch.nn.Module:
    """``model`` (replica 0, for its buffers) with the anchor's values in its parameters."""
    evaluated = copy.deepcopy(model)
    with torch.no_grad():
        for p, a in zip([p for p in evaluated.parameters() if p.requires_grad], anchor):
            p.copy_(a)
    return evaluated


def train_local(cfg: RunConfig, out: Path, data: tuple[dict, dict], device: torch.device,
                progress=None) -> dict:
    """Run (or resume, or skip if finished) one local-steps run; returns its result dict (as
    ``train_simulated``'s)."""
    from gradzip.local_steps import SimulatedLocalSteps  # compiled extension: imported only here

    files = RunFiles(out, cfg)
    if (res := files.done()) is not None:
        return res
    train, test = data
    task = task_of(cfg.model)
    replicas = [make_model(cfg, device) for _ in range(cfg.workers)]  # the same seeded weights
    params = [[p for p in m.parameters() if p.requires_grad] for m in replicas]
    opts = [make_optimizer(cfg, m) for m in replicas]
    # the per-step runs' rule: the fp32 baseline's outer gradient is a plain fp32 all-reduce
    outer = SimulatedLocalSteps(params, cfg.codec, sync_every=cfg.local_steps,
                                outer_lr=cfg.outer_lr, outer_momentum=cfg.outer_momentum,
                                nesterov=cfg.outer_momentum > 0, cast_sum=cfg.cast_sum,
                                residual_decay=cfg.residual_decay,
                                bucket_cap_mb=cfg.bucket_cap_mb,
                                **baseline_or_codec(cfg.codec, cfg.error_feedback))
    raw_bytes = fp32_step_bytes([p.numel() for p in params[0]], cfg.workers, cfg.bucket_cap_mb)

    def restore(state):
        for m, (opt, sched), saved in zip(replicas, opts, state["replicas"]):
            load_trainer(saved, m, opt, sched)
        outer.load_state_dict(state["outer"])

    start, wall = files.resume(restore)
    n_train = task.train_size(cfg, train)
    b = cfg.batch_per_worker
    for m in replicas:
        m.train()
    with open(files.steps, "a") as log:
        for step in range(start, cfg.steps):
            t0 = time.perf_counter()
            idx = batch_indices(cfg.seed, step, n_train, cfg.workers * b)
            losses = []
            for w, (m, (opt, sched)) in enumerate(zip(replicas, opts)):
                loss = task.shard_loss(m, cfg, train, idx[w * b:(w + 1) * b], device)
                loss.backward()
                if cfg.max_grad_norm is not None:  # each replica clips its own, as its loop would
                    torch.nn.utils.clip_grad_norm_(params[w], cfg.max_grad_norm)
                opt.step()
                opt.zero_grad(set_to_none=True)
                sched.step()
                losses.append(loss.detach())
            tc = time.perf_counter()
            synced = outer.step()
            codec_s = time.perf_counter() - tc
            loss_v = float(torch.stack(losses).mean())
            wall += time.perf_counter() - t0
            rec = {"run": cfg.name, "seed": cfg.seed, "codec": outer.reduction.codec,
                   "error_feedback": cfg.error_feedback, "step": step, "loss": loss_v,
                   "lr": opts[0][1].get_last_lr()[0],
                   "bytes": outer.stats["bytes_sent"] if synced else 0, "raw_bytes": raw_bytes,
                   "codec_ms": 1e3 * codec_s if synced else None, "synced": synced,
                   "wall_s": wall}
            log.write(json.dumps(rec) + "\n")
            if progress is not None:
                progress(step + 1, loss_v)
            if eval_due(cfg, step + 1):
                log_eval(files, progress, step + 1,
                         task.evaluate(_anchor_model(replicas[0], outer.anchor), cfg, test,
                                       device))
            if (step + 1) % cfg.checkpoint_every == 0 and step + 1 < cfg.steps:
                log.flush()
                files.save_checkpoint({
                    "step": step + 1, "wall_s": wall, "outer": outer.state_dict(),
                    "replicas": [trainer_state(m, opt, sched)
                                 for m, (opt, sched) in zip(replicas, opts)]})
    res = finish(files, cfg, numel=sum(p.numel() for p in params[0]), wall=wall)
    files.ckpt.unlink(missing_ok=True)
    return res
