"""Named suites: a base RunConfig and the (codec, error_feedback) runs that share it."""
from __future__ import annotations

from dataclasses import dataclass, replace

from .training import RunConfig

# The codec list of the study: the uncompressed baseline, the casts, int8, and the two aggressive
# codecs with and without error feedback, to show what error feedback buys.
STUDY = (("fp32", False), ("bf16", True), ("fp16", True), ("int8", True), ("sign", True),
         ("topk:0.01:values=fp16", True), ("sign", False), ("topk:0.01:values=fp16", False))


@dataclass(frozen=True)
class Suite:
    name: str
    base: RunConfig
    runs: tuple[tuple[str, bool], ...]
    device: str  # "cpu" or "cuda"
    about: str

    def configs(self, **overrides) -> list[RunConfig]:
        base = replace(self.base, **overrides)
        return [replace(base, codec=c, error_feedback=ef) for c, ef in self.runs]


SUITES = {
    "cpu-default": Suite(
        "cpu-default",
        RunConfig(model="vit-t14", image_size=84, workers=4, batch_per_worker=4, steps=600,
                  warmup_steps=60, lr=2e-3, train_scenes=4096, test_scenes=256, eval_every=100),
        STUDY, "cpu", "vit-t14, 4 simulated workers, 8 codec runs of 600 steps; about 15-20 "
                      "minutes on 2 cores with --jobs 2"),
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
