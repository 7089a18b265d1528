"""Procedural RGB-D scenes with exact metric depth, deterministic by (seed, index).

A room (floor, back wall, side walls, sometimes a ceiling) holding boxes (rotated about the
vertical) and spheres that rest on the floor, with checker, stripe, smooth-noise or plain
textures, lit by a directional and a point light over ambient. Rendering is vectorised ray
casting in numpy: the camera sits at the origin looking down +z (x right, y down), and every
pixel's ray is ``(x, y, 1)`` in normalised image coordinates, so the ray parameter ``t`` of the
first hit *is* the z-depth, the convention of NYU and KITTI.

Optionally a "raw" depth channel, as a depth-completion model takes it: the true depth with
holes (blobs, dropouts and grazing-angle losses, as a structured-light sensor gives) or sparse
(a random subset of pixels, as a projected LiDAR gives); 0 marks a missing value.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_EPS = 1e-6


@dataclass(frozen=True)
class SceneConfig:
    height: int = 84
    width: int = 84
    fov_deg: float = 60.0  # horizontal field of view
    max_depth: float = 10.0  # rays that leave the room are clipped here
    boxes: tuple[int, int] = (1, 4)  # inclusive range of counts
    spheres: tuple[int, int] = (0, 3)
    raw: str | None = None  # None, "holes" or "sparse"
    sparse_fraction: float = 0.05


def _rays(cfg: SceneConfig) -> np.ndarray:
    f = 0.5 * cfg.width / np.tan(np.radians(cfg.fov_deg) / 2)
    u = (np.arange(cfg.width) + 0.5 - cfg.width / 2) / f
    v = (np.arange(cfg.height) + 0.5 - cfg.height / 2) / f
    x, y = np.meshgrid(u, v)
    return np.stack([x, y, np.ones_like(x)], axis=-1)  # (H, W, 3), z = 1


def _rot_y(angle: float) -> np.ndarray:
    c, s = np.cos(angle), np.sin(angle)
    return np.array([[c, 0.0, s], [0.0, 1.0, 0.0], [-s, 0.0, c]])


class _Texture:
    """Albedo as a function of 2-D surface coordinates (metres)."""

    def __init__(self, rng: np.random.Generator):
        self.kind = rng.choice(["checker", "stripes", "noise", "plain"], p=[0.3, 0.25, 0.3, 0.15])
        self.c0 = rng.uniform(0.15, 0.95, 3)
        self.c1 = np.clip(self.c0 * rng.uniform(0.3, 0.8) + rng.uniform(-0.1, 0.1, 3), 0, 1)
        self.scale = rng.uniform(2.0, 6.0)  # cycles per metre
        self.angle = rng.uniform(0, np.pi)
        self.freqs = rng.uniform(1.0, 8.0, (4, 2)) * rng.choice([-1, 1], (4, 2))
        self.phases = rng.uniform(0, 2 * np.pi, 4)

    def __call__(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        if self.kind == "checker":
            m = (np.floor(a * self.scale) + np.floor(b * self.scale)) % 2
        elif self.kind == "stripes":
            m = (np.floor((a * np.cos(self.angle) + b * np.sin(self.angle)) * self.scale)) % 2
        elif self.kind == "noise":
            m = sum(np.sin(f[0] * a + f[1] * b + p) for f, p in zip(self.freqs, self.phases))
            m = 0.5 + m / 8.0
        else:
            m = np.zeros_like(a)
        m = m[..., None]
        return self.c0 * (1 - m) + self.c1 * m


def _plane_hits(d, normal, offset):
    """Planes n.p = offset; returns t (inf where missed)."""
    denom = d @ normal
    with np.errstate(divide="ignore", invalid="ignore"):
        t = offset / denom
    return np.where((np.abs(denom) > _EPS) & (t > _EPS), t, np.inf)


def _box_hits(d, center, half, rot):
    o_l = rot.T @ (-center)
    d_l = d @ rot  # rows: R^T d
    with np.errstate(divide="ignore", invalid="ignore"):
        t1 = (-half - o_l) / d_l
        t2 = (half - o_l) / d_l
    tlo, thi = np.minimum(t1, t2), np.maximum(t1, t2)
    tlo = np.nan_to_num(tlo, nan=-np.inf)
    thi = np.nan_to_num(thi, nan=np.inf)
    tmin, tmax = tlo.max(-1), thi.min(-1)
    hit = (tmax >= tmin) & (tmin > _EPS)
    axis = tlo.argmax(-1)
    n_l = np.zeros_like(d)
    np.put_along_axis(n_l, axis[..., None], 1.0, axis=-1)
    n_l *= -np.sign(np.take_along_axis(d_l, axis[..., None], axis=-1))
    p_l = o_l + tmin[..., None] * d_l
    return np.where(hit, tmin, np.inf), n_l @ rot.T, p_l


def _sphere_hits(d, center, radius):
    a = (d * d).sum(-1)
    b = -2.0 * (d @ center)
    c = center @ center - radius * radius
    disc = b * b - 4 * a * c
    with np.errstate(invalid="ignore"):
        t = (-b - np.sqrt(disc)) / (2 * a)
    return np.where((disc >= 0) & (t > _EPS), t, np.inf)


def render_scene(seed: int, index: int, cfg: SceneConfig = SceneConfig()) -> dict[str, np.ndarray]:
    """One scene: ``rgb`` (H, W, 3) float32 in [0, 1], ``depth`` (H, W) float32 metres, and
    ``raw`` (H, W) with 0 = missing when ``cfg.raw`` is set. Same (seed, index, cfg), same arrays."""
    rng = np.random.default_rng([seed, index])
    d = _rays(cfg)
    shape = d.shape[:2]
    depth = np.full(shape, np.inf)
    normal = np.zeros(d.shape)
    albedo = np.zeros(d.shape)

    def take(t, n, col):
        nonlocal depth
        closer = t < depth
        depth = np.where(closer, t, depth)
        normal[closer] = n[closer] if n.ndim == 3 else n
        albedo[closer] = col[closer]

    cam_h = rng.uniform(1.0, 1.7)  # camera height above the floor (floor at y = +cam_h)
    room_d = rng.uniform(3.5, cfg.max_depth - 0.5)
    room_w = rng.uniform(3.0, 8.0)
    room_x = rng.uniform(-1.0, 1.0)
    yaw = rng.uniform(-0.35, 0.35)  # the room is turned relative to the camera
    rot = _rot_y(yaw)
    planes = [  # (normal in room frame, offset in room frame, coordinates used for the texture)
        (np.array([0.0, -1.0, 0.0]), -cam_h, (0, 2)),  # floor
        (np.array([0.0, 0.0, -1.0]), -room_d, (0, 1)),  # back wall
        (np.array([1.0, 0.0, 0.0]), room_x - room_w / 2, (2, 1)),  # left wall
        (np.array([-1.0, 0.0, 0.0]), -(room_x + room_w / 2), (2, 1)),  # right wall
    ]
    if rng.random() < 0.5:
        planes.append((np.array([0.0, 1.0, 0.0]), -(rng.uniform(2.4, 3.0) - cam_h), (0, 2)))
    for n, off, (ia, ib) in planes:
        n_cam = rot @ n
        t = _plane_hits(d, n_cam, off)
        p = (np.where(np.isfinite(t), t, 0.0)[..., None] * d) @ rot  # room-frame hit point
        take(t, np.broadcast_to(n_cam, d.shape), _Texture(rng)(p[..., ia], p[..., ib]))

    def floor_point(depth_lo, depth_hi):
        z = rng.uniform(depth_lo, min(depth_hi, room_d - 0.5))
        x = rng.uniform(room_x - room_w / 2 + 0.3, room_x + room_w / 2 - 0.3)
        return z, x

    for _ in range(rng.integers(cfg.boxes[0], cfg.boxes[1] + 1)):
        half = rng.uniform([0.15, 0.1, 0.15], [0.8, 0.9, 0.8])
        z, x = floor_point(1.2, room_d)
        center = rot @ np.array([x, cam_h - half[1], z])
        brot = rot @ _rot_y(rng.uniform(0, np.pi / 2))
        t, n, p_l = _box_hits(d, center, half, brot)
        tex = _Texture(rng)
        take(t, n, tex(p_l[..., 0] + p_l[..., 2], p_l[..., 1]))
    for _ in range(rng.integers(cfg.spheres[0], cfg.spheres[1] + 1)):
        r = rng.uniform(0.15, 0.6)
        z, x = floor_point(1.0, room_d)
        center = rot @ np.array([x, cam_h - r, z])
        t = _sphere_hits(d, center, r)
        p = np.where(np.isfinite(t), t, 0.0)[..., None] * d - center
        n = p / max(r, _EPS)
        tex = _Texture(rng)
        take(t, n, tex(np.arctan2(n[..., 0], n[..., 2]) * r, np.arcsin(np.clip(n[..., 1], -1, 1)) * r))

    depth = np.minimum(depth, cfg.max_depth)
    hit = depth[..., None] * d
    # Lighting: ambient + directional (a window) + a point light with inverse-square falloff.
    sun = rng.normal(size=3)
    sun[1] = -abs(sun[1]) - 0.5  # from above
    sun /= np.linalg.norm(sun)
    lamp = np.array([rng.uniform(-1, 1), -rng.uniform(0.5, 1.5), rng.uniform(0.5, 3)])
    to_lamp = lamp - hit
    dist2 = (to_lamp * to_lamp).sum(-1, keepdims=True)
    lamb_sun = np.clip(-(normal @ sun), 0, None)[..., None]
    lamb_lamp = np.clip((normal * to_lamp).sum(-1, keepdims=True) / np.sqrt(dist2 + _EPS), 0, None)
    light = rng.uniform(0.15, 0.35) + rng.uniform(0.3, 0.7) * lamb_sun
    light = light + rng.uniform(1.0, 3.0) * lamb_lamp / (1.0 + dist2)
    tint = rng.uniform(0.85, 1.0, 3)
    rgb = np.clip(albedo * light * tint, 0, 1) ** (1 / 2.2)
    out = {"rgb": rgb.astype(np.float32), "depth": depth.astype(np.float32)}
    if cfg.raw is not None:
        out["raw"] = _raw_depth(rng, depth, normal, d, cfg).astype(np.float32)
    return out


def _raw_depth(rng, depth, normal, d, cfg: SceneConfig) -> np.ndarray:
    if cfg.raw == "sparse":
        return np.where(rng.random(depth.shape) < cfg.sparse_fraction, depth, 0.0)
    if cfg.raw != "holes":
        raise ValueError(f"raw must be None, 'holes' or 'sparse', got {cfg.raw!r}")
    view = d / np.linalg.norm(d, axis=-1, keepdims=True)
    grazing = np.abs((normal * view).sum(-1)) < 0.15
    far = depth >= cfg.max_depth * 0.98  # sensors lose the far range
    holes = rng.random(depth.shape) < 0.02
    yy, xx = np.mgrid[: depth.shape[0], : depth.shape[1]]
    for _ in range(rng.integers(1, 5)):
        cy, cx = rng.uniform(0, depth.shape[0]), rng.uniform(0, depth.shape[1])
        ry, rx = rng.uniform(2, depth.shape[0] / 6), rng.uniform(2, depth.shape[1] / 6)
        holes |= ((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2 < 1
    return np.where(grazing | far | holes, 0.0, depth)
