"""Named suites: a base RunConfig and the (codec, error_feedback) runs that share it."""
from __future__ import annotations

from dataclasses import dataclass, replace

from .text import STDLIB_DOCSTRINGS
from .training import RunConfig

# The codec list of the study: the uncompressed baseline, the casts, int8, and the two aggressive
# codecs with and without error feedback, to show what error feedback buys.
STUDY = (("fp32", False), ("bf16", True), ("fp16", True), ("int8", True), ("sign", True),
         ("topk:0.01:values=fp16", True), ("sign", False), ("topk:0.01:values=fp16", False))


# The ~30x codecs' recipe under AdamW spelled out (what "recipe" resolves to in cpu-default's
# runs): the frozen-variance Adam over compressed momentum after an uncompressed warm-up as long as
# the learning rate's, with and without error feedback.
FROZEN = {"optimizer": "frozen-variance-adamw", "compress_warmup": 60}
# The same with the warm-up's buckets in bf16 (half its bytes).
FROZEN_BF16 = dict(FROZEN, warmup_codec="bf16")
# 0/1 Adam's schedule: compressed from step 4, the variance refreshed by exact steps at gaps that
# double every 4 (or 2) refreshes until the end, the warm-up and the refreshes sent in int8 (the
# two-phase int8 average is the same on every rank, so the one state stays identical).
REFRESH_INT8_4 = {"optimizer": "frozen-variance-adamw", "compress_warmup": 4, "warmup_codec": "int8",
                  "refresh_until": 600, "refreshes_per_doubling": 4}
REFRESH_INT8_2 = dict(REFRESH_INT8_4, refreshes_per_doubling=2)
# The longest int8 warm-ups that keep sign at >= 20x over 600 steps: 12 steps before refreshes at
# gaps doubling every 4, or 20 before gaps doubling every 2 (fewer refreshes).
REFRESH_INT8_4_W12 = dict(REFRESH_INT8_4, compress_warmup=12)
REFRESH_INT8_2_W20 = dict(REFRESH_INT8_2, compress_warmup=20)
WHOLE_RUN = (("fp32", False), ("sign", True, REFRESH_INT8_4), ("sign", True, REFRESH_INT8_2),
             ("sign", True, REFRESH_INT8_4_W12), ("sign", True, REFRESH_INT8_2_W20),
             ("topk:0.01:values=fp16", True, REFRESH_INT8_4),
             ("topk:0.01:values=fp16", True, REFRESH_INT8_2))
# The same on the language model, beside the recipe's 60 fp32 steps; and, to tell its two
# suspects apart, the schedule with exact fp32 steps instead of int8 ones (int8's rounding) and
# with 20 warm-up steps instead of 4 (a variance from too few gradients).
REFRESH_FP32_4 = {k: v for k, v in REFRESH_INT8_4.items() if k != "warmup_codec"}
REFRESH_INT8_4_W20 = dict(REFRESH_INT8_4, compress_warmup=20)
LM_WHOLE_RUN = (("fp32", False), ("sign", True), ("sign", True, REFRESH_INT8_4),
                ("sign", True, REFRESH_INT8_2), ("sign", True, REFRESH_FP32_4),
                ("sign", True, REFRESH_INT8_4_W20))
RECIPES = (("fp32", False), ("sign", True, FROZEN), ("sign", False, FROZEN),
           ("topk:0.01:values=fp16", True, FROZEN), ("topk:0.01:values=fp16", False, FROZEN),
           ("sign", True, FROZEN_BF16), ("topk:0.01:values=fp16", True, FROZEN_BF16))
# Top-k's denser forms at the bytes 1 % all-gathered sends with 6 bytes a kept element, on the
# recipes' task: 1.5 % all-gathered and 3 % two-phase (4 bytes a kept element), and 4 % two-phase
# with int8 values (3 bytes).
RECIPES_TOPK = (("fp32", False), ("topk:0.015:values=fp16", True, FROZEN),
                ("topk:0.03:values=fp16", True, dict(FROZEN, cast_sum="fp32")),
                ("topk:0.04:values=int8", True, dict(FROZEN, cast_sum="fp32")))


# Under SGD with momentum (a small U-Net, cpu-sgd): the recipe (top-k: CompressedSGD with momentum
# correction; the others: the compressed gradient for torch's SGD), top-k with DGC's momentum
# masking and local clipping, and without error feedback.
DGC = {"momentum_masking": True, "local_clip_norm": 1.0}
SGD_STUDY = (("fp32", False), ("bf16", True), ("int8", True), ("sign", True), ("sign", False),
             ("topk:0.01:values=fp16", True), ("topk:0.01:values=fp16", False),
             ("topk:0.01:values=fp16", True, DGC))


# The study for a language model: the same codecs but fp16 (bf16 stands for the 2-byte casts).
LM_STUDY = tuple(run for run in STUDY if run[0] != "fp16")


@dataclass(frozen=True)
class Suite:
    name: str
    base: RunConfig
    runs: tuple[tuple, ...]  # (codec, error_feedback) or (codec, error_feedback, {settings})
    device: str  # "cpu" or "cuda"
    about: str

    def configs(self, **overrides) -> list[RunConfig]:
        base = replace(self.base, **overrides)
        return [replace(base, codec=run[0], error_feedback=run[1], **(run[2] if len(run) > 2 else {}))
                for run in self.runs]


CPU_DEFAULT = RunConfig(model="vit-t14", image_size=84, workers=4, batch_per_worker=4, steps=600,
                        warmup_steps=60, lr=2e-3, train_scenes=4096, test_scenes=256,
                        eval_every=100)

CPU_SGD = RunConfig(model="conv-s", image_size=56, workers=4, batch_per_worker=4, steps=600,
                    warmup_steps=30, lr=0.05, weight_decay=0.0, optimizer_family="sgd",
                    train_scenes=4096, test_scenes=256, eval_every=100)

# A byte-level transformer on the standard library's docstrings; 8 windows of 129 bytes a worker.
CPU_LM = RunConfig(model="lm-s", data=STDLIB_DOCSTRINGS, workers=4, batch_per_worker=8, steps=600,
                   warmup_steps=60, lr=2e-3, eval_every=100)

# cpu-lm with the language models' usual gradient clipping (norm 1.0, as nanoGPT's and Hugging Face
# Trainer's default): fp32 clips its averaged gradient, the recipes each worker's in the reduction.
CPU_LM_CLIP = replace(CPU_LM, max_grad_norm=1.0)
CLIP_STUDY = (("fp32", False), ("sign", True), ("topk:0.01:values=fp16", True))

# cpu-lm four times as long (the learning-rate warm-up and the recipe's uncompressed steps kept at
# 60): does the aggressive codecs' gap close as training gets longer, as in the papers' long runs?
CPU_LONG = replace(CPU_LM, steps=2400, eval_every=200, checkpoint_every=200)
LONG_STUDY = (("fp32", False), ("int8", True), ("sign", True), ("topk:0.01:values=fp16", True))

# Top-k's forms on cpu-lm: all-gathered (every rank's k pairs to every rank: the average holds up
# to W k nonzeros, a rank's bytes grow with W) and the two-phase exchange (cast_sum "fp32": each
# shard's owner keeps the top-k of the sum; bytes per rank flat in W), at 1 % and at 2 % (the
# all-gathered 1 %'s bytes at 4 workers); and, with 4 bytes per kept element (a u16 index and an
# fp16 value), the densities that send what 1 % all-gathered sent with 6: 1.5 % all-gathered and
# 3 % two-phase; with 3 bytes (int8 values, a scale per 65536 elements) the same bytes again buy
# 2 % all-gathered and 4 % two-phase.
TWO_PHASE = {"cast_sum": "fp32"}
TOPK_STUDY = (("fp32", False), ("topk:0.01:values=fp16", True),
              ("topk:0.01:values=fp16", True, TWO_PHASE), ("topk:0.02:values=fp16", True, TWO_PHASE),
              ("topk:0.015:values=fp16", True), ("topk:0.03:values=fp16", True, TWO_PHASE),
              ("topk:0.02:values=int8", True), ("topk:0.04:values=int8", True, TWO_PHASE))

# Local steps (gradzip.local_steps, DiLoCo's outer loop) on cpu-lm: each worker trains its own
# replica with AdamW and the replicas sync every H steps, the outer gradient compressed with error
# feedback; beside the per-step fp32 baseline and the arithmetic of PyTorch's bf16 and PowerSGD
# hooks (a bf16 cast without error feedback; rank 4 with it), evaluated every 25 steps for the
# time to a validation loss. Averaging (outer lr 1, no outer momentum) at twice the per-step
# runs' learning rate trained best of the outer settings and learning rates tried on seed 0
# (bench/RESULTS.md); DiLoCo's own (outer Nesterov SGD 0.7 / 0.9) is the first local row.
CPU_LM_LOCAL = replace(CPU_LM, eval_every=25)
AVERAGING = {"outer_lr": 1.0, "outer_momentum": 0.0, "lr": 4e-3}
# SparseLoCo's error feedback as momentum: the outer residual decays by 0.95 after each sync.
SPARSELOCO = {"residual_decay": 0.95}
LOCAL_STUDY = (("fp32", False), ("bf16", False), ("lowrank:4", True),
               ("int8", True, {"local_steps": 10}),
               ("int8", True, {"local_steps": 10, **AVERAGING}),
               ("int8", True, {"local_steps": 50, **AVERAGING}),
               ("sign", True, {"local_steps": 10, **AVERAGING}),
               ("topk:0.02:values=fp16", True, {"local_steps": 10, **AVERAGING}),
               ("topk:0.02:values=fp16", True, {"local_steps": 10, **AVERAGING, **SPARSELOCO}),
               ("sign", True, {"local_steps": 10, **AVERAGING, **SPARSELOCO}))
# Local steps on cpu-recipes' task (the ViT depth model under AdamW): the replicas averaged every
# H steps (cpu-lm-local's outer step), the outer gradient in int8 (or sign), at the task's learning
# rate and at twice it (the language model's best).
RECIPES_LOCAL = (("fp32", False),
                 ("int8", True, {"local_steps": 10, "outer_lr": 1.0, "outer_momentum": 0.0}),
                 ("int8", True, {"local_steps": 10, "outer_lr": 1.0, "outer_momentum": 0.0,
                                 "lr": 2 * CPU_DEFAULT.lr}),
                 ("int8", True, {"local_steps": 50, "outer_lr": 1.0, "outer_momentum": 0.0}),
                 ("int8", True, {"local_steps": 50, "outer_lr": 1.0, "outer_momentum": 0.0,
                                 "lr": 2 * CPU_DEFAULT.lr}),
                 ("sign", True, {"local_steps": 10, "outer_lr": 1.0, "outer_momentum": 0.0,
                                 "lr": 2 * CPU_DEFAULT.lr}))
# The outer settings and learning rates tried on seed 0 before cpu-lm-local's were chosen: H 1 to
# 50, DiLoCo's Nesterov outer SGD and plain averaging, outer momentum and learning rate, the inner
# learning rate (bench/RESULTS.md §3; one seed each).
OUTER_SWEEP = tuple(
    (codec, codec != "fp32", {"local_steps": h, "outer_lr": olr, "outer_momentum": om, "lr": lr})
    for codec, h, olr, om, lr in (
        ("fp32", 10, 0.7, 0.9, 2e-3), ("int8", 10, 0.7, 0.9, 2e-3), ("int8", 50, 0.7, 0.9, 2e-3),
        ("sign", 10, 0.7, 0.9, 2e-3), ("topk:0.02:values=fp16", 10, 0.7, 0.9, 2e-3),
        ("fp32", 1, 1.0, 0.0, 2e-3), ("fp32", 2, 1.0, 0.0, 2e-3), ("fp32", 10, 1.0, 0.0, 2e-3),
        ("fp32", 50, 1.0, 0.0, 2e-3), ("int8", 10, 1.0, 0.0, 2e-3), ("int8", 50, 1.0, 0.0, 2e-3),
        ("fp32", 10, 1.0, 0.5, 2e-3), ("fp32", 10, 0.7, 0.5, 2e-3), ("int8", 10, 2.0, 0.0, 2e-3),
        ("int8", 10, 1.0, 0.9, 2e-3), ("int8", 10, 0.7, 0.7, 2e-3), ("int8", 10, 1.0, 0.0, 4e-3),
        ("int8", 10, 0.7, 0.5, 4e-3), ("int8", 10, 1.0, 0.0, 8e-3), ("int8", 50, 1.0, 0.0, 8e-3)))

SUITES = {
    "cpu-default": Suite(
        "cpu-default",
        CPU_DEFAULT, STUDY, "cpu",
        "vit-t14, 4 simulated workers, 8 codec runs of 600 steps; about 15-20 minutes on 2 cores "
        "with --jobs 2"),
    "cpu-recipes": Suite(
        "cpu-recipes",
        CPU_DEFAULT, RECIPES, "cpu",
        "cpu-default's sign and top-k 1 % under the frozen-variance Adam (60 uncompressed "
        "steps, or 60 steps in bf16: +w60:bf16), with and without error feedback, named by "
        "optimizer and warm-up"),
    "cpu-recipes-topk": Suite(
        "cpu-recipes-topk",
        CPU_DEFAULT, RECIPES_TOPK, "cpu",
        "cpu-recipes' top-k under the frozen-variance Adam at the densities that send what 1 % "
        "all-gathered sent before its indices were compacted: 1.5 % all-gathered and 3 % "
        "two-phase (4 bytes a kept element), 4 % two-phase with int8 values (3 bytes)"),
    "cpu-whole-run": Suite(
        "cpu-whole-run",
        CPU_DEFAULT, WHOLE_RUN, "cpu",
        "cpu-default's settings, sign and top-k 1 % under the frozen-variance Adam compressed from "
        "step 4, its variance refreshed at doubling gaps (0/1 Adam's schedule), the warm-up and "
        "the refreshes in int8: bytes over the whole run against cpu-recipes' 60 fp32 steps"),
    "cpu-lm-whole-run": Suite(
        "cpu-lm-whole-run",
        CPU_LM, LM_WHOLE_RUN, "cpu",
        "cpu-lm's sign under the frozen-variance Adam: the recipe's 60 fp32 steps against "
        "compressed from step 4 with 0/1 Adam's variance refreshes in int8 (cpu-whole-run's)"),
    "cpu-sgd": Suite(
        "cpu-sgd",
        CPU_SGD, SGD_STUDY, "cpu",
        "a small convolutional depth model (conv-s, 56 px) under SGD with momentum 0.9, "
        "4 simulated workers, 600 steps: the SGD recipes, DGC's masking and clipping for top-k"),
    "cpu-lm": Suite(
        "cpu-lm",
        CPU_LM, LM_STUDY, "cpu",
        "a small transformer language model (lm-s) on the Python standard library's docstrings, "
        "AdamW, 4 simulated workers, 600 steps: validation loss (nats/char) against fp32's"),
    "cpu-lm-clip": Suite(
        "cpu-lm-clip",
        CPU_LM_CLIP, CLIP_STUDY, "cpu",
        "cpu-lm with gradient clipping at 1.0: fp32 with clip_grad_norm_, sign and top-k 1 % "
        "under the recipe with max_grad_norm (each worker's gradient, in the reduction)"),
    "cpu-lm-topk": Suite(
        "cpu-lm-topk",
        CPU_LM, TOPK_STUDY, "cpu",
        "cpu-lm's top-k forms under the recipe: all-gathered 1 %, 1.5 % and 2 % (int8 values), "
        "and the two-phase exchange (bytes per rank flat in the number of workers) at 1 %, 2 %, "
        "3 % and 4 % (int8 values)"),
    "cpu-lm-local": Suite(
        "cpu-lm-local",
        CPU_LM_LOCAL, LOCAL_STUDY, "cpu",
        "cpu-lm with local steps: every worker its own replica under AdamW, synced every H steps "
        "(DiLoCo's outer Nesterov SGD, or averaging), the outer gradient in int8, sign or top-k "
        "2 % with error feedback; PyTorch's bf16 and PowerSGD arithmetic per step beside fp32"),
    "cpu-recipes-local": Suite(
        "cpu-recipes-local",
        CPU_DEFAULT, RECIPES_LOCAL, "cpu",
        "cpu-recipes' task with local steps: every worker its own replica under AdamW, the "
        "replicas averaged every 10 or 50 steps, the outer gradient in int8 or sign"),
    "cpu-lm-local-sweep": Suite(
        "cpu-lm-local-sweep",
        CPU_LM_LOCAL, (("fp32", False),) + OUTER_SWEEP, "cpu",
        "cpu-lm-local's outer settings and inner learning rates, one seed each: how its runs' "
        "settings were chosen"),
    "cpu-long": Suite(
        "cpu-long",
        CPU_LONG, LONG_STUDY, "cpu",
        "cpu-lm at 2400 steps (4x): fp32, int8, and sign and top-k 1 % with the recipe; 10-15 "
        "minutes a run on one busy core"),
    "cpu-smoke": Suite(
        "cpu-smoke",
        RunConfig(model="vit-t14", image_size=56, workers=2, batch_per_worker=2, steps=30,
                  warmup_steps=5, lr=2e-3, train_scenes=32, test_scenes=8,
                  checkpoint_every=10, eval_every=10),
        (("fp32", False), ("int8", True)), "cpu", "two codecs, a few seconds each (CI)"),
    "gpu-vitl14": Suite(
        "gpu-vitl14",
        RunConfig(model="vit-l14", image_size=266, workers=4, batch_per_worker=4, steps=400,
                  warmup_steps=40, lr=1e-4, train_scenes=1024, test_scenes=64,
                  checkpoint_every=100, eval_every=100),
        STUDY, "cuda", "vit-l14 (304M encoder) on one GPU, 4 simulated workers, bf16 autocast"),
}


def get_suite(name: str) -> Suite:
    try:
        return SUITES[name]
    except KeyError:
        raise ValueError(f"unknown suite {name!r}; known: {', '.join(SUITES)}") from None
