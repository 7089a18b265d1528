"""A small decoder-only transformer language model over bytes (GPT-2's layout at a toy size).

Tokens are the 256 byte values, so any text is its own encoding and no tokenizer has to be kept in
step with the data. Pre-LayerNorm blocks (causal self-attention, then a GELU MLP), learned
position embeddings, a final LayerNorm and an untied output projection to the 256 byte logits.
Every weight matrix starts at N(0, 0.02), biases at 0, so the logits start near 0 and the loss
near ln 256. ``forward(tokens)``: (B, T) integer bytes, T <= context -> (B, T, 256) logits of the
next byte. Plain PyTorch, no gradzip code.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .models import Attention, Mlp

VOCAB = 256  # byte values


@dataclass(frozen=True)
class LMConfig:
    layers: int
    width: int
    heads: int
    context: int  # the longest input, in bytes
    mlp_ratio: int = 4


# lm-s: sized for 600 steps of 4 simulated workers in 2-3 minutes on one core. At that cost,
# 2 layers with 8 windows a worker ended near 1.85 nats/char, 4 layers with 4 windows at 2.2-2.3
# (still leaving the plateau where a byte is predicted from the one before). lm-t: the tests'.
LM_CONFIGS: dict[str, LMConfig] = {
    "lm-s": LMConfig(layers=2, width=128, heads=4, context=128),
    "lm-t": LMConfig(layers=1, width=32, heads=2, context=16),
}


def lm_config(name: str) -> LMConfig:
    try:
        return LM_CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown language model {name!r}; known: {', '.join(LM_CONFIGS)}") \
            from None


class Block(nn.Module):
    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.width)
        self.attn = Attention(cfg.width, cfg.heads, causal=True)
        self.norm2 = nn.LayerNorm(cfg.width)
        self.mlp = Mlp(cfg.width, cfg.mlp_ratio * cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class CharLM(nn.Module):
    def __init__(self, name: str):
        super().__init__()
        self.cfg = cfg = lm_config(name)
        self.embed = nn.Embedding(VOCAB, cfg.width)
        self.pos_embed = nn.Parameter(torch.zeros(1, cfg.context, cfg.width))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, VOCAB)
        if not self.pos_embed.is_meta:
            for p in (self.embed.weight, self.pos_embed):
                nn.init.normal_(p, std=0.02)
            for m in self.modules():
                if isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, std=0.02)
                    nn.init.zeros_(m.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.cfg.context:
            raise ValueError(f"input of {t} bytes is longer than the context ({self.cfg.context})")
        x = self.embed(tokens) + self.pos_embed[:, :t]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))
