"""RGB-D datasets: procedural scenes and loaders for NYU Depth v2, KITTI depth and plain folders.

Every dataset yields the same sample: ``{"rgb": (3, H, W) float32 in [0, 1], "depth": (1, H, W)
float32 metres}`` plus ``"raw": (1, H, W)`` where a raw/sparse depth input exists. A depth of 0
means "no measurement" everywhere (the KITTI convention); the metrics and the loss mask it out.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from .scenes import SceneConfig, render_scene

IMAGE_EXTS = (".png", ".jpg", ".jpeg")


def _sample(rgb: np.ndarray, depth: np.ndarray, raw: np.ndarray | None = None) -> dict:
    """(H, W, 3) uint8 or float RGB and (H, W) depth in metres -> the common sample dict."""
    rgb = np.asarray(rgb)
    if rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"RGB image must be (H, W, 3), got {rgb.shape}")
    if depth.shape != rgb.shape[:2]:
        raise ValueError(f"depth {depth.shape} does not match the RGB image {rgb.shape[:2]}")
    rgb_t = torch.from_numpy(np.ascontiguousarray(rgb)).permute(2, 0, 1)
    rgb_t = rgb_t.float() / 255.0 if rgb.dtype == np.uint8 else rgb_t.float()
    out = {"rgb": rgb_t, "depth": torch.from_numpy(np.ascontiguousarray(depth, np.float32))[None]}
    if raw is not None:
        out["raw"] = torch.from_numpy(np.ascontiguousarray(raw, np.float32))[None]
    return out


def resize_sample(sample: dict, size: tuple[int, int]) -> dict:
    """RGB bilinear (antialiased); depth nearest, so missing (0) pixels are never blended in."""
    out = {"rgb": F.interpolate(sample["rgb"][None], size=size, mode="bilinear",
                                antialias=True, align_corners=False)[0]}
    for k in ("depth", "raw"):
        if k in sample:
            out[k] = F.interpolate(sample[k][None], size=size, mode="nearest")[0]
    return out


# ------------------------------------------------------------------------------ depth image files


def read_depth_png(path: str | Path, scale: float) -> np.ndarray:
    """16-bit PNG -> float32 metres (value / scale; 0 stays 0 = missing)."""
    from PIL import Image

    with Image.open(path) as im:
        a = np.array(im)
    if a.dtype != np.uint16 and not (a.dtype == np.int32 and a.min() >= 0 and a.max() < 65536):
        raise ValueError(f"{path}: expected a 16-bit depth PNG, got mode {im.mode} ({a.dtype})")
    if a.ndim != 2:
        raise ValueError(f"{path}: depth PNG must have one channel, got shape {a.shape}")
    return a.astype(np.float32) / scale


def write_depth_png(path: str | Path, depth: np.ndarray, scale: float) -> None:
    """float metres -> 16-bit PNG of round(depth * scale); out-of-range values raise."""
    from PIL import Image

    q = np.round(np.nan_to_num(np.asarray(depth, np.float64), nan=0.0) * scale)
    if q.min() < 0 or q.max() > 65535:
        raise ValueError(f"depth * {scale} leaves the 16-bit range [0, 65535]")
    Image.fromarray(q.astype(np.uint16)).save(path)


def read_rgb(path: str | Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as im:
        return np.array(im.convert("RGB"))


def read_depth(path: Path, png_scale: float) -> np.ndarray:
    if path.suffix == ".npy":
        a = np.load(path)
        if a.ndim != 2:
            raise ValueError(f"{path}: depth array must be (H, W), got {a.shape}")
        return np.nan_to_num(a.astype(np.float32), nan=0.0, posinf=0.0, neginf=0.0)
    return read_depth_png(path, png_scale)


# --------------------------------------------------------------------------------------- datasets


class ProceduralDepth(Dataset):
    """Scenes ``index`` = 0..n-1 of ``render_scene(seed, index)``; same seed, same data."""

    def __init__(self, n: int, seed: int, cfg: SceneConfig = SceneConfig()):
        self.n, self.seed, self.cfg = n, seed, cfg

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.n:
            raise IndexError(i)
        s = render_scene(self.seed, i, self.cfg)
        return _sample(s["rgb"], s["depth"], s.get("raw"))


class NYUDepthV2Labeled(Dataset):
    """``nyu_depth_v2_labeled.mat`` (MATLAB v7.3 = HDF5): 1449 RGB-D frames, 640x480.

    h5py sees MATLAB's column-major arrays transposed: ``images`` is (N, 3, W, H) uint8,
    ``depths`` and ``rawDepths`` are (N, W, H) float metres. The file is opened lazily (per
    DataLoader worker) and read one frame at a time.
    """

    def __init__(self, path: str | Path, indices=None, raw: bool = False):
        import h5py

        self.path, self.raw = Path(path), raw
        try:
            with h5py.File(self.path, "r") as f:
                keys = ("images", "depths") + (("rawDepths",) if raw else ())
                for k in keys:
                    if k not in f:
                        raise ValueError(f"{self.path}: no '{k}' dataset (keys: {sorted(f)})")
                n, c = f["images"].shape[:2]
                if c != 3 or f["depths"].shape != (n,) + f["images"].shape[2:]:
                    raise ValueError(f"{self.path}: images {f['images'].shape} and depths "
                                     f"{f['depths'].shape} are not (N, 3, W, H) and (N, W, H)")
        except OSError as e:
            raise ValueError(f"{self.path}: not an HDF5 (MATLAB v7.3) file: {e}") from None
        self.indices = list(range(n)) if indices is None else list(indices)
        self._file = None

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict:
        import h5py

        if self._file is None:
            self._file = h5py.File(self.path, "r")
        j = self.indices[i]
        rgb = self._file["images"][j].transpose(2, 1, 0)  # (3, W, H) -> (H, W, 3)
        depth = self._file["depths"][j].T
        raw = self._file["rawDepths"][j].T if self.raw else None
        return _sample(rgb, depth, raw)

    def __getstate__(self):  # h5py handles do not pickle; reopen in each worker
        return {**self.__dict__, "_file": None}


class KittiDepth(Dataset):
    """KITTI depth (prediction/completion benchmark): 16-bit PNG, metres x 256, 0 = missing.

    ``depth_root`` is the ``data_depth_annotated`` tree (``<split>/<drive>/proj_depth/groundtruth/
    image_0X/<frame>.png``) or any folder above such drives; the RGB frame is looked up in the raw
    data tree as ``raw_root/<date>/<drive>/image_0X/data/<frame>.png`` (date = the drive name's
    first 10 characters). ``raw=True`` adds the projected LiDAR (``proj_depth/velodyne_raw``)."""

    SCALE = 256.0

    def __init__(self, depth_root: str | Path, raw_root: str | Path, raw: bool = False):
        self.depth_root, self.raw_root, self.raw = Path(depth_root), Path(raw_root), raw
        self.files = sorted(self.depth_root.glob("**/proj_depth/groundtruth/image_0[23]/*.png"))
        if not self.files:
            raise ValueError(f"{self.depth_root}: no proj_depth/groundtruth/image_0X/*.png found")

    def __len__(self) -> int:
        return len(self.files)

    def rgb_path(self, depth_path: Path) -> Path:
        cam, drive = depth_path.parent.name, depth_path.parents[3].name
        return self.raw_root / drive[:10] / drive / cam / "data" / depth_path.name

    def __getitem__(self, i: int) -> dict:
        p = self.files[i]
        rgb_path = self.rgb_path(p)
        if not rgb_path.is_file():
            raise FileNotFoundError(f"RGB frame for {p} not found at {rgb_path}")
        raw = None
        if self.raw:
            raw = read_depth_png(p.parents[2] / "velodyne_raw" / p.parent.name / p.name, self.SCALE)
        return _sample(read_rgb(rgb_path), read_depth_png(p, self.SCALE), raw)


class DepthFolder(Dataset):
    """``root/rgb/<name>.{png,jpg}`` with ``root/depth/<name>.{png,npy}`` (optional
    ``root/raw/<name>.{png,npy}``). PNG depth is 16-bit, divided by ``png_scale`` (default 1000:
    millimetres); ``.npy`` depth is float metres. Non-finite or 0 = missing."""

    def __init__(self, root: str | Path, png_scale: float = 1000.0, raw: bool = False):
        self.root, self.png_scale, self.raw = Path(root), png_scale, raw
        rgbs = sorted(p for p in (self.root / "rgb").glob("*") if p.suffix.lower() in IMAGE_EXTS)
        if not rgbs:
            raise ValueError(f"{self.root}/rgb: no .png/.jpg images")
        self.items = []
        for p in rgbs:
            dep = self._find(self.root / "depth", p.stem)
            if dep is None:
                raise ValueError(f"{p}: no depth file {self.root}/depth/{p.stem}.png or .npy")
            raw_p = self._find(self.root / "raw", p.stem) if raw else None
            if raw and raw_p is None:
                raise ValueError(f"{p}: no raw depth {self.root}/raw/{p.stem}.png or .npy")
            self.items.append((p, dep, raw_p))

    @staticmethod
    def _find(folder: Path, stem: str) -> Path | None:
        for ext in (".png", ".npy"):
            if (folder / (stem + ext)).is_file():
                return folder / (stem + ext)
        return None

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        rgb, dep, raw = self.items[i]
        raw_a = read_depth(raw, self.png_scale) if raw is not None else None
        return _sample(read_rgb(rgb), read_depth(dep, self.png_scale), raw_a)


def materialize(ds: Dataset, size: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """Stack a (small) dataset into tensors, resized to ``size``: training then indexes memory."""
    samples = [ds[i] for i in range(len(ds))]
    if size is not None:
        samples = [resize_sample(s, size) for s in samples]
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


def open_dataset(spec: str) -> Dataset:
    """``nyu:FILE.mat`` | ``kitti:DEPTH_ROOT,RAW_ROOT`` | ``folder:DIR`` -> a Dataset."""
    kind, _, arg = spec.partition(":")
    if kind == "nyu" and arg:
        return NYUDepthV2Labeled(arg)
    if kind == "kitti" and "," in arg:
        depth_root, raw_root = arg.split(",", 1)
        return KittiDepth(depth_root, raw_root)
    if kind == "folder" and arg:
        return DepthFolder(arg)
    raise ValueError(f"bad dataset spec {spec!r}: use nyu:FILE.mat, kitti:DEPTH_ROOT,RAW_ROOT "
                     "or folder:DIR")
