"""The ViT/14 depth model: parameter counts, shapes, positivity, and local weight loading."""
import pytest
import torch
from safetensors.torch import save_file

import torch.nn.functional as F

from gradzip_converge.conv_depth import ConvDepthModel
from gradzip_converge.models import (CONFIGS, ViTEncoder, build_model, count_parameters, get_config,
                                     resize_separable)
from gradzip_converge.tasks import task_of
from gradzip_converge.weights import WeightLoadError, load_encoder_weights
from gradzip_converge.zoo import build


def test_vitl14_encoder_is_dinov2_sized():
    n = count_parameters("vit-l14")  # built on the meta device: nothing is allocated
    assert abs(n - 304e6) / 304e6 < 0.01, n
    cfg = CONFIGS["vit-l14"]
    assert (cfg.depth, cfg.width, cfg.heads, cfg.mlp) == (24, 1024, 16, 4096)
    # ViT-B/14 and ViT-S/14 as released with DINOv2: 86.6M and 22.1M (with 37x37 positions)
    assert abs(count_parameters("vit-b14") - 86.6e6) / 86.6e6 < 0.01
    assert abs(count_parameters("vit-s14") - 22.1e6) / 22.1e6 < 0.01
    assert count_parameters("vit-t14", "all") < 2e6


def test_forward_gives_positive_depth_at_input_resolution():
    torch.manual_seed(0)
    model = build_model("vit-t14")
    x = torch.rand(2, 3, 42, 56)  # a grid other than the stored 6x6: positions are resized
    y = model(x)
    assert y.shape == (2, 1, 42, 56)
    assert (y > 0).all() and torch.isfinite(y).all()
    y.log().mean().backward()
    assert all(p.grad is not None for p in model.parameters())
    with pytest.raises(ValueError, match="multiple of 14"):
        model(torch.rand(1, 3, 40, 42))
    with pytest.raises(ValueError, match="unknown ViT config 'vit-h14'; known: .*vit-t14"):
        get_config("vit-h14")


def test_conv_model_gives_positive_depth_at_any_resolution():
    torch.manual_seed(0)
    model = build("conv-s")
    y = model(torch.rand(2, 3, 37, 50))  # odd sizes: the decoder resizes to each skip's size
    assert y.shape == (2, 1, 37, 50)
    assert (y > 0).all() and torch.isfinite(y).all()
    y.log().mean().backward()
    assert all(p.grad is not None for p in model.parameters())
    with pytest.raises(ValueError, match="known: .*conv-s"):
        task_of("conv-xl")
    with pytest.raises(ValueError, match="conv-s"):
        ConvDepthModel("conv-xl")


@pytest.mark.parametrize("mode, align_corners, size, out", [
    ("bilinear", True, (6, 5), (12, 10)),  # the head's 2x upsampling
    ("bilinear", True, (6, 6), (84, 84)),  # to the input size
    ("bicubic", False, (37, 37), (19, 19)),  # vit-l14's position embeddings at 266 px
])
def test_separable_resize_equals_interpolate(mode, align_corners, size, out):
    # what the model uses on CUDA under deterministic algorithms, checked here on the CPU
    torch.manual_seed(0)
    x = torch.randn(2, 3, *size, dtype=torch.float64, requires_grad=True)
    ref = F.interpolate(x, size=out, mode=mode, align_corners=align_corners)
    got = resize_separable(x, out, mode, align_corners)
    assert got.dtype == x.dtype and torch.allclose(got, ref, rtol=0, atol=1e-12)
    g = torch.randn_like(ref)
    (g_ref,), (g_got,) = torch.autograd.grad(ref, x, g), torch.autograd.grad(got, x, g)
    assert torch.allclose(g_got, g_ref, rtol=0, atol=1e-12)


def _dinov2_style_state(cfg_name: str, prefix: str = "") -> dict:
    torch.manual_seed(1)
    sd = ViTEncoder(get_config(cfg_name)).state_dict()
    sd = {prefix + k: v.clone() for k, v in sd.items()}
    sd[prefix + "mask_token"] = torch.zeros(1, sd[prefix + "cls_token"].shape[-1])  # as DINOv2's
    return sd


@pytest.mark.parametrize("fmt", ["pth", "safetensors"])
def test_loads_encoder_weights_from_a_local_file(tmp_path, fmt):
    sd = _dinov2_style_state("vit-t14", prefix="backbone.")
    path = tmp_path / f"enc.{fmt}"
    if fmt == "pth":
        torch.save({"model": sd}, path)
    else:
        save_file(sd, str(path))
    torch.manual_seed(2)
    enc = ViTEncoder(get_config("vit-t14"))
    load_encoder_weights(enc, path)
    for k, v in enc.state_dict().items():
        assert torch.equal(v, sd["backbone." + k]), k


def test_position_embeddings_of_another_grid_are_resized(tmp_path):
    sd = _dinov2_style_state("vit-t14")
    torch.save(sd, tmp_path / "a.pth")
    enc = ViTEncoder(get_config("vit-t14", img_size=112))  # 8x8 grid, the file holds 6x6
    load_encoder_weights(enc, tmp_path / "a.pth")
    assert enc.pos_embed.shape == (1, 65, 96)
    assert torch.equal(enc.pos_embed[0, 0], sd["pos_embed"][0, 0])  # CLS position kept


def test_mismatched_weights_are_clear_errors(tmp_path):
    sd = _dinov2_style_state("vit-t14")
    del sd["blocks.0.attn.qkv.weight"]
    sd["blocks.9.mlp.fc1.weight"] = torch.zeros(1)
    sd["norm.weight"] = torch.zeros(7)
    torch.save(sd, tmp_path / "bad.pth")
    enc = ViTEncoder(get_config("vit-t14"))
    with pytest.raises(WeightLoadError) as e:
        load_encoder_weights(enc, tmp_path / "bad.pth")
    msg = str(e.value)
    assert "missing 1: blocks.0.attn.qkv.weight" in msg
    assert "unexpected 1: blocks.9.mlp.fc1.weight" in msg
    assert "norm.weight: file (7,) vs model (96,)" in msg
    with pytest.raises(WeightLoadError, match="no such file"):
        load_encoder_weights(enc, tmp_path / "missing.pth")
    (tmp_path / "w.bin.txt").write_text("x")
    with pytest.raises(WeightLoadError, match="expected a .pth"):
        load_encoder_weights(enc, tmp_path / "w.bin.txt")
    torch.save([1, 2], tmp_path / "list.pth")
    with pytest.raises(WeightLoadError, match="state dict"):
        load_encoder_weights(enc, tmp_path / "list.pth")
