"""Exact box overlaps on the CPU (float64 NumPy, vectorized over all pairs).

Three kinds of boxes:

- **Image boxes** ``[N, 4]`` = (left, top, right, bottom) in pixels, continuous coordinates (area =
  width × height, no "+1"), as in the KITTI protocol.
- **BEV rectangles** ``[N, 5]`` = (cx, cy, l, w, yaw) in a plane: ``l`` along the heading
  (cos yaw, sin yaw), ``w`` across it. Corners ``c ± l/2·(cos, sin) ± w/2·(−sin, cos)``.
  LiDAR boxes give them directly (``Boxes3D.bev()``, the x–y plane). KITTI camera-frame boxes live in
  the x–z plane with heading (cos ry, −sin ry), i.e. (x, z, l, w, −ry): :func:`detector.eval.overlap.camera_bev`.
- **3D boxes** ``[N, 7]`` in the LiDAR frame = (x, y, z, l, w, h, yaw), (x, y, z) the box centre, z up
  (``Boxes3D.tensor``). KITTI camera-frame records: the metric's :func:`detector.eval.overlap.overlap_pairs`.

The intersection of two rotated rectangles is computed exactly by clipping one rectangle against the
four half-planes of the other (Sutherland–Hodgman; points on a boundary count as inside) and taking
the shoelace area of the clipped convex polygon. IoU = inter / (area_a + area_b − inter), with the
rectangle areas computed by the same shoelace formula, so two identical boxes give exactly 1. Touching
boxes give 0; a pair whose union is empty (degenerate zero-size boxes) gives 0. 3D IoU = BEV
intersection × vertical overlap / union volume.

Pairs whose bounding circles do not meet are skipped (their intersection is 0), which keeps the all-pairs
functions fast when most pairs are far apart.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

ArrayLike = np.ndarray


# --------------------------------------------------------------------------------------------------
# Input checks (public functions only; the paired kernels trust their callers)
# --------------------------------------------------------------------------------------------------
def _as_boxes(x, width: int, name: str, size_cols: tuple[int, ...] = ()) -> np.ndarray:
    try:
        import torch

        if isinstance(x, torch.Tensor):
            x = x.detach().cpu().numpy()
    except ImportError:  # pragma: no cover
        pass
    a = np.asarray(x, dtype=np.float64)
    if a.size == 0:
        a = a.reshape(0, width)
    if a.ndim != 2 or a.shape[1] != width:
        raise ValueError(f"{name}: expected an [N, {width}] array, got shape {a.shape}")
    if not np.isfinite(a).all():
        raise ValueError(
            f"{name}: contains NaN or infinite values (row {int(np.flatnonzero(~np.isfinite(a).all(1))[0])})"
        )
    if size_cols and (a[:, list(size_cols)] < 0).any():
        row = int(np.flatnonzero((a[:, list(size_cols)] < 0).any(1))[0])
        raise ValueError(f"{name}: negative box size in row {row}: {a[row].tolist()}")
    return a


# --------------------------------------------------------------------------------------------------
# Image boxes
# --------------------------------------------------------------------------------------------------
def box2d_overlap_paired(a: np.ndarray, b: np.ndarray, criterion: Literal["iou", "a"] = "iou") -> np.ndarray:
    """Overlap of box a[i] with box b[i] ([P, 4] each) → [P].

    ``criterion="iou"``: inter / (area_a + area_b − inter); ``"a"``: inter / area_a (KITTI's test of a
    detection against a DontCare region). 0 where the boxes do not overlap with positive width and height.
    """
    w = np.minimum(a[..., 2], b[..., 2]) - np.maximum(a[..., 0], b[..., 0])
    h = np.minimum(a[..., 3], b[..., 3]) - np.maximum(a[..., 1], b[..., 1])
    hit = (w > 0) & (h > 0)
    inter = np.where(hit, w * h, 0.0)
    area_a = (a[..., 2] - a[..., 0]) * (a[..., 3] - a[..., 1])
    if criterion == "iou":
        area_b = (b[..., 2] - b[..., 0]) * (b[..., 3] - b[..., 1])
        denom = area_a + area_b - inter
    elif criterion == "a":
        denom = area_a
    else:
        raise ValueError(f"criterion must be 'iou' or 'a', got {criterion!r}")
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(hit, inter / np.where(hit, denom, 1.0), 0.0)


def box2d_overlap(a, b, criterion: Literal["iou", "a"] = "iou") -> np.ndarray:
    """All pairs: [N, 4] × [M, 4] → [N, M] (see :func:`box2d_overlap_paired`)."""
    a = _as_boxes(a, 4, "a")
    b = _as_boxes(b, 4, "b")
    return box2d_overlap_paired(a[:, None, :], b[None, :, :], criterion)


# --------------------------------------------------------------------------------------------------
# Rotated rectangles
# --------------------------------------------------------------------------------------------------
def rect_corners(r: np.ndarray) -> np.ndarray:
    """[..., 5] (cx, cy, l, w, yaw) → [..., 4, 2] corners, counter-clockwise for l, w > 0."""
    c, s = np.cos(r[..., 4]), np.sin(r[..., 4])
    hl, hw = r[..., 2] / 2, r[..., 3] / 2
    ux, uy = hl * c, hl * s  # half length along the heading
    vx, vy = -hw * s, hw * c  # half width across it
    cx, cy = r[..., 0], r[..., 1]
    x = np.stack([cx + ux + vx, cx - ux + vx, cx - ux - vx, cx + ux - vx], axis=-1)
    y = np.stack([cy + uy + vy, cy - uy + vy, cy - uy - vy, cy + uy - vy], axis=-1)
    return np.stack([x, y], axis=-1)


def _polygon_area(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Shoelace area of closed polygons given by vertex coordinates x, y [P, K] (counter-clockwise).

    Rows with fewer than K vertices repeat their first vertex in the unused slots, which adds only
    zero-length edges, so no mask is needed. Summed left to right in a fixed order.
    """
    if x.shape[1] == 0:
        return np.zeros(x.shape[0])
    xn, yn = np.roll(x, -1, axis=1), np.roll(y, -1, axis=1)
    term = x * yn - y * xn
    acc = term[:, 0].copy()
    for j in range(1, term.shape[1]):
        acc += term[:, j]
    return acc / 2


def _clip(
    x: np.ndarray,
    y: np.ndarray,
    n: np.ndarray,
    px: np.ndarray,
    py: np.ndarray,
    ex: np.ndarray,
    ey: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Clip convex polygons (vertices x, y [P, K], the first n[p] used, unused slots holding the first
    vertex) to the left half-plane of the directed line through (px, py) [P] with direction (ex, ey)
    (boundary inclusive: Sutherland–Hodgman). Returns the clipped polygons in the same form."""
    P, K = x.shape
    used = np.arange(K)[None, :] < n[:, None]
    s = ex[:, None] * (y - py[:, None]) - ey[:, None] * (x - px[:, None])
    xn, yn, sn = np.roll(x, -1, axis=1), np.roll(y, -1, axis=1), np.roll(s, -1, axis=1)
    inside = s >= 0
    keep = used & inside
    cross = used & (inside != (sn >= 0))
    t = s / np.where(cross, s - sn, 1.0)
    cx, cy = np.empty((P, K, 2)), np.empty((P, K, 2))
    cx[:, :, 0], cx[:, :, 1] = x, x + t * (xn - x)
    cy[:, :, 0], cy[:, :, 1] = y, y + t * (yn - y)
    mask = np.empty((P, K, 2), dtype=bool)
    mask[:, :, 0], mask[:, :, 1] = keep, cross
    cx, cy, mask = cx.reshape(P, 2 * K), cy.reshape(P, 2 * K), mask.reshape(P, 2 * K)
    n_out = mask.sum(axis=1)
    width = int(n_out.max()) if P else 0
    first = mask.argmax(axis=1)
    ar = np.arange(P)
    ox = np.repeat(cx[ar, first][:, None], width, axis=1)
    oy = np.repeat(cy[ar, first][:, None], width, axis=1)
    rows, cols = np.nonzero(mask)
    dst = (np.cumsum(mask, axis=1) - 1)[rows, cols]
    ox[rows, dst] = cx[rows, cols]
    oy[rows, dst] = cy[rows, cols]
    return ox, oy, n_out


def rect_area(r: np.ndarray) -> np.ndarray:
    """Area of rectangles [..., 5] by the shoelace formula on their corners (= l·w up to rounding; used
    in every IoU here so that identical rectangles give exactly 1)."""
    corners = rect_corners(r).reshape(-1, 4, 2)
    return _polygon_area(corners[..., 0], corners[..., 1]).reshape(r.shape[:-1])


def bev_may_intersect(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """[P] bool: the bounding circles of rectangles a[i] and b[i] meet (else their intersection is 0)."""
    ra = np.hypot(a[:, 2], a[:, 3]) / 2
    rb = np.hypot(b[:, 2], b[:, 3]) / 2
    return np.hypot(a[:, 0] - b[:, 0], a[:, 1] - b[:, 1]) <= (ra + rb) * (1 + 1e-9)


def bev_intersection_paired(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Exact intersection area of rectangle a[i] with b[i] ([P, 5] each, sizes ≥ 0) → [P]."""
    P = a.shape[0]
    out = np.zeros(P)
    if P == 0:
        return out
    idx = np.flatnonzero(bev_may_intersect(a, b))
    for s in range(0, idx.size, _CHUNK):  # bounded memory for any number of pairs
        sub = idx[s : s + _CHUNK]
        out[sub] = _clipped_area(a[sub], b[sub])
    return out


_CHUNK = 1 << 17


def _clipped_area(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Area of rectangle a[i] clipped to rectangle b[i] (Sutherland–Hodgman, boundary inclusive)."""
    ca, cb = rect_corners(a), rect_corners(b)
    x, y, n = ca[..., 0], ca[..., 1], np.full(a.shape[0], 4)
    bx, by = cb[..., 0], cb[..., 1]
    for k in range(4):
        k1 = (k + 1) % 4
        x, y, n = _clip(x, y, n, bx[:, k], by[:, k], bx[:, k1] - bx[:, k], by[:, k1] - by[:, k])
        if x.shape[1] == 0:
            return np.zeros(a.shape[0])
    return np.maximum(_polygon_area(x, y), 0.0)


def _all_pairs(fn, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    n, m = a.shape[0], b.shape[0]
    ia, ib = np.repeat(np.arange(n), m), np.tile(np.arange(m), n)
    return fn(a[ia], b[ib]).reshape(n, m)


def _iou(inter: np.ndarray, area_a: np.ndarray, area_b: np.ndarray) -> np.ndarray:
    union = area_a + area_b - inter
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(union > 0, inter / np.where(union > 0, union, 1.0), 0.0)


def bev_iou_paired(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of rectangle a[i] with b[i] ([P, 5]) → [P]."""
    return _iou(bev_intersection_paired(a, b), rect_area(a), rect_area(b))


def bev_intersection(a, b) -> np.ndarray:
    """All pairs: [N, 5] × [M, 5] rectangles → [N, M] exact intersection areas."""
    a = _as_boxes(a, 5, "a", (2, 3))
    b = _as_boxes(b, 5, "b", (2, 3))
    return _all_pairs(bev_intersection_paired, a, b)


def bev_iou(a, b) -> np.ndarray:
    """All pairs: [N, 5] × [M, 5] rectangles (cx, cy, l, w, yaw) → [N, M] exact IoU, float64.

    Identical rectangles give 1 (also rotated by 180°, or a square rotated by 90°, up to rounding of
    cos/sin), touching ones 0, zero-area ones 0. Raises ValueError on a wrong shape, NaN or negative size.
    """
    a = _as_boxes(a, 5, "a", (2, 3))
    b = _as_boxes(b, 5, "b", (2, 3))
    return _all_pairs(bev_iou_paired, a, b)


# --------------------------------------------------------------------------------------------------
# 3D boxes
# --------------------------------------------------------------------------------------------------
def iou3d_paired(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """3D IoU of LiDAR boxes a[i], b[i] ([P, 7] = x, y, z centre, l, w, h, yaw) → [P]."""
    ra, rb = a[:, [0, 1, 3, 4, 6]], b[:, [0, 1, 3, 4, 6]]
    inter = bev_intersection_paired(ra, rb)
    top_a, bot_a = a[:, 2] + a[:, 5] / 2, a[:, 2] - a[:, 5] / 2
    top_b, bot_b = b[:, 2] + b[:, 5] / 2, b[:, 2] - b[:, 5] / 2
    dz = np.minimum(top_a, top_b) - np.maximum(bot_a, bot_b)
    # Volumes from the same top/bottom values as the overlap, so identical boxes give exactly 1.
    return _iou(inter * np.maximum(dz, 0.0), rect_area(ra) * (top_a - bot_a), rect_area(rb) * (top_b - bot_b))


def iou3d(a, b) -> np.ndarray:
    """All pairs: [N, 7] × [M, 7] LiDAR boxes (x, y, z, l, w, h, yaw; z the centre) → [N, M] 3D IoU."""
    a = _as_boxes(a, 7, "a", (3, 4, 5))
    b = _as_boxes(b, 7, "b", (3, 4, 5))
    return _all_pairs(iou3d_paired, a, b)
