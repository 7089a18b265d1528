"""A small convolutional depth model (a U-Net), for the suite where SGD with momentum is the
natural optimizer: convolutional networks are what SGD with momentum trains well, and what Deep
Gradient Compression was measured on.

Each stage is two 3x3 convolutions with GroupNorm and ReLU (GroupNorm, not BatchNorm: simulated
workers run their shards one after the other through the same module, and batch statistics would
then differ between the simulation and DDP); the encoder halves the resolution three times, the
decoder upsamples back, adding the encoder's map of the same size. It predicts log-depth, and
``forward`` returns ``exp`` of it as the ViT model does. Plain PyTorch, no gradzip code.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .models import IMAGENET_MEAN, IMAGENET_STD

# name -> channels per stage, full resolution first
CONV_CONFIGS: dict[str, tuple[int, ...]] = {"conv-s": (16, 32, 64, 128)}


def conv_block(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
        nn.GroupNorm(8, cout), nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False),
        nn.GroupNorm(8, cout), nn.ReLU(inplace=True))


class ConvDepthModel(nn.Module):
    """``forward(rgb)``: rgb (B, 3, H, W) in [0, 1] -> positive depth (B, 1, H, W), any H, W."""

    def __init__(self, name: str):
        super().__init__()
        try:
            ch = CONV_CONFIGS[name]
        except KeyError:
            raise ValueError(f"unknown conv model {name!r}; known: {', '.join(CONV_CONFIGS)}") \
                from None
        self.down = nn.ModuleList([conv_block(3, ch[0])] + [
            conv_block(a, b, stride=2) for a, b in zip(ch[:-1], ch[1:])])
        self.up = nn.ModuleList([conv_block(b, a) for a, b in zip(ch[:-1], ch[1:])])
        self.out = nn.Conv2d(ch[0], 1, 1)
        nn.init.zeros_(self.out.weight)
        nn.init.constant_(self.out.bias, 1.0)  # exp(1) ~ 2.7 m: a scene's typical depth
        self.register_buffer("mean", torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(IMAGENET_STD).view(1, 3, 1, 1), persistent=False)

    def forward(self, rgb: torch.Tensor) -> torch.Tensor:
        x = (rgb - self.mean.to(rgb.dtype)) / self.std.to(rgb.dtype)
        skips = []
        for stage in self.down:
            x = stage(x)
            skips.append(x)
        x = skips.pop()
        for stage in reversed(self.up):
            x = stage(x)
            skip = skips.pop()
            x = F.interpolate(x, size=skip.shape[-2:], mode="bilinear", align_corners=False) + skip
        return torch.exp(self.out(x).float().clamp(-10.0, 10.0))
