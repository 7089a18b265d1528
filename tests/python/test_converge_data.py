"""Procedural scenes (determinism, exact geometry) and the dataset loaders on files written here."""
import math

import h5py
import numpy as np
import pytest
import torch
from PIL import Image

from gradzip_converge import scenes
from gradzip_converge.datasets import (DepthFolder, KittiDepth, NYUDepthV2Labeled,
                                       ProceduralDepth, materialize, open_dataset,
                                       read_depth_png, resize_sample, write_depth_png)
from gradzip_converge.training import RunConfig, load_data

SMALL = scenes.SceneConfig(height=30, width=40, raw="holes")


def test_generator_is_deterministic_by_seed_and_index():
    a, b = scenes.render_scene(7, 3, SMALL), scenes.render_scene(7, 3, SMALL)
    for k in ("rgb", "depth", "raw"):
        assert np.array_equal(a[k], b[k]), k
    assert not np.array_equal(a["depth"], scenes.render_scene(7, 4, SMALL)["depth"])
    assert not np.array_equal(a["depth"], scenes.render_scene(8, 3, SMALL)["depth"])


def test_scene_values_are_sane():
    for i in range(5):
        s = scenes.render_scene(0, i, SMALL)
        assert s["rgb"].shape == (30, 40, 3) and s["depth"].shape == (30, 40)
        assert s["rgb"].min() >= 0 and s["rgb"].max() <= 1 and s["rgb"].std() > 0.01
        assert np.isfinite(s["depth"]).all()
        assert s["depth"].min() > 0.1 and s["depth"].max() <= SMALL.max_depth
        raw = s["raw"]
        assert 0 < (raw == 0).mean() < 0.9  # holes, but mostly measured
        assert np.array_equal(raw[raw > 0], s["depth"][raw > 0])  # measured values are exact
    sparse = scenes.render_scene(0, 0, scenes.SceneConfig(height=30, width=40, raw="sparse"))
    assert 0 < (sparse["raw"] > 0).mean() < 0.2


def test_ray_casting_is_exact():
    d = np.array([[0.0, 0.0, 1.0], [0.3, -0.2, 1.0]])  # rays with z = 1: t is the z-depth
    t = scenes._sphere_hits(d, np.array([0.0, 0.0, 5.0]), 1.0)
    assert t[0] == pytest.approx(4.0)
    t = scenes._plane_hits(d, np.array([0.0, 0.0, -1.0]), -6.0)  # wall z = 6
    assert t.tolist() == pytest.approx([6.0, 6.0])
    # a cube of half-size 1 at z = 5 turned 45 degrees: its nearest edge is at z = 5 - sqrt(2)
    rot = scenes._rot_y(math.pi / 4)
    t, n, _ = scenes._box_hits(d[:1], np.array([0.0, 0.0, 5.0]), np.array([1.0, 1.0, 1.0]), rot)
    assert t[0] == pytest.approx(5 - math.sqrt(2))
    # missing rays give inf
    assert np.isinf(scenes._sphere_hits(d[1:], np.array([0.0, 0.0, 5.0]), 0.1)).all()


def test_procedural_dataset_and_resize():
    ds = ProceduralDepth(3, seed=1, cfg=scenes.SceneConfig(height=28, width=28))
    s = ds[2]
    assert s["rgb"].shape == (3, 28, 28) and s["depth"].shape == (1, 28, 28)
    assert torch.equal(s["depth"][0], torch.from_numpy(scenes.render_scene(1, 2, ds.cfg)["depth"]))
    with pytest.raises(IndexError):
        ds[3]
    stack = materialize(ds, (14, 14))
    assert stack["rgb"].shape == (3, 3, 14, 14)
    holed = {"rgb": torch.rand(3, 4, 4), "depth": torch.tensor([[[0.0, 1, 2, 3]] * 4])}
    r = resize_sample(holed, (2, 2))  # nearest: missing stays missing, values are never blended
    assert set(r["depth"].unique().tolist()) <= {0.0, 1.0, 2.0, 3.0}


def test_procedural_scenes_are_cached_by_what_they_depend_on(tmp_path):
    cfg = RunConfig(image_size=28, train_scenes=5, test_scenes=2, seed=3)
    rendered = load_data(cfg)
    for _ in range(2):  # renders and stores, then reads
        cached = load_data(cfg, tmp_path)
        for part, ref in zip(cached, rendered):
            assert all(torch.equal(part[k], ref[k]) for k in ref)
    assert len(list(tmp_path.glob("procedural-*.pt"))) == 1
    other = load_data(RunConfig(image_size=28, train_scenes=5, test_scenes=2, seed=4), tmp_path)
    assert len(list(tmp_path.glob("procedural-*.pt"))) == 2
    assert not torch.equal(other[0]["rgb"], rendered[0]["rgb"])


def test_depth_png_round_trip(tmp_path):
    depth = np.array([[0.0, 1.0, 2.5], [10.0, 0.004, 65.535]], np.float32)
    write_depth_png(tmp_path / "d.png", depth, 1000.0)
    back = read_depth_png(tmp_path / "d.png", 1000.0)
    assert np.abs(back - depth).max() <= 0.5 / 1000 + 1e-6
    assert back[0, 0] == 0
    with pytest.raises(ValueError, match="16-bit range"):
        write_depth_png(tmp_path / "e.png", depth * 2, 1000.0)
    Image.fromarray(np.zeros((2, 2, 3), np.uint8)).save(tmp_path / "rgb.png")
    with pytest.raises(ValueError, match="16-bit"):
        read_depth_png(tmp_path / "rgb.png", 1000.0)


def test_nyu_labeled_mat(tmp_path):
    n, h, w = 3, 6, 8
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (n, h, w, 3), dtype=np.uint8)
    depth = rng.uniform(0.5, 9.0, (n, h, w)).astype(np.float32)
    raw = np.where(rng.random((n, h, w)) < 0.3, 0, depth).astype(np.float32)
    path = tmp_path / "nyu_depth_v2_labeled.mat"
    with h5py.File(path, "w") as f:  # MATLAB v7.3 column-major layout, as h5py reads it
        f["images"] = rgb.transpose(0, 3, 2, 1)  # (N, 3, W, H)
        f["depths"] = depth.transpose(0, 2, 1)  # (N, W, H)
        f["rawDepths"] = raw.transpose(0, 2, 1)
    ds = NYUDepthV2Labeled(path, raw=True)
    assert len(ds) == n
    for i in range(n):
        s = ds[i]
        assert torch.equal(s["rgb"], torch.from_numpy(rgb[i]).permute(2, 0, 1).float() / 255)
        assert torch.equal(s["depth"][0], torch.from_numpy(depth[i]))
        assert torch.equal(s["raw"][0], torch.from_numpy(raw[i]))
    assert len(NYUDepthV2Labeled(path, indices=[2])) == 1
    assert len(open_dataset(f"nyu:{path}")) == n
    with h5py.File(tmp_path / "bad.mat", "w") as f:
        f["images"] = rgb.transpose(0, 3, 2, 1)
    with pytest.raises(ValueError, match="'depths'"):
        NYUDepthV2Labeled(tmp_path / "bad.mat")
    (tmp_path / "old.mat").write_bytes(b"MATLAB 5.0 MAT-file" + bytes(200))
    with pytest.raises(ValueError, match="HDF5"):
        NYUDepthV2Labeled(tmp_path / "old.mat")


def test_kitti_depth(tmp_path):
    drive = "2011_09_26_drive_0001_sync"
    gt_dir = tmp_path / "annotated" / "train" / drive / "proj_depth" / "groundtruth" / "image_02"
    lidar_dir = gt_dir.parents[1] / "velodyne_raw" / "image_02"
    rgb_dir = tmp_path / "raw" / "2011_09_26" / drive / "image_02" / "data"
    for d in (gt_dir, lidar_dir, rgb_dir):
        d.mkdir(parents=True)
    rng = np.random.default_rng(1)
    depth = np.where(rng.random((5, 7)) < 0.5, 0, rng.uniform(1, 80, (5, 7)))
    q = np.round(depth * 256).astype(np.uint16)  # KITTI: metres x 256, 0 = missing
    Image.fromarray(q).save(gt_dir / "0000000005.png")
    Image.fromarray(q // 2 * 2).save(lidar_dir / "0000000005.png")
    rgb = rng.integers(0, 256, (5, 7, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(rgb_dir / "0000000005.png")
    ds = KittiDepth(tmp_path / "annotated", tmp_path / "raw", raw=True)
    assert len(ds) == 1
    s = ds[0]
    assert torch.equal(s["depth"][0], torch.from_numpy(q.astype(np.float32) / 256))
    assert (s["depth"][0] == 0).sum().item() == (depth == 0).sum()
    assert torch.equal(s["raw"][0], torch.from_numpy((q // 2 * 2).astype(np.float32) / 256))
    assert torch.equal(s["rgb"], torch.from_numpy(rgb).permute(2, 0, 1).float() / 255)
    (rgb_dir / "0000000005.png").unlink()
    with pytest.raises(FileNotFoundError, match="RGB frame"):
        ds[0]
    with pytest.raises(ValueError, match="groundtruth"):
        KittiDepth(tmp_path / "raw", tmp_path / "raw")


def test_plain_folder_png_and_npy(tmp_path):
    for d in ("rgb", "depth"):
        (tmp_path / d).mkdir()
    rng = np.random.default_rng(2)
    rgb = rng.integers(0, 256, (2, 4, 6, 3), dtype=np.uint8)
    d_png = rng.uniform(0.2, 9, (4, 6))
    d_npy = rng.uniform(0.2, 9, (4, 6)).astype(np.float32)
    Image.fromarray(rgb[0]).save(tmp_path / "rgb" / "a.png")
    Image.fromarray(rgb[1]).save(tmp_path / "rgb" / "b.png")
    write_depth_png(tmp_path / "depth" / "a.png", d_png, 1000.0)
    np.save(tmp_path / "depth" / "b.npy", d_npy)
    ds = DepthFolder(tmp_path)
    assert len(ds) == 2
    assert np.abs(ds[0]["depth"][0].numpy() - d_png).max() <= 0.0005 + 1e-6
    assert torch.equal(ds[1]["depth"][0], torch.from_numpy(d_npy))
    assert torch.equal(ds[1]["rgb"], torch.from_numpy(rgb[1]).permute(2, 0, 1).float() / 255)
    Image.fromarray(rgb[0]).save(tmp_path / "rgb" / "c.jpg")
    with pytest.raises(ValueError, match="no depth file"):
        DepthFolder(tmp_path)
    with pytest.raises(ValueError, match="bad dataset spec"):
        open_dataset("imagenet:/x")
