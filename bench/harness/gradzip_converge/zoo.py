"""Every model the harness trains, built by name from torch alone: no data and none of the
``converge`` extras (numpy, PIL), so the cost model can read a model's tensors without them."""
from __future__ import annotations

from torch import nn

from .char_lm import LM_CONFIGS, CharLM
from .conv_depth import CONV_CONFIGS, ConvDepthModel
from .models import CONFIGS, build_model


def model_names() -> tuple[str, ...]:
    return (*CONFIGS, *CONV_CONFIGS, *LM_CONFIGS)


def build(name: str) -> nn.Module:
    """The model of this name: a ViT/14 depth model, the convolutional U-Net or a byte-level LM."""
    if name in CONV_CONFIGS:
        return ConvDepthModel(name)
    if name in LM_CONFIGS:
        return CharLM(name)
    if name in CONFIGS:
        return build_model(name)
    raise ValueError(f"unknown model {name!r}; known: {', '.join(model_names())}")
