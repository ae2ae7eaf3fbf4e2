"""Synthetic KITTI-like ground truth and detections, for testing and benchmarking the evaluator.

Ground truth: objects placed in front of a KITTI-like camera (P2 focal 721 px, image 1242 × 375) with
KITTI's class mix and typical sizes; the 2D box is the projection of the 3D box clipped to the image,
truncation the share of the projected box outside the image, occlusion drawn at random; DontCare
regions as in KITTI (placeholder 3D box). Detections: a noisy copy of most GT of the evaluated classes
(sometimes with a duplicate, sometimes a Van reported as a Car), and false positives up to the requested
number per frame; scores higher for true detections. ``crowded=True`` packs objects close together so
that detections overlap several GT (a hard case for the matching).
"""

from __future__ import annotations

import numpy as np

from detector.data.kitti_labels import KittiLabels

FOCAL, CX, CY = 721.5, 609.6, 172.9
IMAGE_W, IMAGE_H = 1242, 375

# class: (mean objects per frame, (h, w, l) mean, (h, w, l) std)
_MIX = {
    "Car": (3.9, (1.53, 1.63, 3.88), (0.14, 0.10, 0.43)),
    "Van": (0.4, (2.21, 1.90, 5.08), (0.32, 0.14, 0.53)),
    "Truck": (0.15, (3.25, 2.59, 10.1), (0.45, 0.25, 2.8)),
    "Pedestrian": (0.6, (1.76, 0.66, 0.84), (0.11, 0.14, 0.23)),
    "Person_sitting": (0.03, (1.27, 0.54, 0.80), (0.11, 0.08, 0.20)),
    "Cyclist": (0.22, (1.74, 0.60, 1.76), (0.09, 0.12, 0.18)),
    "Tram": (0.07, (3.53, 2.54, 16.1), (0.17, 0.11, 7.0)),
    "Misc": (0.13, (1.91, 1.51, 3.58), (0.80, 0.60, 2.1)),
}
DETECTED = ("Car", "Pedestrian", "Cyclist")


def camera_corners(loc: np.ndarray, dims: np.ndarray, ry: np.ndarray) -> np.ndarray:
    """[N, 8, 3] corners of KITTI camera-frame boxes (bottom centre, (h, w, l), ry)."""
    h, w, l = dims[:, 0:1], dims[:, 1:2], dims[:, 2:3]
    x = np.concatenate([l, l, -l, -l, l, l, -l, -l], axis=1) / 2
    z = np.concatenate([w, -w, -w, w, w, -w, -w, w], axis=1) / 2
    y = np.concatenate([np.zeros_like(h)] * 4 + [-h] * 4, axis=1)
    c, s = np.cos(ry)[:, None], np.sin(ry)[:, None]
    return np.stack([c * x + s * z + loc[:, 0:1], y + loc[:, 1:2], -s * x + c * z + loc[:, 2:3]], axis=-1)


def project_boxes(loc: np.ndarray, dims: np.ndarray, ry: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(2D box [N, 4] clipped to the image, truncation [N]) of boxes lying in front of the camera."""
    pts = camera_corners(loc, dims, ry)
    z = np.maximum(pts[..., 2], 0.1)
    u = FOCAL * pts[..., 0] / z + CX
    v = FOCAL * pts[..., 1] / z + CY
    raw = np.stack([u.min(1), v.min(1), u.max(1), v.max(1)], axis=1)
    box = raw.copy()
    box[:, [0, 2]] = np.clip(box[:, [0, 2]], 0, IMAGE_W - 1)
    box[:, [1, 3]] = np.clip(box[:, [1, 3]], 0, IMAGE_H - 1)
    area = lambda b: np.maximum(b[:, 2] - b[:, 0], 0) * np.maximum(b[:, 3] - b[:, 1], 0)  # noqa: E731
    trunc = 1.0 - area(box) / np.maximum(area(raw), 1e-9)
    return box, np.clip(trunc, 0.0, 1.0)


def _labels(name, trunc, occ, alpha, bbox, dims, loc, ry, score=None) -> KittiLabels:
    # Round like the files (2 decimals; 4 for scores) so values survive a write/read round trip.
    r = lambda a: np.round(np.asarray(a, np.float64), 2)  # noqa: E731
    return KittiLabels(
        np.asarray(name, dtype="<U16"),
        r(trunc),
        np.asarray(occ, np.float64),
        r(alpha),
        r(bbox).reshape(-1, 4),
        r(dims).reshape(-1, 3),
        r(loc).reshape(-1, 3),
        r(ry),
        None if score is None else np.round(np.asarray(score, np.float64), 4),
    )


def _objects(rng: np.random.Generator, crowded: bool):
    names, dims = [], []
    for cls, (mean_n, mu, sd) in _MIX.items():
        k = rng.poisson(mean_n * (2.5 if crowded else 1.0))
        names += [cls] * k
        dims += [np.abs(rng.normal(mu, sd, size=(k, 3))) + 0.2]
    n = len(names)
    dims = np.concatenate(dims) if n else np.zeros((0, 3))
    if crowded:  # a few clusters, objects within ~2 m of each other
        centres = np.stack([rng.uniform(-6, 6, 3), rng.uniform(8, 30, 3)], axis=1)
        pick = centres[rng.integers(0, 3, n)]
        x, z = pick[:, 0] + rng.normal(0, 1.2, n), pick[:, 1] + rng.normal(0, 1.5, n)
    else:
        z = rng.uniform(4, 75, n)
        x = rng.uniform(-0.75, 0.75, n) * z
    y = rng.normal(1.65, 0.15, n)
    loc = np.stack([x, y, z], axis=1)
    ry = rng.uniform(-np.pi, np.pi, n)
    return np.asarray(names, dtype="<U16"), dims, loc, ry


def synthetic_frame(
    rng: np.random.Generator, dets_per_frame: int = 100, crowded: bool = False, recall: float = 0.85
) -> tuple[KittiLabels, KittiLabels]:
    """One frame: (ground truth with DontCare, detections with scores)."""
    names, dims, loc, ry = _objects(rng, crowded)
    bbox, trunc = project_boxes(loc, dims, ry)
    keep = (bbox[:, 2] - bbox[:, 0] > 1) & (bbox[:, 3] - bbox[:, 1] > 1)
    names, dims, loc, ry, bbox, trunc = names[keep], dims[keep], loc[keep], ry[keep], bbox[keep], trunc[keep]
    n = names.size
    occ = rng.choice(4, size=n, p=[0.5, 0.3, 0.15, 0.05])
    alpha = ry - np.arctan2(loc[:, 0], loc[:, 2])
    alpha = (alpha + np.pi) % (2 * np.pi) - np.pi
    # DontCare: image regions with KITTI's placeholder 3D box.
    k_dc = rng.poisson(3.0 if crowded else 1.5)
    x1, y1 = rng.uniform(0, IMAGE_W - 60, k_dc), rng.uniform(120, 220, k_dc)
    dc_box = np.stack([x1, y1, x1 + rng.uniform(10, 120, k_dc), y1 + rng.uniform(8, 60, k_dc)], axis=1)
    if crowded and n and k_dc:  # put some DontCare regions on top of objects
        on = rng.integers(0, n, k_dc)
        dc_box = np.where(rng.random((k_dc, 1)) < 0.5, bbox[on] + rng.normal(0, 3, (k_dc, 4)), dc_box)
    gt = _labels(
        list(names) + ["DontCare"] * k_dc,
        np.concatenate([trunc, -np.ones(k_dc)]),
        np.concatenate([occ, -np.ones(k_dc, int)]),
        np.concatenate([alpha, -10 * np.ones(k_dc)]),
        np.concatenate([bbox, dc_box]),
        np.concatenate([dims, -np.ones((k_dc, 3))]),
        np.concatenate([loc, -1000 * np.ones((k_dc, 3))]),
        np.concatenate([ry, -10 * np.ones(k_dc)]),
    )

    # Detections of GT: noisy copies (and sometimes a duplicate); Vans sometimes reported as Cars.
    src = np.flatnonzero(np.isin(names, DETECTED) | ((names == "Van") & (rng.random(n) < 0.3)))
    src = src[rng.random(src.size) < recall]
    dup = src[rng.random(src.size) < (0.4 if crowded else 0.1)]
    src = np.concatenate([src, dup])
    k = src.size
    dist = np.hypot(loc[src, 0], loc[src, 2])
    sigma = 0.05 + 0.006 * dist
    d_loc = loc[src] + rng.normal(0, 1, (k, 3)) * sigma[:, None] * np.array([1.0, 0.3, 1.0])
    d_dims = dims[src] * rng.normal(1.0, 0.05, (k, 3))
    d_ry = ry[src] + rng.normal(0, 0.08, k) + np.pi * (rng.random(k) < 0.05)
    d_names = np.where(names[src] == "Van", "Car", names[src])
    d_score = np.clip(rng.beta(5, 2, k), 0.0, 1.0)
    # False positives up to dets_per_frame.
    f = max(dets_per_frame - k, 0)
    fp_names = rng.choice(np.array(DETECTED), size=f, p=[0.6, 0.25, 0.15])
    fp_dims = np.array([_MIX[c][1] for c in fp_names]).reshape(-1, 3) * rng.normal(1.0, 0.1, (f, 3))
    if crowded and n:
        near = rng.integers(0, n, f)
        fp_loc = loc[near] + rng.normal(0, 1.0, (f, 3)) * np.array([1.0, 0.1, 1.0])
    else:
        fz = rng.uniform(4, 75, f)
        fp_loc = np.stack([rng.uniform(-0.75, 0.75, f) * fz, rng.normal(1.65, 0.15, f), fz], axis=1)
    fp_ry = rng.uniform(-np.pi, np.pi, f)
    fp_score = np.clip(rng.beta(2, 5, f), 0.0, 1.0)
    a_loc = np.concatenate([d_loc, fp_loc])
    a_dims = np.concatenate([d_dims, fp_dims])
    a_ry = np.concatenate([d_ry, fp_ry])
    a_box, _ = project_boxes(a_loc, a_dims, a_ry)
    a_alpha = (a_ry - np.arctan2(a_loc[:, 0], a_loc[:, 2]) + np.pi) % (2 * np.pi) - np.pi
    m = k + f
    order = rng.permutation(m)
    dt = _labels(
        np.concatenate([d_names, fp_names])[order],
        np.zeros(m),
        np.zeros(m, int),
        a_alpha[order],
        a_box[order],
        a_dims[order],
        a_loc[order],
        a_ry[order],
        np.concatenate([d_score, fp_score])[order],
    )
    return gt, dt


def synthetic_set(
    n_frames: int, dets_per_frame: int = 100, seed: int = 0, crowded: bool = False
) -> tuple[list[KittiLabels], list[KittiLabels]]:
    """``n_frames`` frames of (ground truth, detections); deterministic by ``seed``."""
    rng = np.random.default_rng(seed)
    gts, dts = [], []
    for _ in range(n_frames):
        g, d = synthetic_frame(rng, dets_per_frame, crowded)
        gts.append(g)
        dts.append(d)
    return gts, dts
