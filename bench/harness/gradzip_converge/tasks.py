"""What a run learns, chosen by its model's name (``task_of``): depth from an RGB image (the ViT/14
and U-Net models on scenes) or the next byte of English text (char_lm on text.py's text).

A task is what differs between them for the training loop, the checkpoints and the reports: the
data, the loss of one worker's shard, the evaluation and the names of its metrics (the models
themselves are built by name in zoo.py). Everything else (the schedule, the optimizers, the Reducer
and its bytes, checkpoints, resume, the tables) is the same code for both.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F

from .char_lm import LM_CONFIGS, lm_config
from .conv_depth import CONV_CONFIGS
from .losses import silog_loss
from .metrics import NAMES, MetricAccumulator
from .models import CONFIGS
from .provenance import code_hash
from .scenes import SceneConfig
from .text import TEXTS, fingerprint, load_text


def autocast(cfg, device: torch.device):
    if cfg.amp and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


class Task:
    """The interface; DEPTH and LANGUAGE are its two instances. ``cfg``: a training.RunConfig
    (not imported: training imports this module)."""

    metrics: tuple[str, ...]  # what ``evaluate`` returns, in table order
    headline: str  # the metric a run is compared on with fp32's of its seed (lower is better)
    label: str  # the headline's name in tables and progress lines
    tail: str  # the metric whose mean over a run's last evaluations is also paired with fp32's:
    # steadier than one final evaluation, so the comparison resolves smaller differences
    tail_label: str
    shown: tuple[tuple[str, str], ...]  # summary.md's metric columns: (header, key)
    axis: str  # the headline's axis label in the plots
    loss_axis: str  # the training loss's
    note: str  # summary.md's words on the headline, before its comparison with fp32's

    def models(self) -> tuple[str, ...]:
        raise NotImplementedError

    def data_key(self, cfg) -> tuple:
        """The settings ``load_data`` reads: runs that agree on them share their data."""
        raise NotImplementedError

    def load_data(self, cfg, cache: Path | None) -> tuple[dict, dict]:
        """(train, test); ``cache``: a folder for what is slow to make again."""
        raise NotImplementedError

    def provenance(self, cfg) -> dict | None:
        """What a result depends on besides its settings and the environment, if anything."""
        return None

    def train_size(self, cfg, train: dict) -> int:
        """The number of training samples the steps' batches are drawn from (batch_indices)."""
        raise NotImplementedError

    def shard_loss(self, model, cfg, train: dict, idx: torch.Tensor, device) -> torch.Tensor:
        raise NotImplementedError

    def evaluate(self, model, cfg, test: dict, device) -> dict[str, float]:
        raise NotImplementedError


# ------------------------------------------------------------------------------------------ depth


def procedural_scenes(n: int, seed: int, scene: SceneConfig, cache: Path | None) -> dict:
    """Scenes 0..n-1 of ``seed``, kept in ``cache`` (if given) under a key of everything they
    depend on: rendering takes ~10 ms a scene, and every run of a seed trains on the same ones."""
    from .datasets import ProceduralDepth, materialize  # numpy (an extra): not to build a model

    if cache is None:
        return materialize(ProceduralDepth(n, seed, scene))
    key = json.dumps({"n": n, "seed": seed, "scene": dataclasses.asdict(scene),
                      "code": code_hash()}, sort_keys=True)
    path = cache / f"procedural-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"
    if path.is_file():
        return torch.load(path, weights_only=True)
    full = materialize(ProceduralDepth(n, seed, scene))
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # parallel jobs may render the same scenes
    torch.save(full, tmp)
    os.replace(tmp, path)
    return full


class DepthTask(Task):
    """SILog on (rgb, depth) pairs; evaluated with metrics.NAMES on the held-out images."""

    metrics = NAMES
    headline, label = "abs_rel", "AbsRel"
    # the median-scaled AbsRel: per image, the prediction scaled to the ground truth's median
    tail, tail_label = "abs_rel_med", "AbsRel-med"
    shown = (("AbsRel", "abs_rel"), ("AbsRel, median-scaled", "abs_rel_med"), ("RMSE", "rmse"),
             ("δ1", "delta1"))
    axis, loss_axis, note = "AbsRel on held-out scenes", "SILog training loss", ""

    def models(self) -> tuple[str, ...]:
        return (*CONFIGS, *CONV_CONFIGS)

    def data_key(self, cfg) -> tuple:
        return cfg.data, cfg.image_size, cfg.train_scenes, cfg.test_scenes, cfg.max_depth, cfg.seed

    def load_data(self, cfg, cache: Path | None) -> tuple[dict, dict]:
        """At the run's image size; procedural scenes cached in ``cache``."""
        size = (cfg.image_size, cfg.image_size)
        if cfg.data == "procedural":
            scene = SceneConfig(height=cfg.image_size, width=cfg.image_size,
                                max_depth=cfg.max_depth)
            full = procedural_scenes(cfg.train_scenes + cfg.test_scenes, cfg.seed, scene, cache)
        else:
            from .datasets import materialize, open_dataset

            full = materialize(open_dataset(cfg.data), size)
        n = next(iter(full.values())).shape[0]
        n_test = cfg.test_scenes if cfg.data == "procedural" else max(1, n // 10)
        if n - n_test < 1:
            raise ValueError(f"dataset has {n} samples: too few to hold out {n_test} for testing")
        train = {k: v[: n - n_test] for k, v in full.items()}
        test = {k: v[n - n_test:] for k, v in full.items()}
        return train, test

    def train_size(self, cfg, train: dict) -> int:
        return train["rgb"].shape[0]

    def shard_loss(self, model, cfg, train, idx, device):
        rgb = train["rgb"][idx].to(device, non_blocking=True)
        depth = train["depth"][idx].to(device, non_blocking=True)
        with autocast(cfg, device):
            pred = model(rgb)
        return silog_loss(pred.float(), depth)

    @torch.no_grad()
    def evaluate(self, model, cfg, test, device, batch: int = 16):
        model.eval()
        acc = MetricAccumulator(max_depth=cfg.max_depth)
        n = test["rgb"].shape[0]
        for i in range(0, n, batch):
            with autocast(cfg, device):
                pred = model(test["rgb"][i:i + batch].to(device))
            acc.update(pred.float().cpu(), test["depth"][i:i + batch])
        model.train()
        return acc.compute()


# --------------------------------------------------------------------------------------- language

HOLDOUT = 0.1  # the text's last tenth is the validation text
STRIDE = 16  # training window i starts at byte STRIDE * i: drawing a batch (a permutation of
# the windows) then costs under 1 ms a step on one core, against 10-30 ms with a window at every
# byte
EVAL_WINDOWS = 64  # held-out windows, evenly spaced over the validation text: the same for
# every run and seed


def windows(text: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    """(len(starts), length) int64: the bytes from each start."""
    return text[starts[:, None] + torch.arange(length)].long()


def cross_entropy(model, cfg, batch: torch.Tensor, device,
                  reduction: str = "mean") -> torch.Tensor:
    """The model's loss on predicting each byte of (B, T + 1) ``batch`` from those before it."""
    batch = batch.to(device, non_blocking=True)
    with autocast(cfg, device):
        logits = model(batch[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten(),
                           reduction=reduction)


class LanguageTask(Task):
    """Next-byte cross-entropy on windows of context + 1 bytes of the text named by ``cfg.data``;
    evaluated as the mean cross-entropy over EVAL_WINDOWS held-out windows, in nats per byte
    (``val_loss``) and in bits (``val_bpc``). The text is ASCII but for a few bytes: a byte is a
    character."""

    metrics = ("val_loss", "val_bpc")
    headline, label = "val_loss", "val loss"
    tail, tail_label = "val_loss", "val loss"
    shown = (("val loss (nats/char)", "val_loss"), ("bits/char", "val_bpc"))
    axis = "validation loss on held-out text (nats/char)"
    loss_axis = "cross-entropy training loss (nats/char)"
    note = (f"val loss: the mean cross-entropy of the next byte over {EVAL_WINDOWS} fixed windows "
            "of the held-out text, in nats per byte (character). ")

    def models(self) -> tuple[str, ...]:
        return tuple(LM_CONFIGS)

    def _text(self, cfg) -> str:
        if cfg.data not in TEXTS:
            raise ValueError(f"{cfg.model} is a language model: its data is a text "
                             f"({', '.join(TEXTS)}), not {cfg.data!r}")
        return cfg.data

    def data_key(self, cfg) -> tuple:
        return (self._text(cfg),)  # one text for every seed

    def load_data(self, cfg, cache: Path | None) -> tuple[dict, dict]:
        """The text as bytes, its last HOLDOUT held out. Read once per process (~2 s)."""
        text = torch.frombuffer(bytearray(load_text(self._text(cfg))), dtype=torch.uint8)
        n_val = math.ceil(HOLDOUT * len(text))
        context = lm_config(cfg.model).context
        if min(len(text) - n_val, n_val) <= context:
            raise ValueError(f"{cfg.data}: {len(text)} bytes are too few for windows of "
                             f"{context + 1}")
        return {"text": text[:-n_val]}, {"text": text[-n_val:]}

    def provenance(self, cfg) -> dict:
        return fingerprint(self._text(cfg))

    def train_size(self, cfg, train: dict) -> int:
        return (len(train["text"]) - lm_config(cfg.model).context - 1) // STRIDE + 1

    def shard_loss(self, model, cfg, train, idx, device):
        length = lm_config(cfg.model).context + 1
        return cross_entropy(model, cfg, windows(train["text"], STRIDE * idx, length), device)

    @torch.no_grad()
    def evaluate(self, model, cfg, test, device, batch: int = 16):
        length = lm_config(cfg.model).context + 1
        starts = torch.linspace(0, len(test["text"]) - length, EVAL_WINDOWS).long()
        model.eval()
        total = 0.0
        for i in range(0, EVAL_WINDOWS, batch):
            chunk = windows(test["text"], starts[i:i + batch], length)
            total += float(cross_entropy(model, cfg, chunk, device, reduction="sum"))
        model.train()
        loss = total / (EVAL_WINDOWS * (length - 1))
        return {"val_loss": loss, "val_bpc": loss / math.log(2)}


DEPTH, LANGUAGE = DepthTask(), LanguageTask()
TASKS = (DEPTH, LANGUAGE)


def task_of(model: str) -> Task:
    """The task a model of this name learns."""
    for task in TASKS:
        if model in task.models():
            return task
    raise ValueError(f"unknown model {model!r}; known: "
                     f"{', '.join(m for t in TASKS for m in t.models())}")
