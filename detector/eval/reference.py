"""An independent, literal, frame-by-frame implementation of the KITTI protocol: the test oracle for the
fast evaluator (:func:`detector.eval.kitti_metric.evaluate`).

It shares no code with the fast path: its own overlaps (2D boxes; BEV rectangles clipped polygon by
polygon with Sutherland–Hodgman in plain Python; 3D = BEV × vertical overlap), its own ignore rules, the
two passes written record by record as the protocol states them (:mod:`detector.eval.protocol`), its own
score thresholds and monotone precision. It reads only the protocol's constant tables (minimum overlaps,
neighbour classes, the level limits, NO_DETECTION). Slow by design.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from detector.data.kitti_labels import KittiLabels
from detector.eval.protocol import MIN_OVERLAP, N_SAMPLE_PTS, NEIGHBOUR, NO_DETECTION, Level


@dataclass
class ReferenceCurve:
    """Counts per score threshold and the 41-point monotone curves of one class / level / metric."""

    thresholds: list[float]
    tp: np.ndarray
    fp: np.ndarray
    fn: np.ndarray
    similarity: np.ndarray
    n_gt: int
    precision: np.ndarray  # [41]
    aos: np.ndarray  # [41]


# --------------------------------------------------------------------------------------------------
# Overlaps, one pair at a time
# --------------------------------------------------------------------------------------------------
def _box2d(d: Sequence[float], g: Sequence[float], criterion: str) -> float:
    iw = min(d[2], g[2]) - max(d[0], g[0])
    ih = min(d[3], g[3]) - max(d[1], g[1])
    if iw <= 0 or ih <= 0:
        return 0.0
    inter = iw * ih
    area_d = (d[2] - d[0]) * (d[3] - d[1])
    denom = area_d if criterion == "a" else area_d + (g[2] - g[0]) * (g[3] - g[1]) - inter
    return inter / denom if denom > 0 else 0.0


def _footprint(loc, dims, ry) -> list[tuple[float, float]]:
    """Corners (x, z) of a camera-frame box's footprint: length along the box's x axis, width along z,
    rotated by ry about the camera's y axis (x' = cos·x + sin·z, z' = −sin·x + cos·z)."""
    half_l, half_w = abs(dims[2]) / 2, abs(dims[1]) / 2
    c, s = math.cos(ry), math.sin(ry)
    pts = [(half_l, half_w), (half_l, -half_w), (-half_l, -half_w), (-half_l, half_w)]
    return [(loc[0] + c * x + s * z, loc[2] - s * x + c * z) for x, z in pts]


def _signed_area(poly) -> float:
    return 0.5 * sum(poly[i - 1][0] * poly[i][1] - poly[i][0] * poly[i - 1][1] for i in range(len(poly)))


def _clip(subject, clipper):
    """Sutherland–Hodgman: the part of convex ``subject`` inside convex counter-clockwise ``clipper``."""
    out = list(subject)
    for k in range(len(clipper)):
        if not out:
            break
        a, b = clipper[k - 1], clipper[k]
        src, out = out, []
        for i in range(len(src)):
            p, q = src[i - 1], src[i]
            sp, sq = _side(a, b, p), _side(a, b, q)
            if sq >= 0:
                if sp < 0:
                    out.append(_cross_point(p, q, sp, sq))
                out.append(q)
            elif sp >= 0:
                out.append(_cross_point(p, q, sp, sq))
    return out


def _side(a, b, p) -> float:
    """> 0 when p lies left of the line a -> b."""
    return (b[0] - a[0]) * (p[1] - a[1]) - (b[1] - a[1]) * (p[0] - a[0])


def _cross_point(p, q, sp, sq):
    t = sp / (sp - sq)
    return (p[0] + t * (q[0] - p[0]), p[1] + t * (q[1] - p[1]))


def _ccw(poly):
    return poly if _signed_area(poly) >= 0 else poly[::-1]


def _overlap(metric: str, d: KittiLabels, j: int, g: KittiLabels, i: int, criterion: str) -> float:
    if metric == "2d":
        return _box2d(d.bbox[j], g.bbox[i], criterion)
    pd = _ccw(_footprint(d.location[j], d.dimensions[j], d.rotation_y[j]))
    pg = _ccw(_footprint(g.location[i], g.dimensions[i], g.rotation_y[i]))
    inter = _clip(pd, pg)
    inter_area = abs(_signed_area(inter)) if len(inter) >= 3 else 0.0
    size_d, size_g = abs(_signed_area(pd)), abs(_signed_area(pg))
    if metric == "3d":
        d_bottom, d_top = d.location[j][1], d.location[j][1] - d.dimensions[j][0]
        g_bottom, g_top = g.location[i][1], g.location[i][1] - g.dimensions[i][0]
        inter_area *= max(min(d_bottom, g_bottom) - max(d_top, g_top), 0.0)
        size_d *= d_bottom - d_top
        size_g *= g_bottom - g_top
    denom = size_d if criterion == "a" else size_d + size_g - inter_area
    return inter_area / denom if denom > 0 else 0.0


# --------------------------------------------------------------------------------------------------
# The protocol, record by record
# --------------------------------------------------------------------------------------------------
def _clean(cls: str, level: Level, gt: KittiLabels, dt: KittiLabels):
    """(ignored_gt, ignored_det, DontCare indices): 0 counted, 1 ignored, -1 not part of this class."""
    ign_gt = []
    for i in range(len(gt)):
        height = gt.bbox[i][3] - gt.bbox[i][1]
        dist = math.hypot(gt.location[i][0], gt.location[i][2])
        outside = (
            gt.occluded[i] > level.max_occlusion
            or gt.truncated[i] > level.max_truncation
            or height <= level.min_height  # at or below the minimum height: not in the level
            or not (level.min_distance <= dist < level.max_distance)
        )
        if gt.name[i] == cls:
            ign_gt.append(1 if outside else 0)
        elif NEIGHBOUR.get(cls) == gt.name[i]:
            ign_gt.append(1)
        else:
            ign_gt.append(-1)
    ign_dt = []
    for j in range(len(dt)):
        height = abs(dt.bbox[j][3] - dt.bbox[j][1])
        dist = math.hypot(dt.location[j][0], dt.location[j][2])
        if height < level.min_height:  # strictly below: ignored, whatever its class
            ign_dt.append(1)
        elif dt.name[j] == cls:
            ign_dt.append(0 if level.min_distance <= dist < level.max_distance else 1)
        else:
            ign_dt.append(-1)
    dc = [i for i in range(len(gt)) if gt.name[i] == "DontCare"]
    return ign_gt, ign_dt, dc


def _statistics(cls, gt, dt, ov, ov_dc, ign_gt, ign_dt, dc, compute_fp: bool, thresh: float = 0.0):
    """One frame, one pass: (tp, fp, fn, similarity, tp_scores). ``ov[j][i]`` / ``ov_dc[j][i]``: IoU /
    intersection over the detection of detection j with GT record i."""
    min_ov = MIN_OVERLAP[cls]
    assigned = [False] * len(dt)
    below = [compute_fp and dt.score[j] < thresh for j in range(len(dt))]
    tp = fp = fn = 0
    sim = 0.0
    scores = []
    for i in range(len(gt)):
        if ign_gt[i] == -1:
            continue
        best, best_score, best_ov, took_ignored = -1, NO_DETECTION, 0.0, False
        for j in range(len(dt)):
            if ign_dt[j] == -1 or assigned[j] or below[j] or not ov[j][i] > min_ov:
                continue
            if not compute_fp:  # first pass: the highest score strictly above the running best
                if dt.score[j] > best_score:
                    best, best_score = j, dt.score[j]
            elif ign_dt[j] == 0 and (ov[j][i] > best_ov or took_ignored):
                best, best_ov, took_ignored = j, ov[j][i], False
            elif ign_dt[j] == 1 and best == -1:
                best, took_ignored = j, True
        if best == -1:
            fn += ign_gt[i] == 0
        elif ign_gt[i] == 1 or ign_dt[best] == 1:
            assigned[best] = True
        else:
            tp += 1
            scores.append(dt.score[best])
            sim += (1.0 + math.cos(gt.alpha[i] - dt.alpha[best])) / 2.0
            assigned[best] = True
    if compute_fp:
        for j in range(len(dt)):
            fp += not (assigned[j] or ign_dt[j] != 0 or below[j])
        for i in dc:
            for j in range(len(dt)):
                if assigned[j] or ign_dt[j] != 0 or below[j]:
                    continue
                if ov_dc[j][i] > min_ov:
                    assigned[j] = True
                    fp -= 1
    return tp, fp, fn, sim, scores


def _thresholds(scores: list[float], n_gt: int) -> list[float]:
    """Walk the TP scores from the highest; keep a score when its recall is the closest to the next of
    the 41 recall steps (the last score is always kept)."""
    v = sorted(scores, reverse=True)
    out, current = [], 0.0
    for i in range(len(v)):
        left = (i + 1) / n_gt
        right = (i + 2) / n_gt if i < len(v) - 1 else left
        if (right - current) < (current - left) and i < len(v) - 1:
            continue
        out.append(v[i])
        current += 1.0 / (N_SAMPLE_PTS - 1.0)
    return out


def _monotone(values: list[float]) -> np.ndarray:
    out = [0.0] * N_SAMPLE_PTS
    for i in range(len(values)):
        out[i] = max(values[i:])
    return np.asarray(out)


def reference_curve(
    gt: Sequence[KittiLabels], dt: Sequence[KittiLabels], cls: str, level: Level, metric: str
) -> ReferenceCurve:
    """Evaluate one class at one level in one metric ("2d", "bev" or "3d"; AOS comes with "2d")."""
    frames = []
    for g, d in zip(gt, dt, strict=True):
        ov = [[_overlap(metric, d, j, g, i, "iou") for i in range(len(g))] for j in range(len(d))]
        ov_dc = [[_overlap(metric, d, j, g, i, "a") for i in range(len(g))] for j in range(len(d))]
        frames.append((g, d, ov, ov_dc, *_clean(cls, level, g, d)))
    n_gt = sum(f[4].count(0) for f in frames)
    scores: list[float] = []
    for f in frames:
        scores += _statistics(cls, *f, compute_fp=False)[4]
    thr = _thresholds(scores, n_gt) if n_gt else []
    T = len(thr)
    tp, fp, fn, sim = np.zeros(T, int), np.zeros(T, int), np.zeros(T, int), np.zeros(T)
    for f in frames:
        for t in range(T):
            a, b, c, s, _ = _statistics(cls, *f, compute_fp=True, thresh=thr[t])
            tp[t] += a
            fp[t] += b
            fn[t] += c
            sim[t] += s
    prec = [tp[t] / (tp[t] + fp[t]) if tp[t] + fp[t] > 0 else 0.0 for t in range(T)]
    aos = [sim[t] / (tp[t] + fp[t]) if tp[t] + fp[t] > 0 else 0.0 for t in range(T)]
    return ReferenceCurve(thr, tp, fp, fn, sim, n_gt, _monotone(prec), _monotone(aos))
