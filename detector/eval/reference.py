"""Literal, frame-by-frame implementation of the KITTI protocol: the test oracle for the fast evaluator.

It follows the protocol's steps one record at a time (see :mod:`detector.eval.protocol`) with plain
Python loops, so it reads like the protocol and is slow; :func:`detector.eval.kitti_metric.evaluate`
must give the same counts and curves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from detector.data.kitti import KittiLabels
from detector.eval.overlap import Records, overlap_pairs
from detector.eval.protocol import MIN_OVERLAP, N_SAMPLE_PTS, NEIGHBOUR, Level, monotone, score_thresholds


@dataclass
class ReferenceCurve:
    """Counts per score threshold and the 41-point monotone curves of one class / level / metric."""

    thresholds: np.ndarray
    tp: np.ndarray
    fp: np.ndarray
    fn: np.ndarray
    similarity: np.ndarray
    n_gt: int
    precision: np.ndarray  # [41]
    aos: np.ndarray  # [41]


def _clean(cls: str, level: Level, gt: Records, dt: Records) -> tuple[list[int], list[int], list[int]]:
    """(ignored_gt, ignored_det, DontCare indices) of one frame: 0 = counted, 1 = ignored, -1 = not part
    of this class's evaluation."""
    ign_gt = []
    for i in range(len(gt)):
        name = gt.name[i]
        if name == cls:
            valid = 1
        elif NEIGHBOUR.get(cls) == name:
            valid = 0
        else:
            valid = -1
        height = gt.bbox[i, 3] - gt.bbox[i, 1]
        dist = float(np.hypot(gt.location[i, 0], gt.location[i, 2]))
        outside = (
            gt.occluded[i] > level.max_occlusion
            or gt.truncated[i] > level.max_truncation
            or height < level.min_height
            or not (level.min_distance <= dist < level.max_distance)
        )
        if valid == 1 and not outside:
            ign_gt.append(0)
        elif valid == 0 or (valid == 1 and outside):
            ign_gt.append(1)
        else:
            ign_gt.append(-1)
    ign_dt = []
    for j in range(len(dt)):
        height = abs(dt.bbox[j, 3] - dt.bbox[j, 1])
        dist = float(np.hypot(dt.location[j, 0], dt.location[j, 2]))
        if height < level.min_height:
            ign_dt.append(1)
        elif dt.name[j] == cls:
            ign_dt.append(0 if level.min_distance <= dist < level.max_distance else 1)
        else:
            ign_dt.append(-1)
    dc = [i for i in range(len(gt)) if gt.name[i] == "DontCare"]
    return ign_gt, ign_dt, dc


def _overlaps(metric: str, dt: Records, gt: Records, criterion: str) -> np.ndarray:
    """[n_dt, n_gt] overlaps of every detection with every GT record of one frame."""
    di = np.repeat(np.arange(len(dt)), len(gt))
    gi = np.tile(np.arange(len(gt)), len(dt))
    return overlap_pairs(metric, dt, di, gt, gi, criterion).reshape(len(dt), len(gt))


def _statistics(cls, gt, dt, ov, ov_dc, ign_gt, ign_dt, dc, compute_fp: bool, thresh: float = 0.0):
    """One frame: (tp, fp, fn, similarity, tp_scores). ``ov`` / ``ov_dc``: [n_dt, n_gt] overlaps (IoU /
    intersection over the detection)."""
    min_ov = MIN_OVERLAP[cls]
    n_gt, n_dt = len(gt), len(dt)
    assigned = [False] * n_dt
    below = [compute_fp and dt.score[j] < thresh for j in range(n_dt)]
    tp = fp = fn = 0
    sim = 0.0
    scores = []
    for i in range(n_gt):
        if ign_gt[i] == -1:
            continue
        best = -1
        best_score = -np.inf
        best_ov = 0.0
        took_ignored = False
        for j in range(n_dt):
            if ign_dt[j] == -1 or assigned[j] or below[j]:
                continue
            o = ov[j, i]
            if not o > min_ov:
                continue
            if not compute_fp:
                if dt.score[j] > best_score:
                    best, best_score = j, dt.score[j]
            elif ign_dt[j] == 0 and (o > best_ov or took_ignored):
                best, best_ov, took_ignored = j, o, False
            elif ign_dt[j] == 1 and best == -1:
                best, took_ignored = j, True
        if best == -1:
            if ign_gt[i] == 0:
                fn += 1
        elif ign_gt[i] == 1 or ign_dt[best] == 1:
            assigned[best] = True
        else:
            tp += 1
            scores.append(dt.score[best])
            sim += (1.0 + np.cos(gt.alpha[i] - dt.alpha[best])) / 2.0
            assigned[best] = True
    if compute_fp:
        for j in range(n_dt):
            if not (assigned[j] or ign_dt[j] != 0 or below[j]):
                fp += 1
        for i in dc:
            for j in range(n_dt):
                if assigned[j] or ign_dt[j] != 0 or below[j]:
                    continue
                if ov_dc[j, i] > min_ov:
                    assigned[j] = True
                    fp -= 1
    return tp, fp, fn, sim, scores


def reference_curve(
    gt: Sequence[KittiLabels], dt: Sequence[KittiLabels], cls: str, level: Level, metric: str
) -> ReferenceCurve:
    """Evaluate one class at one level in one metric ("2d", "bev" or "3d"; AOS comes with "2d")."""
    frames = []
    for g, d in zip(gt, dt, strict=True):
        gr, dr = Records.from_labels([g], with_score=False), Records.from_labels([d], with_score=True)
        frames.append(
            (
                gr,
                dr,
                _overlaps(metric, dr, gr, "iou"),
                _overlaps(metric, dr, gr, "a"),
                *_clean(cls, level, gr, dr),
            )
        )
    n_gt = sum(f[4].count(0) for f in frames)
    scores: list[float] = []
    for f in frames:
        scores += _statistics(cls, *f, compute_fp=False)[4]
    thr = score_thresholds(np.asarray(scores), n_gt)
    T = len(thr)
    tp, fp, fn, sim = np.zeros(T, int), np.zeros(T, int), np.zeros(T, int), np.zeros(T)
    for f in frames:
        for t in range(T):
            a, b, c, s, _ = _statistics(cls, *f, compute_fp=True, thresh=thr[t])
            tp[t] += a
            fp[t] += b
            fn[t] += c
            sim[t] += s
    with np.errstate(divide="ignore", invalid="ignore"):
        prec = np.where(tp + fp > 0, tp / np.maximum(tp + fp, 1), 0.0)
        aos = np.where(tp + fp > 0, sim / np.maximum(tp + fp, 1), 0.0)
    assert T <= N_SAMPLE_PTS
    return ReferenceCurve(thr, tp, fp, fn, sim, n_gt, monotone(prec, T), monotone(aos, T))
