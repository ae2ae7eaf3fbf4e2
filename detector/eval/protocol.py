"""The KITTI object-detection evaluation protocol: its constants and its scalar rules.

Written from the protocol of the KITTI devkit (``evaluate_object``), which defines the official numbers.
Each rule below has a hand-built test (tests/eval/test_protocol.py, tests/eval/test_kitti_metric.py) whose
expected AP follows from the rule as stated here.

Reading
  R1. Every numeric field of label and result files is read as float64 (the devkit's ``%lf``) and used
      as read, for GT and detections alike: 40 − 1e-7 px stays below 40, scores 1e-9 apart stay distinct.
      Result files: 16 fields (15 + score); label files: 15, ``occluded`` an integer. Fewer or more
      fields, a non-numeric field, NaN or infinity: one error naming the file and line.

Which records take part (per class and level)
  R2. Classes Car, Pedestrian, Cyclist. The neighbour classes Van (for Car) and Person_sitting (for
      Pedestrian) are always *ignored* GT; other classes' GT play no part.
  R3. Levels (cumulative): easy / moderate / hard. A GT of the class is counted iff its 2D height
      (bottom − top) is **greater than** 40 / 25 / 25 px (at or below the minimum it is ignored: a GT of
      exactly 40.00 px is not easy), occlusion ≤ 0 / 1 / 2 and truncation ≤ 0.15 / 0.30 / 0.50 (both
      borders inclusive); otherwise it is *ignored* (neither TP nor FN; a detection matched to it is
      neither TP nor FP).
  R4. A detection whose 2D height abs(bottom − top) is **strictly below** the level's minimum is
      *ignored* (never a FP; matched to a GT it makes that GT neither TP nor FN); exactly at the minimum it
      counts. The devkit applies this to detections of every class (a low detection of another class can
      absorb a GT); we reproduce it.
  R5. NO_DETECTION: a detection whose score is at or below the devkit's ``NO_DETECTION`` = −1e7 is never
      assigned to a GT in the first pass (the devkit requires a score strictly above the running best,
      which starts at NO_DETECTION); its score is therefore below every threshold of the second pass, so
      it is never a TP, never a FP and absorbs no GT: it takes no part at all.

Overlap
  R6. Minimum overlap 0.7 / 0.5 / 0.5 in every metric (2D, BEV, 3D); a detection can match a GT only if
      their overlap is **strictly greater** than the minimum. 2D: image boxes; BEV: rotated rectangles
      in the camera x–z plane; 3D: BEV × the vertical extent [y − h, y] (y is the box bottom).
  R7. DontCare regions: a detection of the class not matched to any GT whose overlap with a DontCare
      record, measured as intersection over the *detection's* area (volume in 3D) in the metric's own
      geometry, exceeds the class's minimum overlap is not a FP. KITTI's DontCare records carry a
      placeholder 3D box far away (dims −1, location −1000), so in practice they matter in 2D only.

Matching and AP
  R8. Frame by frame, GT in file order. First pass (all detections): each GT takes the unassigned
      candidate with the highest score (first in file order on ties); the scores of the true positives
      give the score thresholds (:func:`score_thresholds`, at most 41). Second pass, per threshold
      (detections with score below it are dropped): each GT takes the unassigned non-ignored candidate
      with the largest overlap, else the first ignored one.
  R9. Precision at each threshold = TP / (TP + FP), made monotone (max over all higher-recall
      thresholds); 41 sampled points (index i ~ recall i/40), zero beyond the last threshold. AP R40 =
      mean of points 1..40, AP R11 = mean of points 0, 4, ..., 40. AOS uses the orientation similarity
      (1 + cos(Δalpha)) / 2 summed over TPs in place of TP (2D matching).

Deliberate differences from the devkit (each documented where it is decided):
  D1. Overlaps are exact (polygon clipping in float64, :mod:`detector.geometry.iou`); the devkit's boost
      polygons can differ by ~1e-7, so a pair within ~1e-7 of a minimum overlap may match in one and not
      the other. We keep ours exact (identical boxes give IoU exactly 1).
  D2. A threshold with TP + FP = 0 has precision 0 (the devkit divides 0 by 0).
  D3. A class with no counted GT (or no detections) gets AP 0 and is still reported (the devkit skips
      classes without detections); the number of counted GT is reported with the APs.
  D4. AP by distance (:func:`distance_levels`) is our extension, not part of KITTI.
  D5. Unknown class names and lower-case names are an error naming the file and line (the devkit skips
      or misreads them). In result files ``occluded`` need not be an integer (the devkit ignores it).
  D6. Our result writer computes a detection's alpha as rotation_y − atan2(x, z) (the ray from the camera,
      :func:`detector.data.kitti_labels.observation_angle`); real KITTI labels agree to their 2 decimals far away
      but differ by up to ~0.3 m / distance near the sensor (0.049 rad at 4 m; tests/eval/test_records.py),
      which costs AOS at most (1 − cos 0.05) / 2 ≈ 0.06 % on such a detection.

LiDAR-only datasets (no images: :mod:`detector.eval.lidar_metric`; our rule, not KITTI's)
  L1. Records are boxes in the LiDAR frame (centre, dx dy dz, heading) read as float64. No 2D boxes, no
      truncation or occlusion: no difficulty levels and no AOS; DontCare is absent (the reader leaves it out).
  L2. Classes: any names, each with its minimum overlap from the configuration (``data.classes``); a
      detection matches a GT only if their overlap is **strictly greater** than it (as R6). Van (for Car) and
      Person_sitting (for Pedestrian) GT are ignored as in R2; GT of other classes play no part.
  L3. Metrics: BEV IoU (rotated rectangles in the ground plane) and 3D IoU (BEV × the vertical extent),
      exact as D1. Level ``overall``: every GT of the class is counted, every detection of the class is a
      candidate. Distance bands (D4's ranges: 0-30, 30-50, 50+ m) by the BEV distance of the box centre
      from the sensor, sqrt(x² + y²): GT and detections outside the band are ignored (as in D4).
  L4. Matching and AP: R5, R8 and R9 unchanged (the same code: the boxes become the metric's records in
      a camera-like geometry, x_c = −y, y_c = −(z − dz/2), z_c = x, a rotation that keeps every overlap and
      distance, with an empty 2D box, truncation 0 and occlusion 0).

Not the protocol but the application (``detector.module.frame_records``): validation and
``evaluate_checkpoint`` score ground truth and detections whose box centre lies inside the BEV grid
(DontCare kept), and write exactly those records (``eval/label_2``, ``eval/data``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from detector.data.kitti_labels import DIFFICULTY_LEVELS, counted_at_level

EVAL_CLASSES = ("Car", "Pedestrian", "Cyclist")
MIN_OVERLAP = {"Car": 0.7, "Pedestrian": 0.5, "Cyclist": 0.5}
NEIGHBOUR = {"Car": "Van", "Pedestrian": "Person_sitting"}
METRICS = ("2d", "bev", "3d", "aos")
N_SAMPLE_PTS = 41
NO_DETECTION = -1e7  # the devkit's NO_DETECTION: detections scored at or below it take no part (R5)


@dataclass(frozen=True)
class Level:
    """Which GT and detections count at one evaluation level.

    A GT of the class is counted iff 2D height (bottom − top) > ``min_height``, occlusion ≤
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

    def gt_counted(self, height, occluded, truncated):
        """R3 on arrays (the distance range is checked by the caller)."""
        return counted_at_level(height, occluded, truncated, (self.min_height, self.max_occlusion, self.max_truncation))

    def det_ignored(self, height):
        """R4 on arrays: abs(2D height) strictly below the minimum."""
        return np.abs(height) < self.min_height


KITTI_LEVELS = tuple(Level(name, h, occ, trunc) for name, (h, occ, trunc) in DIFFICULTY_LEVELS.items())
# L3: the one level of a LiDAR-only dataset: every GT counted (no 2D height, occlusion or truncation limits)
OVERALL = Level("overall", -math.inf, 0, 0.0)
LIDAR_METRICS = ("bev", "3d")

DISTANCE_RANGES = ((0.0, 30.0), (30.0, 50.0), (50.0, math.inf))


def range_name(lo: float, hi: float) -> str:
    return f"{lo:g}+" if math.isinf(hi) else f"{lo:g}-{hi:g}"


def distance_levels(ranges: Sequence[tuple[float, float]] = DISTANCE_RANGES) -> tuple[Level, ...]:
    """Levels for AP by distance (not part of KITTI): the hard level's occlusion/truncation limits, no
    minimum 2D height (far objects are small in the image; min_height −inf, so even a GT with a zero 2D
    box counts), GT and detections outside the range ignored."""
    out = []
    for lo, hi in ranges:
        if not (0 <= lo < hi):
            raise ValueError(f"distance range ({lo}, {hi}) must satisfy 0 <= lo < hi")
        out.append(Level(range_name(lo, hi), -math.inf, 2, 0.50, float(lo), float(hi)))
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
