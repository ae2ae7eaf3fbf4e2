"""The KITTI object-detection evaluation protocol: its constants and its two scalar rules.

Written from the protocol of the KITTI devkit (``evaluate_object``), which defines the official numbers:

- Classes Car, Pedestrian, Cyclist; minimum overlap 0.7 / 0.5 / 0.5 in every metric (2D, BEV, 3D). A
  detection matches a ground truth (GT) only if their overlap is **strictly greater** than the minimum.
- Levels (cumulative): easy / moderate / hard = GT 2D box height ≥ 40 / 25 / 25 px, occlusion ≤ 0 / 1 / 2,
  truncation ≤ 0.15 / 0.30 / 0.50. A GT of the class outside the level is *ignored* (neither TP nor
  FN; a detection matched to it is neither TP nor FP). The neighbour classes Van (for Car) and
  Person_sitting (for Pedestrian) are always ignored GT. Other classes play no part.
- A detection whose 2D box is lower than the level's minimum height is *ignored* (never a FP; matching
  it to a GT makes that GT neither TP nor FN). The devkit applies this to detections of every class
  (a low detection of another class can absorb a GT); we reproduce it.
- DontCare regions: a detection of the class not matched to any GT whose overlap with a DontCare record,
  measured as intersection over the *detection's* area (volume in 3D) in the metric's own geometry,
  exceeds the class's minimum overlap is not a FP. KITTI's DontCare records carry a placeholder 3D box
  far away (dims −1, location −1000), so in practice they matter in 2D only.
- Matching, frame by frame, GT in file order: first pass (all detections), each GT takes the unassigned
  candidate with the highest score; the scores of the true positives give the score thresholds
  (:func:`score_thresholds`). Second pass, per threshold (detections below it are dropped): each GT
  takes the unassigned non-ignored candidate with the largest overlap, else the first ignored one.
- Precision at each threshold = TP / (TP + FP), made monotone (max over all higher-recall thresholds);
  41 sampled points (index i ~ recall i/40), zero beyond the last threshold. AP R40 = mean of points
  1..40, AP R11 = mean of points 0, 4, ..., 40 (the official metric before 2019). AOS uses the
  orientation similarity (1 + cos(Δalpha)) / 2 summed over TPs in place of TP (2D matching).

Where the devkit leaves a case open we decide: a threshold with TP + FP = 0 has precision 0 (the devkit
divides 0 by 0); a class with no counted GT (or no detections) gets AP 0 and is still reported (the devkit
skips classes without detections); the number of counted GT is reported with the APs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

CLASSES = ("Car", "Pedestrian", "Cyclist")
MIN_OVERLAP = {"Car": 0.7, "Pedestrian": 0.5, "Cyclist": 0.5}
NEIGHBOUR = {"Car": "Van", "Pedestrian": "Person_sitting"}
METRICS = ("2d", "bev", "3d", "aos")
N_SAMPLE_PTS = 41


@dataclass(frozen=True)
class Level:
    """Which GT and detections count at one evaluation level.

    A GT of the class is counted iff 2D height (bottom − top) ≥ ``min_height``, occlusion ≤
    ``max_occlusion``, truncation ≤ ``max_truncation`` and its distance lies in [min_distance,
    max_distance); otherwise ignored. A detection is ignored iff abs(2D height) < ``min_height`` or (for
    detections of the class) its distance lies outside the range. Distance = sqrt(x² + z²) of the box's
    location in the camera frame (the BEV distance from the camera).
    """

    name: str
    min_height: float
    max_occlusion: int
    max_truncation: float
    min_distance: float = 0.0
    max_distance: float = math.inf

    @property
    def has_range(self) -> bool:
        return self.min_distance > 0 or math.isfinite(self.max_distance)


KITTI_LEVELS = (
    Level("easy", 40, 0, 0.15),
    Level("moderate", 25, 1, 0.30),
    Level("hard", 25, 2, 0.50),
)

DISTANCE_RANGES = ((0.0, 30.0), (30.0, 50.0), (50.0, math.inf))


def range_name(lo: float, hi: float) -> str:
    return f"{lo:g}+" if math.isinf(hi) else f"{lo:g}-{hi:g}"


def distance_levels(ranges: Sequence[tuple[float, float]] = DISTANCE_RANGES) -> tuple[Level, ...]:
    """Levels for AP by distance (not part of KITTI): the hard level's occlusion/truncation limits, no
    minimum 2D height (far objects are small in the image), GT and detections outside the range ignored."""
    out = []
    for lo, hi in ranges:
        if not (0 <= lo < hi):
            raise ValueError(f"distance range ({lo}, {hi}) must satisfy 0 <= lo < hi")
        out.append(Level(range_name(lo, hi), 0, 2, 0.50, float(lo), float(hi)))
    return tuple(out)


def score_thresholds(tp_scores: np.ndarray, n_gt: int) -> np.ndarray:
    """The devkit's score thresholds (at most 41) from the true positives' scores of the first pass.

    Scores sorted descending; score i (recall (i+1)/n_gt) becomes a threshold when it is the closest
    approximation of the next recall step r_k = k/40 (k = 0, 1, ...), i.e. unless the next score's recall
    is closer to r_k; the last score always is. r_k accumulates 1/40 in float64 as the devkit does.
    """
    v = np.sort(np.asarray(tp_scores, dtype=np.float64))[::-1]
    n = v.size
    if n == 0:
        return v
    left = (np.arange(n) + 1) / float(n_gt)
    right = np.append(left[1:], left[-1])
    out = []
    current = 0.0
    i = 0
    while i < n:
        # The condition "right - current >= current - left" only turns from False to True along i
        # (right grows, left grows), so the first i satisfying it is the next pick; the last always is.
        ok = (right[i:] - current) >= (current - left[i:])
        j = i + int(np.argmax(ok)) if ok.any() else n - 1
        out.append(v[j])
        current += 1.0 / (N_SAMPLE_PTS - 1.0)
        i = j + 1
    return np.asarray(out)


def monotone(values: np.ndarray, n_thresholds: int) -> np.ndarray:
    """41 points: values at the thresholds (zeros beyond), each replaced by the max over itself and all
    later points."""
    out = np.zeros(N_SAMPLE_PTS)
    out[:n_thresholds] = values[:n_thresholds]
    return np.maximum.accumulate(out[::-1])[::-1]


def ap_r40(curve: np.ndarray) -> float:
    """AP in percent from the 41-point monotone curve: mean of points 1..40."""
    return float(sum(float(x) for x in curve[1:N_SAMPLE_PTS])) / 40.0 * 100.0


def ap_r11(curve: np.ndarray) -> float:
    """AP in percent from the 41-point monotone curve: mean of points 0, 4, ..., 40."""
    return float(sum(float(x) for x in curve[0:N_SAMPLE_PTS:4])) / 11.0 * 100.0
