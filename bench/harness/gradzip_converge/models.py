"""DINOv2-style ViT/14 encoder with a DPT depth head.

The encoder follows DINOv2 (Oquab et al. 2023) closely enough that its parameter names match the
released checkpoints (``cls_token``, ``pos_embed``, ``patch_embed.proj``, ``blocks.N.norm1``,
``blocks.N.attn.qkv``, ``blocks.N.ls1.gamma``, ``blocks.N.mlp.fc1``, ``norm``): patch 14, pre-norm
blocks with LayerScale, a CLS token and learned position embeddings that are interpolated
(bicubic) when the input grid differs from the one they were trained at.

The head is DPT (Ranftl et al. 2021) as Depth Anything uses it on DINOv2: four intermediate
layers, each reassembled into an image-like map at 4x, 2x, 1x and 1/2x the patch grid, fused
bottom-up by RefineNet-style blocks, then upsampled to the input size. It predicts log-depth;
``DepthModel.forward`` returns ``exp`` of it, so depth is positive by construction.

Everything here is plain PyTorch: no compiled gradzip code is imported.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

PATCH = 14
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class ViTConfig:
    name: str
    depth: int  # transformer blocks
    width: int  # embedding dimension
    heads: int
    mlp: int  # hidden width of the MLP
    img_size: int = 518  # grid the position embeddings are stored for (518 / 14 = 37, as DINOv2)
    layerscale_init: float = 1e-5
    # DPT head
    features: int = 256
    head_channels: tuple[int, int, int, int] = (256, 512, 1024, 1024)
    layers: tuple[int, ...] = field(default=())  # intermediate blocks fed to the head; () = even

    def tap_layers(self) -> tuple[int, int, int, int]:
        if self.layers:
            return tuple(self.layers)  # type: ignore[return-value]
        return tuple(round((i + 1) * self.depth / 4) - 1 for i in range(4))  # type: ignore


# The DINOv2 widths; vit-t14 is ours: small enough that 4 simulated workers train it on 2 CPU
# cores in a couple of minutes, with the same code paths as the large ones.
CONFIGS: dict[str, ViTConfig] = {
    "vit-l14": ViTConfig("vit-l14", depth=24, width=1024, heads=16, mlp=4096),
    "vit-b14": ViTConfig("vit-b14", depth=12, width=768, heads=12, mlp=3072,
                         features=128, head_channels=(96, 192, 384, 768)),
    "vit-s14": ViTConfig("vit-s14", depth=12, width=384, heads=6, mlp=1536,
                         features=64, head_channels=(48, 96, 192, 384)),
    "vit-t14": ViTConfig("vit-t14", depth=4, width=96, heads=3, mlp=384, img_size=84,
                         layerscale_init=0.1, features=32, head_channels=(24, 48, 96, 96)),
}


def get_config(name: str, **overrides) -> ViTConfig:
    try:
        cfg = CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown ViT config {name!r}; known: {', '.join(CONFIGS)}") from None
    return replace(cfg, **overrides) if overrides else cfg


# ---------------------------------------------------------------------------------------- encoder


class PatchEmbed(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Conv2d(3, width, kernel_size=PATCH, stride=PATCH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)  # (B, h*w, D)


class Attention(nn.Module):
    """Multi-head self-attention; ``causal``: each token attends to itself and those before it."""

    def __init__(self, width: int, heads: int, causal: bool = False):
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not divisible by heads {heads}")
        self.heads, self.causal = heads, causal
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(x.transpose(1, 2).reshape(b, n, d))


class Mlp(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class LayerScale(nn.Module):
    def __init__(self, width: int, init: float):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((width,), init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class Block(nn.Module):
    """Pre-norm transformer block with LayerScale on both residual branches (DINOv2)."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.width, eps=1e-6)
        self.attn = Attention(cfg.width, cfg.heads)
        self.ls1 = LayerScale(cfg.width, cfg.layerscale_init)
        self.norm2 = nn.LayerNorm(cfg.width, eps=1e-6)
        self.mlp = Mlp(cfg.width, cfg.mlp)
        self.ls2 = LayerScale(cfg.width, cfg.layerscale_init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.ls1(self.attn(self.norm1(x)))
        return x + self.ls2(self.mlp(self.norm2(x)))


def resize(x: torch.Tensor, size, mode: str, align_corners: bool) -> torch.Tensor:
    """``F.interpolate`` (bilinear or bicubic), except on CUDA under
    ``torch.use_deterministic_algorithms`` (the GPU suites), where the backward of those kernels,
    which adds with atomics, raises: there the same map goes through ``resize_separable``."""
    if x.is_cuda and torch.are_deterministic_algorithms_enabled():
        return resize_separable(x, size, mode, align_corners)
    return F.interpolate(x, size=size, mode=mode, align_corners=align_corners)


def resize_separable(x: torch.Tensor, size, mode: str, align_corners: bool) -> torch.Tensor:
    """The resize as two matrix products, rows then columns (deterministic forward and backward).
    The 1-D weights are F.interpolate's own, read off an identity (its 2-D resize is their outer
    product); computed in at least fp32, as the kernels compute."""
    dtype = torch.promote_types(x.dtype, torch.float32)

    def weights(n_in: int, n_out: int) -> torch.Tensor:  # (n_out, n_in)
        eye = torch.eye(n_in, dtype=torch.float64).reshape(n_in, 1, n_in, 1)
        w = F.interpolate(eye, size=(n_out, 1), mode=mode, align_corners=align_corners)
        return w.reshape(n_in, n_out).T.to(x.device, dtype)

    rows, cols = weights(x.shape[-2], size[0]), weights(x.shape[-1], size[1])
    with torch.autocast(x.device.type, enabled=False):
        return (rows @ x.to(dtype) @ cols.T).to(x.dtype)


def resize_pos_embed(pos: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """Bicubic resize of (1, 1 + g*g, D) position embeddings to a (h, w) patch grid."""
    cls, patches = pos[:, :1], pos[:, 1:]
    g = math.isqrt(patches.shape[1])
    if g * g != patches.shape[1]:
        raise ValueError(f"position embeddings hold {patches.shape[1]} patches, not a square grid")
    if (g, g) == tuple(grid):
        return pos
    d = patches.shape[2]
    patches = patches.reshape(1, g, g, d).permute(0, 3, 1, 2)
    patches = resize(patches.float(), grid, mode="bicubic", align_corners=False)
    patches = patches.to(pos.dtype).permute(0, 2, 3, 1).reshape(1, grid[0] * grid[1], d)
    return torch.cat([cls, patches], dim=1)


class ViTEncoder(nn.Module):
    def __init__(self, cfg: ViTConfig):
        super().__init__()
        if cfg.img_size % PATCH:
            raise ValueError(f"img_size {cfg.img_size} is not a multiple of the patch size {PATCH}")
        self.cfg = cfg
        grid = cfg.img_size // PATCH
        self.patch_embed = PatchEmbed(cfg.width)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.width))
        self.pos_embed = nn.Parameter(torch.zeros(1, 1 + grid * grid, cfg.width))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.norm = nn.LayerNorm(cfg.width, eps=1e-6)
        self._init_weights()

    def _init_weights(self) -> None:
        if self.pos_embed.is_meta:
            return
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=1e-6)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor, taps: tuple[int, ...] = ()):
        """Returns the final normed tokens and the normed tokens after each block in ``taps``."""
        h, w = x.shape[-2] // PATCH, x.shape[-1] // PATCH
        if x.shape[-2] % PATCH or x.shape[-1] % PATCH:
            raise ValueError(f"input {tuple(x.shape[-2:])} is not a multiple of {PATCH} pixels")
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = x + resize_pos_embed(self.pos_embed, (h, w))
        outs = []
        for i, blk in enumerate(self.blocks):
            x = blk(x)
            if i in taps:
                outs.append(self.norm(x))
        return self.norm(x), outs


# ------------------------------------------------------------------------------------------- head


class ResidualConvUnit(nn.Module):
    def __init__(self, ch: int):
        super().__init__()
        self.conv1 = nn.Conv2d(ch, ch, 3, padding=1)
        self.conv2 = nn.Conv2d(ch, ch, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(F.relu(self.conv1(F.relu(x))))


class FusionBlock(nn.Module):
    """RefineNet-style fusion: add the skip (after a residual unit), refine, upsample, project."""

    def __init__(self, ch: int, skip: bool = True):
        super().__init__()
        # The deepest block has no skip input: no res1 there (DPT keeps an unused one, which
        # DDP would then need find_unused_parameters for).
        self.res1 = ResidualConvUnit(ch) if skip else None
        self.res2 = ResidualConvUnit(ch)
        self.out_conv = nn.Conv2d(ch, ch, 1)

    def forward(self, x, skip=None, size=None):
        if skip is not None:
            x = x + self.res1(skip)
        x = self.res2(x)
        size = size if size is not None else (x.shape[-2] * 2, x.shape[-1] * 2)
        x = resize(x, size, mode="bilinear", align_corners=True)
        return self.out_conv(x)


class DPTHead(nn.Module):
    def __init__(self, cfg: ViTConfig, depth_init: float = 3.0):
        super().__init__()
        d, f, chs = cfg.width, cfg.features, cfg.head_channels
        # "project" readout: each patch token concatenated with the CLS token, then projected.
        self.readout = nn.ModuleList(nn.Sequential(nn.Linear(2 * d, d), nn.GELU()) for _ in chs)
        self.project = nn.ModuleList(nn.Conv2d(d, c, 1) for c in chs)
        self.resize = nn.ModuleList([
            nn.ConvTranspose2d(chs[0], chs[0], 4, stride=4),  # 4x the patch grid
            nn.ConvTranspose2d(chs[1], chs[1], 2, stride=2),  # 2x
            nn.Identity(),  # 1x
            nn.Conv2d(chs[3], chs[3], 3, stride=2, padding=1),  # 1/2x
        ])
        self.layer_rn = nn.ModuleList(nn.Conv2d(c, f, 3, padding=1, bias=False) for c in chs)
        self.fusion = nn.ModuleList(FusionBlock(f, skip=i < 3) for i in range(4))
        self.out1 = nn.Conv2d(f, f // 2, 3, padding=1)
        self.out2 = nn.Sequential(nn.Conv2d(f // 2, 32, 3, padding=1), nn.ReLU(),
                                  nn.Conv2d(32, 1, 1))
        # Start near a plausible indoor depth so the first steps are not spent finding the scale.
        nn.init.zeros_(self.out2[-1].weight)
        nn.init.constant_(self.out2[-1].bias, math.log(depth_init))

    def forward(self, feats: list[torch.Tensor], grid: tuple[int, int], size: tuple[int, int]):
        maps = []
        for i, t in enumerate(feats):
            cls, patches = t[:, :1], t[:, 1:]
            x = self.readout[i](torch.cat([patches, cls.expand_as(patches)], dim=-1))
            x = x.transpose(1, 2).reshape(x.shape[0], -1, *grid)
            maps.append(self.layer_rn[i](self.resize[i](self.project[i](x))))
        l1, l2, l3, l4 = maps
        p = self.fusion[3](l4, size=l3.shape[-2:])
        p = self.fusion[2](p, l3, size=l2.shape[-2:])
        p = self.fusion[1](p, l2, size=l1.shape[-2:])
        p = self.fusion[0](p, l1)
        p = resize(self.out1(p), size, mode="bilinear", align_corners=True)
        return self.out2(p)  # log-depth, (B, 1, H, W)


class DepthModel(nn.Module):
    """ViT/14 encoder + DPT head. ``forward(rgb)`` -> positive metric depth (B, 1, H, W)."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder = ViTEncoder(cfg)
        self.head = DPTHead(cfg)
        self.taps = cfg.tap_layers()
        self.register_buffer("mean", torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(IMAGENET_STD).view(1, 3, 1, 1), persistent=False)
        if len(self.taps) != 4 or not all(0 <= t < cfg.depth for t in self.taps):
            raise ValueError(f"head needs 4 tap layers in [0, {cfg.depth}), got {self.taps}")

    def forward(self, rgb: torch.Tensor) -> torch.Tensor:
        """rgb: (B, 3, H, W) in [0, 1], H and W multiples of 14."""
        grid = (rgb.shape[-2] // PATCH, rgb.shape[-1] // PATCH)
        x = (rgb - self.mean.to(rgb.dtype)) / self.std.to(rgb.dtype)  # what DINOv2 was trained on
        _, feats = self.encoder(x, self.taps)
        log_depth = self.head(feats, grid, rgb.shape[-2:])
        return torch.exp(log_depth.float().clamp(-10.0, 10.0))


def build_model(name: str, **overrides) -> DepthModel:
    """A ViT/14 + DPT depth model by config name (CONFIGS)."""
    return DepthModel(get_config(name, **overrides))


def count_parameters(name: str, part: str = "encoder") -> int:
    """Parameter count of a config, built on the meta device (no memory is allocated)."""
    with torch.device("meta"):
        model = build_model(name)
    module = {"encoder": model.encoder, "head": model.head, "all": model}[part]
    return sum(p.numel() for p in module.parameters())
