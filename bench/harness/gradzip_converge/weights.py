"""Load encoder weights from a local ``.pth``/``.pt`` or ``.safetensors`` file (nothing is fetched).

Accepts DINOv2's released checkpoints (e.g. ``dinov2_vitl14_pretrain.pth``) and state dicts saved
from our own ``ViTEncoder`` or ``DepthModel``. Common wrappers are unwrapped (``{"model": ...}``,
``{"state_dict": ...}``, ``{"teacher": ...}``) and a prefix shared by every key (``module.``,
``backbone.``, ``encoder.``, ``pretrained.``) is stripped. Position embeddings stored for another
square grid are resized bicubically. Anything else that does not match raises ``WeightLoadError``
listing the missing, unexpected and mis-shaped keys.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .models import resize_pos_embed

# DINOv2 keys we knowingly drop: the masked-image-modelling token is unused for dense prediction.
IGNORED_KEYS = {"mask_token"}
PREFIXES = ("module.", "backbone.", "encoder.", "pretrained.")
WRAPPERS = ("model", "state_dict", "teacher", "student")


class WeightLoadError(ValueError):
    pass


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    if not path.is_file():
        raise WeightLoadError(f"{path}: no such file")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        sd = load_file(str(path), device="cpu")
    elif path.suffix in (".pth", ".pt", ".bin"):
        sd = torch.load(path, map_location="cpu", weights_only=True)
    else:
        raise WeightLoadError(f"{path}: expected a .pth, .pt or .safetensors file")
    for _ in range(2):  # e.g. {"model": {"teacher": ...}} is not a thing, but one level often is
        if isinstance(sd, dict):
            inner = [k for k in WRAPPERS if isinstance(sd.get(k), dict)]
            if inner and not any(isinstance(v, torch.Tensor) for v in sd.values()):
                sd = sd[inner[0]]
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise WeightLoadError(f"{path}: does not hold a state dict of tensors")
    return sd


def _strip_prefixes(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    changed = True
    while changed and sd:
        changed = False
        for p in PREFIXES:
            if all(k.startswith(p) for k in sd):
                sd = {k[len(p):]: v for k, v in sd.items()}
                changed = True
    return sd


def load_encoder_weights(encoder: nn.Module, path: str | Path) -> None:
    """Copy weights from ``path`` into ``encoder`` (a ``ViTEncoder``), strictly."""
    sd = _strip_prefixes(read_state_dict(path))
    # A full DepthModel checkpoint: keep the encoder part only.
    if any(k.startswith("encoder.") for k in sd) and any(k.startswith("head.") for k in sd):
        sd = {k[len("encoder."):]: v for k, v in sd.items() if k.startswith("encoder.")}
    own = encoder.state_dict()
    sd = {k: v for k, v in sd.items() if k not in IGNORED_KEYS}
    missing = sorted(set(own) - set(sd))
    unexpected = sorted(set(sd) - set(own))
    wrong = []
    for k in sorted(set(own) & set(sd)):
        if own[k].shape == sd[k].shape:
            continue
        if k == "pos_embed" and sd[k].shape[-1] == own[k].shape[-1]:
            g = int(round((own[k].shape[1] - 1) ** 0.5))
            try:
                sd[k] = resize_pos_embed(sd[k], (g, g))
                continue
            except ValueError:
                pass
        wrong.append(f"{k}: file {tuple(sd[k].shape)} vs model {tuple(own[k].shape)}")
    if missing or unexpected or wrong:
        def show(xs):
            return ", ".join(xs[:8]) + (f" ... (+{len(xs) - 8} more)" if len(xs) > 8 else "")

        parts = [f"{path}: weights do not fit this encoder"]
        if missing:
            parts.append(f"missing {len(missing)}: {show(missing)}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)}: {show(unexpected)}")
        if wrong:
            parts.append(f"shape mismatch {len(wrong)}: {show(wrong)}")
        raise WeightLoadError("; ".join(parts))
    encoder.load_state_dict({k: v.to(own[k].dtype) for k, v in sd.items()}, strict=True)
