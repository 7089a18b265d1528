"""One training run under one codec: data, schedule, steps, checkpoints, eval. What the model
learns (depth, or the next byte of a text) is the run's task (tasks.py), chosen by the model's name.

The same run is defined for both modes: at step s the global batch is drawn from a generator
seeded by (seed, s) and split into W equal shards, shard w going to worker (or rank) w. In the
simulated mode (``train_simulated``) one process computes the W shard gradients one after the
other and hands them to ``Reducer``; in the DDP and FSDP modes (``distributed.train_distributed``)
rank w computes shard w and ``compress_hook`` (or gradzip.fsdp's reduce-scatter) reduces. Runs resume from their last checkpoint bit for bit: the
batch of a step does not depend on earlier steps, and the checkpoint carries model, optimiser,
scheduler and error-feedback state.

A run is evaluated on the test set every ``eval_every`` steps and after its last step (the
result's metrics are those of that last evaluation). Its files (``RunFiles``) are its own, so
runs can go in parallel processes; a result or checkpoint counts only under the key it was
written with: the RunConfig, ``provenance.environment()`` (code version, torch, threads...) and
whatever else the task's data depends on (a text's SHA-256).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from gradzip.local_steps import OUTER_LR, OUTER_MOMENTUM
from gradzip.optim import CompressedSGD, FrozenVarianceAdamW
from gradzip.optim import compresses_direction as recipe

from .compression import BASELINE, Reducer, canonical_codec
from .provenance import environment
from .tasks import task_of
from .weights import load_encoder_weights
from .zoo import build


@dataclass(frozen=True)
class RunConfig:
    model: str = "vit-t14"
    image_size: int = 84  # square input, a multiple of 14
    workers: int = 4
    batch_per_worker: int = 4
    steps: int = 300
    warmup_steps: int = 30
    lr: float = 1e-3
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.05
    codec: str = BASELINE
    error_feedback: bool = True
    optimizer: str = "recipe"  # one of OPTIMIZERS, or "recipe": gradzip.optim.compresses_direction's
    optimizer_family: str = "adamw"  # what "recipe" chooses within: "adamw" or "sgd" (momentum 0.9)
    momentum_masking: bool = False  # compressed-sgd: DGC's momentum factor masking (top-k)
    local_clip_norm: float | None = None  # compressed-sgd: DGC's local gradient clipping
    refresh_until: int = 0  # frozen-variance-adamw: 0/1 Adam's variance refreshes (exact steps at
    # growing gaps after the warm-up) before this step; 0: none, the variance frozen at its end
    refreshes_per_doubling: int = 16  # frozen-variance-adamw: refreshes before each gap doubles
    compress_warmup: int | None = None  # the first steps uncompressed (exact fp32 averages, bytes
    # counted); None: the optimizer's need (compress_warmup_steps)
    warmup_codec: str | None = None  # the warm-up's buckets in this codec (e.g. bf16; no error
    # feedback, bytes counted); None: fp32
    param_codec: str | None = None  # FSDP only: its parameter all-gathers in this codec
    cast_sum: str | None = None  # CompressionState's (e.g. "fp32": top-k's two-phase exchange);
    # None: its default
    uncompressed_numel: int = 0  # int8/sign: 1-D tensors and those under N elements sent in fp32
    residual_dtype: str = "fp32"  # the error-feedback residuals' dtype: "bf16" is the compact
    # state (half the bytes, each update rounded to bfloat16)
    ranks_per_node: int = 1  # R > 1: the workers are nodes of R ranks, reduced in two levels
    # (gradzip.two_level: exact inside a node, the codec between nodes); the fp32 baseline is flat
    max_grad_norm: float | None = None  # gradient clipping where the loop can clip: torch's
    # clip_grad_norm_ on the averaged gradient, or each worker's in the reduction for gradzip.optim's
    local_steps: int = 0  # H > 0: every worker trains its own replica with torch's optimizer and
    # the replicas sync every H steps, the outer gradient in ``codec`` (gradzip.local_steps)
    outer_lr: float = OUTER_LR  # local steps: the outer Nesterov SGD's (DiLoCo's defaults)
    outer_momentum: float = OUTER_MOMENTUM
    residual_decay: float = 1.0  # local steps: the outer residual scaled by it after each sync
    # (SparseLoCo's error feedback as momentum; gradzip.local_steps)
    seed: int = 0
    data: str = "procedural"  # or nyu:FILE / kitti:DEPTH,RAW / folder:DIR; a language model's:
    # a text of text.TEXTS (the image and scene settings do not apply to it)
    train_scenes: int = 512  # procedural only
    test_scenes: int = 64
    max_depth: float = 10.0  # evaluation cap (NYU: 10 m; KITTI: 80 m)
    checkpoint_every: int = 100
    eval_every: int = 0  # test-set evaluation every this many steps (0: after the last one only)
    bucket_cap_mb: float = 25.0  # DDP's default bucket size; simulated buckets are cut alike
    weights: str | None = None  # encoder weights (.pth / .safetensors)
    amp: bool = True  # bf16 autocast when on CUDA

    @property
    def name(self) -> str:
        codec = canonical_codec(self.codec)
        name = codec if self.error_feedback or codec == BASELINE else f"{codec}-noef"
        if self.optimizer != "recipe":
            name += f"+{self.optimizer}"
        name += "+mask" if self.momentum_masking else ""
        name += f"+clip{self.local_clip_norm:g}" if self.local_clip_norm is not None else ""
        name += (f"+r{self.refresh_until}x{self.refreshes_per_doubling}" if self.refresh_until
                 else "")
        name += f"+w{self.compress_warmup}" if self.compress_warmup is not None else ""
        name += f":{canonical_codec(self.warmup_codec)}" if self.warmup_codec else ""
        name += f"+u{self.uncompressed_numel}" if self.uncompressed_numel else ""
        name += f"+res{self.residual_dtype}" if self.residual_dtype != "fp32" else ""
        name += (f"+{self.workers // self.ranks_per_node}x{self.ranks_per_node}"
                 if self.ranks_per_node > 1 and codec != BASELINE else "")
        name += f"+gclip{self.max_grad_norm:g}" if self.max_grad_norm is not None else ""
        name += f"@{self.cast_sum}" if self.cast_sum else ""  # the cost model's spelling
        # local steps: the inner learning rate too (replicas on 1/W of the batch want another)
        name += f"+H{self.local_steps}+ilr{self.lr:g}" if self.local_steps else ""
        name += (f"+olr{self.outer_lr:g}" if self.local_steps and self.outer_lr != OUTER_LR
                 else "")
        name += (f"+om{self.outer_momentum:g}"
                 if self.local_steps and self.outer_momentum != OUTER_MOMENTUM else "")
        name += f"+ed{self.residual_decay:g}" if self.residual_decay != 1.0 else ""
        return name + (f"+params={self.param_codec}" if self.param_codec else "")


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine from 1 down to ``min_ratio``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def batch_indices(seed: int, step: int, n: int, count: int) -> torch.Tensor:
    """The global batch of ``step``: a function of (seed, step) only, so resuming is exact."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    if count <= n:
        return torch.randperm(n, generator=g)[:count]
    return torch.randint(n, (count,), generator=g)


def setup_process(device: torch.device, threads: int) -> None:
    """Per-process settings every run depends on; called before anything touches CUDA."""
    torch.set_num_threads(threads)
    try:
        import gradzip

        gradzip.set_num_threads(threads)
    except ImportError:  # extension not built: only the baseline can run anyway
        pass
    if device.type == "cuda":
        # Bit-reproducible GPU runs: cuBLAS reads its workspace setting when it initialises, cuDNN
        # must not choose kernels by timing them, and an op without a deterministic kernel raises
        # instead of varying silently.
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        torch.use_deterministic_algorithms(True, warn_only=False)
        torch.backends.cudnn.benchmark = False


def data_key(cfg: RunConfig) -> tuple:
    """The settings ``load_data`` reads: runs that agree on them share their data."""
    return task_of(cfg.model).data_key(cfg)


def load_data(cfg: RunConfig, cache: Path | None = None) -> tuple[dict, dict]:
    """(train, test) of the run's task; what is slow to make (procedural scenes) cached in
    ``cache``."""
    return task_of(cfg.model).load_data(cfg, cache)


def make_model(cfg: RunConfig, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(cfg.seed)  # every codec starts from the same weights
    model = build(cfg.model)
    if cfg.weights and not hasattr(model, "encoder"):
        raise ValueError(f"{cfg.model} has no pretrained encoder to load {cfg.weights} into")
    if cfg.weights:
        load_encoder_weights(model.encoder, cfg.weights)
    return model.to(device)


# The optimizers a run can name; gradzip.optim's need the Reducer or CompressionState to be given
# them (hook_optimizer). Betas and eps: AdamW's defaults for all; SGD's momentum 0.9 (torch's SGD
# couples its weight decay to the gradient, CompressedSGD decouples it: the SGD suite runs none).
# "amsgrad": COMP-AMS's form, torch's AdamW with AMSGrad's running maximum of the variance on the
# averaged error-feedback gradients (one state, identical on every rank, as for "adamw").
OPTIMIZERS = {"adamw": torch.optim.AdamW, "frozen-variance-adamw": FrozenVarianceAdamW,
              "amsgrad": torch.optim.AdamW, "sgd": torch.optim.SGD,
              "compressed-sgd": CompressedSGD}
FAMILIES = {"adamw": ("adamw", "frozen-variance-adamw"), "sgd": ("sgd", "compressed-sgd")}


def optimizer_name(cfg: RunConfig) -> str:
    """The run's optimizer; "recipe" resolves to gradzip.optim.compresses_direction's choice for
    the codec in the run's optimizer family (the gradzip.optim optimizer where it is one)."""
    if cfg.optimizer_family not in FAMILIES:
        raise ValueError(f"unknown optimizer_family {cfg.optimizer_family!r}; known: "
                         f"{', '.join(FAMILIES)}")
    if cfg.optimizer != "recipe":
        if cfg.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {cfg.optimizer!r}; known: recipe, "
                             f"{', '.join(OPTIMIZERS)}")
        name = cfg.optimizer
    else:  # local steps: torch's optimizer trains each replica (the outer gradient is compressed)
        direction = (canonical_codec(cfg.codec) != BASELINE and not cfg.local_steps
                     and recipe(cfg.codec, cfg.optimizer_family))
        name = FAMILIES[cfg.optimizer_family][int(bool(direction))]
    if (cfg.momentum_masking or cfg.local_clip_norm is not None) and name != "compressed-sgd":
        raise ValueError(f"{cfg.name}: momentum_masking and local_clip_norm are CompressedSGD's "
                         f"options; this run's optimizer is {name}")
    if cfg.ranks_per_node > 1 and name in ("frozen-variance-adamw", "compressed-sgd"):
        raise ValueError(f"{cfg.name}: the two-level reduction runs torch's optimizers, not "
                         f"{name} (its state is the whole bucket's): pass --optimizer adamw or sgd")
    if cfg.residual_decay != 1.0 and not cfg.local_steps:
        raise ValueError(f"{cfg.name}: residual_decay scales the outer residual of local steps "
                         "(local_steps > 0)")
    return name


def compress_warmup_steps(cfg: RunConfig) -> int:
    """The run's uncompressed first steps: ``compress_warmup`` where set; else, for an optimizer
    that measures its variance before freezing it, the learning rate's warm-up (where 0/1 Adam
    freezes it: the variance has settled by then), and none for the others."""
    if cfg.compress_warmup is not None:
        return cfg.compress_warmup
    return cfg.warmup_steps if optimizer_name(cfg) == "frozen-variance-adamw" else 0


def hook_optimizer(opt):
    """``opt`` if the reduction must compute its direction (a gradzip.optim optimizer), else None."""
    return opt if getattr(opt, "direction", None) is not None else None


def reduction_clip(cfg: RunConfig, opt):
    """The reduction's max_grad_norm: the run's where the reduction computes the optimizer's
    direction (p.grad then holds the update, which clip_grad_norm_ must not touch), else None."""
    return cfg.max_grad_norm if hook_optimizer(opt) is not None else None


def clip_averaged(cfg: RunConfig, opt, params) -> None:
    """The usual loop's clip_grad_norm_ on the averaged gradient, where p.grad holds it."""
    if cfg.max_grad_norm is not None and hook_optimizer(opt) is None:
        torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)


def make_optimizer(cfg: RunConfig, model: torch.nn.Module, sharded: bool = False):
    """The run's optimizer (optimizer_name) and its schedule. ``sharded`` (FSDP): CompressedSGD,
    whose velocity is each rank's of the whole gradient, has no FSDP form, and torch's SGD trains
    those runs; FrozenVarianceAdamW has one (gradzip.fsdp's optimizer=), taken where the run names
    it: the recipe stays torch's AdamW there, which trained sign better under FSDP (RESULTS §3)."""
    decay, no_decay = [], []
    for n, p in model.named_parameters():  # no decay on norms, biases, tokens and LayerScale
        (no_decay if p.ndim <= 1 or n.endswith(("cls_token", "pos_embed")) else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    name = optimizer_name(cfg)
    if sharded and name == "compressed-sgd":
        name = "sgd"
    if sharded and name == "frozen-variance-adamw" and cfg.optimizer == "recipe":
        name = "adamw"
    if cfg.refresh_until and name != "frozen-variance-adamw":
        raise ValueError(f"{cfg.name}: refresh_until is FrozenVarianceAdamW's option; this run's "
                         f"optimizer is {name}")
    options = {"amsgrad": {"amsgrad": True}, "sgd": {"momentum": 0.9},
               "frozen-variance-adamw": {"refresh_until": cfg.refresh_until,
                                         "refreshes_per_doubling": cfg.refreshes_per_doubling},
               "compressed-sgd": {"momentum": 0.9, "momentum_masking": cfg.momentum_masking,
                                  "local_clip_norm": cfg.local_clip_norm}}.get(name, {})
    opt = OPTIMIZERS[name](groups, lr=cfg.lr, **options)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio))
    return opt, sched


def log_eval(files: "RunFiles", progress, done: int, metrics: dict) -> None:
    """Records an evaluation, and shows it where the progress reporter shows evaluations."""
    files.log_eval(done, metrics)
    if hasattr(progress, "evaluated"):
        progress.evaluated(done, metrics)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


def eval_due(cfg: RunConfig, done: int) -> bool:
    """Whether the model is evaluated after ``done`` steps."""
    return done == cfg.steps or (cfg.eval_every > 0 and done % cfg.eval_every == 0)


def run_stem(run: str, seed: int) -> str:
    """The file name (without suffix) of a run's result and logs in ``out/runs``."""
    return f"{run.replace(':', '_')}-s{seed}"  # "topk:0.01": not a portable name


class RunFiles:
    """Where a run (one RunConfig, one seed) keeps its checkpoint, its result and its logs:
    ``steps`` (one line per step; "step" counts from 0) and ``evals`` (one line per evaluation;
    "step" is the number of steps trained)."""

    def __init__(self, out: Path, cfg: RunConfig):
        self.cfg = cfg
        stem = run_stem(cfg.name, cfg.seed)
        self.ckpt = out / "checkpoints" / f"{stem}.pt"
        self.result = out / "runs" / f"{stem}.json"
        self.steps = out / "runs" / f"{stem}.steps.jsonl"
        self.evals = out / "runs" / f"{stem}.evals.jsonl"
        self.key = {"config": dataclasses.asdict(cfg), "environment": environment()}
        if (data := task_of(cfg.model).provenance(cfg)) is not None:
            self.key["data"] = data  # e.g. the text's SHA-256
        self.ckpt.parent.mkdir(parents=True, exist_ok=True)
        self.result.parent.mkdir(parents=True, exist_ok=True)

    def _current(self, saved: dict) -> bool:
        return all(saved.get(k) == v for k, v in self.key.items())

    def done(self) -> dict | None:
        if not self.result.is_file():
            return None
        res = json.loads(self.result.read_text())
        return res if self._current(res) else None

    def resume(self, restore) -> tuple[int, float]:
        """The step and wall seconds to go on from: the checkpoint's, once ``restore(state)`` has
        loaded it into the trainer, else 0; the logs are cut back to that step."""
        start, wall = 0, 0.0
        if (state := self.load_checkpoint()) is not None:
            restore(state)
            start, wall = state["step"], state["wall_s"]
        self.truncate_logs(start)
        return start, wall

    def truncate_logs(self, start: int) -> None:
        """Drop the log lines of what comes after step ``start`` (it is about to be redone)."""
        for path, keep in ((self.steps, lambda r: r["step"] < start),
                           (self.evals, lambda r: r["step"] <= start)):
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in read_jsonl(path) if keep(r)))
            os.replace(tmp, path)

    def log_eval(self, step: int, metrics: dict) -> None:
        with open(self.evals, "a") as f:
            f.write(json.dumps({"run": self.cfg.name, "seed": self.cfg.seed, "step": step,
                                **metrics}) + "\n")

    def save_checkpoint(self, state: dict) -> None:
        tmp = self.ckpt.with_suffix(".tmp")
        torch.save({**self.key, **state}, tmp)
        os.replace(tmp, self.ckpt)  # atomic: an interrupted save leaves the previous one

    def load_checkpoint(self) -> dict | None:
        if not self.ckpt.is_file():
            return None
        state = torch.load(self.ckpt, map_location="cpu", weights_only=False)
        return state if self._current(state) else None

    def write_result(self, res: dict) -> None:
        self.result.write_text(json.dumps(res, indent=1))


def trainer_state(model, opt, sched) -> dict:
    """What a checkpoint holds of one trained model: its weights, optimizer and schedule."""
    return {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}


def load_trainer(state: dict, model, opt, sched) -> None:
    """Restores what ``trainer_state`` saved."""
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    sched.load_state_dict(state["sched"])


def flat_grads(params: list[torch.Tensor], grads) -> torch.Tensor:
    return torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1).float()
                      for p, g in zip(params, grads)])


def assign_grads(params: list[torch.Tensor], flat: torch.Tensor) -> None:
    off = 0
    for p in params:
        n = p.numel()
        p.grad = flat[off:off + n].view_as(p).to(p.dtype)
        off += n


def train_simulated(cfg: RunConfig, out: Path, data: tuple[dict, dict], device: torch.device,
                    progress=None) -> dict:
    """Run (or resume, or skip if finished) one codec with W simulated workers; returns the
    result dict written to ``out/runs/<name>-s<seed>.json``."""
    files = RunFiles(out, cfg)
    if (res := files.done()) is not None:
        return res
    train, test = data
    task = task_of(cfg.model)
    model = make_model(cfg, device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt, sched = make_optimizer(cfg, model)
    reducer = Reducer(cfg.codec, cfg.workers, cfg.error_feedback,
                      param_shapes=[tuple(p.shape) for p in params],
                      bucket_cap_mb=cfg.bucket_cap_mb, warmup_steps=compress_warmup_steps(cfg),
                      optimizer=hook_optimizer(opt), warmup_codec=cfg.warmup_codec,
                      uncompressed_numel=cfg.uncompressed_numel,
                      max_grad_norm=reduction_clip(cfg, opt), cast_sum=cfg.cast_sum,
                      residual_dtype=cfg.residual_dtype, ranks_per_node=cfg.ranks_per_node)

    def restore(state):
        load_trainer(state, model, opt, sched)
        reducer.load_state_dict(state["reducer"])

    start, wall = files.resume(restore)
    n_train = task.train_size(cfg, train)
    b = cfg.batch_per_worker
    model.train()
    with open(files.steps, "a") as log:
        for step in range(start, cfg.steps):
            t0 = time.perf_counter()
            idx = batch_indices(cfg.seed, step, n_train, cfg.workers * b)
            grads, losses = [], []
            for w in range(cfg.workers):
                loss = task.shard_loss(model, cfg, train, idx[w * b:(w + 1) * b], device)
                grads.append(flat_grads(params, torch.autograd.grad(loss, params,
                                                                    allow_unused=True)))
                losses.append(loss.detach())
            tc = time.perf_counter()
            avg = reducer.reduce(grads)
            if device.type == "cuda":
                torch.cuda.synchronize()
            codec_s = time.perf_counter() - tc
            assign_grads(params, avg)
            clip_averaged(cfg, opt, params)
            opt.step()
            sched.step()
            loss_v = float(torch.stack(losses).mean())
            wall += time.perf_counter() - t0
            rec = {"run": cfg.name, "seed": cfg.seed, "codec": reducer.codec,
                   "error_feedback": cfg.error_feedback, "step": step, "loss": loss_v,
                   "lr": sched.get_last_lr()[0], "bytes": reducer.bytes_per_step,
                   "raw_bytes": reducer.raw_bytes_per_step, "codec_ms": 1e3 * codec_s, "wall_s": wall}
            log.write(json.dumps(rec) + "\n")
            if progress is not None:
                progress(step + 1, loss_v)
            if eval_due(cfg, step + 1):
                log_eval(files, progress, step + 1, task.evaluate(model, cfg, test, device))
            if (step + 1) % cfg.checkpoint_every == 0 and step + 1 < cfg.steps:
                log.flush()
                files.save_checkpoint({"step": step + 1, "wall_s": wall,
                                       **trainer_state(model, opt, sched),
                                       "reducer": reducer.state_dict()})
    res = finish(files, cfg, numel=sum(p.numel() for p in params), wall=wall)
    files.ckpt.unlink(missing_ok=True)
    return res


def finish(files: RunFiles, cfg: RunConfig, numel: int, wall: float) -> dict:
    """Summarise a finished run from its log lines (bytes, codec time) and its last evaluation."""
    recs = read_jsonl(files.steps)
    if len(recs) != cfg.steps:
        raise RuntimeError(f"{cfg.name}: log holds {len(recs)} steps, expected {cfg.steps}")
    evals = read_jsonl(files.evals)
    if not evals or evals[-1]["step"] != cfg.steps:
        raise RuntimeError(f"{cfg.name}: no evaluation after the last step in {files.evals}")
    metrics = {k: evals[-1][k] for k in task_of(cfg.model).metrics}
    total_bytes = sum(r["bytes"] for r in recs)
    bytes_per_step = total_bytes / len(recs)
    raw_bytes = sum(r["raw_bytes"] for r in recs) / len(recs)
    # the ratio once compressing, beside compression_ratio's over the whole run (warm-up included)
    steady = recs[compress_warmup_steps(cfg):] or recs
    steady_ratio = sum(r["raw_bytes"] for r in steady) / sum(r["bytes"] for r in steady)
    codec_ms = [r["codec_ms"] for r in recs if r.get("codec_ms") is not None]
    res = {"run": cfg.name, "codec": canonical_codec(cfg.codec),
           "error_feedback": cfg.error_feedback, "seed": cfg.seed, "params": numel,
           "bytes_per_step": bytes_per_step, "total_bytes": total_bytes,
           "compression_ratio": raw_bytes / bytes_per_step, "steady_ratio": steady_ratio,
           "codec_ms": sum(codec_ms) / len(codec_ms) if codec_ms else None,
           "final_loss": sum(r["loss"] for r in recs[-10:]) / len(recs[-10:]),
           "wall_s": wall, **metrics, **files.key}
    files.write_result(res)
    return res
