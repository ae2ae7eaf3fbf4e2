"""Which errors dominate an evaluation: every false positive and every missed object of the metric, classified.

    analysis = analyze(frame_ids, gt_frames, det_frames, {"Car": 0.7}, score_threshold=0.3)
    print(analysis.table())                  # per class: each kind of error by distance band
    print("\\n".join(analysis.summary()))     # one line per class, to compare between runs
    analysis.to_json()                       # settings, counts and every error

The frames are an evaluation's records (``eval/label_2`` and ``eval/data``), KITTI records (camera frame) or
LiDAR-only ones (:func:`detector.eval.lidar_metric.metric_records` turns them into the metric's records, as the
LiDAR-only metric does). The rule, per class:

Which records count - the metric's own, at one score threshold (:func:`detector.eval.kitti_metric.assign`)
  E1. The KITTI protocol's rules at one level (:mod:`detector.eval.protocol`): KITTI records at ``moderate`` by
      default (R3: a GT counts above 25 px, occlusion <= 1, truncation <= 0.3; others, Van for Car and
      Person_sitting for Pedestrian are ignored, R2; a detection lower than 25 px is ignored, R4; DontCare regions,
      R7); or ``distance``, the rule of AP by distance (every height, hard's occlusion and truncation limits, D4);
      LiDAR-only records at ``overall`` (L3: every GT of the class counts).
  E2. Detections scored at least ``score_threshold`` take part, the others none. The matching is the metric's
      second pass at that threshold in BEV (R8: each GT, in file order, takes the unassigned detection with the
      largest BEV IoU above the class's minimum). So the errors are exactly the metric's false negatives (counted GT
      that took no detection) and false positives (counted detections no GT took, outside DontCare) at that
      threshold, in BEV.
  E3. Every IoU is the metric's exact BEV IoU (:func:`detector.eval.overlap.overlap_pairs`, on
      :mod:`detector.geometry.iou`); a match needs an IoU strictly above the minimum (R6).

A missed object (a counted GT the metric left unmatched) is
  - ``found but loose``: a detection of its class scored at least the threshold overlaps it with BEV IoU at least
    ``loose_iou`` (0.5; below the minimum, else it would have matched): e.g. Car IoU in [0.5, 0.7];
  - ``missed``: none does.
A false positive (a counted detection the metric left unmatched) is, by its best BEV IoU with a GT of its class or
the neighbour class (any GT, counted or ignored):
  - ``duplicate``: above the minimum - that GT took another detection (the one with the largest IoU, R8; not
    necessarily the higher-scored);
  - ``loose``: in [``loose_iou``, minimum] - a box of a real object, placed too loosely to count;
  - ``mislocated``: in [``background_iou``, ``loose_iou``) (0.1 to 0.5);
  - ``other class``: below ``background_iou`` with its class, at least ``background_iou`` with a GT of another class
    (e.g. a Car box on a Truck or a Pedestrian; DontCare records are no objects);
  - ``background``: BEV IoU below ``background_iou`` with every GT of the frame.
Each error carries its frame, class, distance from the sensor (BEV, sqrt(x² + z²) of the camera-frame location for
KITTI records - the metric's distance, D4 -, sqrt(x² + y²) for LiDAR-only ones), its band (0-30, 30-50, 50+ m:
:data:`~detector.eval.protocol.DISTANCE_RANGES`), size, score (detections), best IoU and the record it was measured
with. The points inside each box are counted by the command where the dataset root is given
(:mod:`detector.commands.analyze_errors`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from detector.data.kitti_labels import DIFFICULTY_LEVELS, KittiLabels
from detector.data.lidar_labels import LidarLabels
from detector.eval.kitti_metric import assign
from detector.eval.lidar_metric import metric_records
from detector.eval.overlap import Records, overlap_pairs
from detector.eval.protocol import (
    DISTANCE_RANGES,
    KITTI_LEVELS,
    NEIGHBOUR,
    OVERALL,
    Level,
    distance_levels,
    range_name,
)

SCORE_THRESHOLD = 0.3  # as detector-predict's score_threshold
LOOSE_IOU = 0.5
BACKGROUND_IOU = 0.1
# (key, as printed): a missed object's kinds, then a false positive's
GT_KINDS = (("missed", "missed"), ("found_loose", "found but loose"))
DET_KINDS = (("duplicate", "duplicate"), ("loose", "loose"), ("mislocated", "mislocated"),
             ("other_class", "other class"), ("background", "background"))
KINDS = dict(GT_KINDS + DET_KINDS)
KITTI_LEVEL_NAMES = (*DIFFICULTY_LEVELS, "distance")


def level_of(name: str, lidar: bool) -> Level:
    """The level ``name`` (E1): ``easy`` / ``moderate`` / ``hard`` or ``distance`` for KITTI records, ``overall`` for
    LiDAR-only ones. Raises ValueError naming the choices."""
    if lidar:
        if name != "overall":
            raise ValueError(f"level={name!r}: LiDAR-only records have one level, overall")
        return OVERALL
    if name == "distance":
        return distance_levels(((0.0, math.inf),))[0]
    for lv in KITTI_LEVELS:
        if lv.name == name:
            return lv
    raise ValueError(f"level={name!r}: choose {', '.join(KITTI_LEVEL_NAMES)}")


def band_of(distance: float, ranges: Sequence[tuple[float, float]] = DISTANCE_RANGES) -> str:
    """The name of the distance band [lo, hi) holding ``distance`` (metres)."""
    for lo, hi in ranges:
        if lo <= distance < hi:
            return range_name(lo, hi)
    return "other"


@dataclass
class ErrorRecord:
    """One error. ``side`` "gt" (a missed object) or "detection" (a false positive); ``record`` its 0-based position
    among its file's records (KITTI: DontCare lines included); ``size`` (l, w, h) m; ``best_iou`` its best BEV IoU
    (with a detection of its class for a GT; with a GT of its class or neighbour class for a detection - with any
    GT for ``other class`` and ``background``) and ``best`` that record ({"class", "record", "score"?}), None where
    there is none; ``taken_by`` (duplicates) the detection its GT took; ``points`` inside the box (None: not
    counted)."""

    frame: str
    kind: str
    side: str
    cls: str
    record: int
    distance: float
    band: str
    size: tuple[float, float, float]
    score: float | None
    best_iou: float
    best: dict | None = None
    taken_by: dict | None = None
    points: int | None = None

    def to_json(self) -> dict:
        out = {"frame": self.frame, "kind": self.kind, "side": self.side, "class": self.cls, "record": self.record,
               "distance_m": round(self.distance, 3), "band": self.band,
               "size_lwh_m": [round(v, 3) for v in self.size], "score": self.score,
               "best_iou": round(self.best_iou, 4), "best": self.best}
        if self.taken_by is not None:
            out["taken_by"] = self.taken_by
        if self.points is not None:
            out["points"] = self.points
        return out


@dataclass
class ClassCounts:
    """Per class, by band: counted GT, true positives, and each kind of error."""

    n_gt: dict[str, int] = field(default_factory=dict)
    tp: dict[str, int] = field(default_factory=dict)
    kinds: dict[str, dict[str, int]] = field(default_factory=dict)


@dataclass
class ErrorAnalysis:
    """The errors of an evaluation and the settings they were found with (see the module docstring)."""

    frame_ids: list[str]
    classes: tuple[str, ...]
    min_overlap: dict[str, float]
    score_threshold: float
    level: str
    loose_iou: float
    background_iou: float
    errors: list[ErrorRecord]
    counts: dict[str, ClassCounts]
    bands: tuple[str, ...] = tuple(range_name(lo, hi) for lo, hi in DISTANCE_RANGES)

    def of(self, cls: str | None = None, kind: str | None = None) -> list[ErrorRecord]:
        return [e for e in self.errors if (cls is None or e.cls == cls) and (kind is None or e.kind == kind)]

    def total(self, cls: str, kind: str) -> int:
        return sum(self.counts[cls].kinds[kind].values())

    def summary(self) -> list[str]:
        """One line per class, e.g. ``errors Car (BEV IoU > 0.70, score >= 0.30, moderate): missed 3 | found but
        loose 2 | duplicate 0 | loose 2 | mislocated 1 | other class 0 | background 5 | found 14 of 19 GT``."""
        lines = []
        for c in self.classes:
            n = self.counts[c]
            kinds = " | ".join(f"{label} {self.total(c, k)}" for k, label in KINDS.items())
            lines.append(f"errors {c} (BEV IoU > {self.min_overlap[c]:.2f}, score >= {self.score_threshold:.2f}, "
                         f"{self.level}): {kinds} | found {sum(n.tp.values())} of {sum(n.n_gt.values())} GT")
        return lines

    def table(self) -> str:
        """Per class: counted GT, found, and each kind of error, by distance band and in total."""
        cols = (*self.bands, "total")
        lines = []
        for c in self.classes:
            n = self.counts[c]
            lines.append(f"{c}: BEV IoU > {self.min_overlap[c]:.2f}, detections scored >= {self.score_threshold:.2f}, "
                         f"level {self.level}, {len(self.frame_ids)} frames; distance from the sensor (m)")
            lines.append(f"{'':<12}{'':<18}" + "".join(f"{b:>8}" for b in cols))

            def row(side: str, label: str, per_band: dict[str, int]) -> str:
                vals = [per_band.get(b, 0) for b in self.bands]
                return f"{side:<12}{label:<18}" + "".join(f"{v:>8d}" for v in (*vals, sum(per_band.values())))

            lines.append(row("GT", "counted", n.n_gt))
            lines.append(row("", "found", n.tp))
            for k, label in GT_KINDS:
                lines.append(row("", label, n.kinds[k]))
            for i, (k, label) in enumerate(DET_KINDS):
                lines.append(row("false pos." if i == 0 else "", label, n.kinds[k]))
            lines.append("")
        return "\n".join(lines).rstrip()

    def to_json(self) -> dict:
        return {
            "settings": {"classes": list(self.classes), "min_overlap": self.min_overlap,
                         "score_threshold": self.score_threshold, "level": self.level, "loose_iou": self.loose_iou,
                         "background_iou": self.background_iou, "frames": len(self.frame_ids),
                         "bands": list(self.bands)},
            "summary": self.summary(),
            "counts": {c: {"gt": n.n_gt, "found": n.tp, **n.kinds} for c, n in self.counts.items()},
            "errors": [e.to_json() for e in self.errors],
        }


def as_metric_labels(frames: Sequence[KittiLabels | LidarLabels]) -> list[KittiLabels]:
    """The frames as the metric's records: KITTI records as they are, LiDAR-only ones through
    :func:`~detector.eval.lidar_metric.metric_records` (the LiDAR-only metric's translation)."""
    return [metric_records(f) if isinstance(f, LidarLabels) else f for f in frames]


def _frame_pairs(a: Records, ai: np.ndarray, b: Records, bi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every pair (ai[k], bi[m]) of records of the same frame."""
    if ai.size == 0 or bi.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    order = np.argsort(b.frame[bi], kind="stable")
    bs, bf = bi[order], b.frame[bi][order]
    lo = np.searchsorted(bf, a.frame[ai], "left")
    hi = np.searchsorted(bf, a.frame[ai], "right")
    reps = hi - lo
    pa = np.repeat(ai, reps)
    pb = bs[np.concatenate([np.arange(s, e) for s, e in zip(lo, hi, strict=True)])] if reps.sum() else \
        np.zeros(0, np.int64)
    return pa, pb.astype(np.int64)


def _best(a: Records, ai: np.ndarray, b: Records, bi: np.ndarray, det_first: bool) -> tuple[np.ndarray, np.ndarray]:
    """For each record ``ai[k]``: its best BEV IoU with the records ``bi`` of its frame and that record's index (-1:
    none, IoU 0). ``det_first``: ``a`` holds the detections (the IoU is symmetric; the order follows the metric)."""
    best = np.zeros(ai.size)
    arg = np.full(ai.size, -1)
    pa, pb = _frame_pairs(a, ai, b, bi)
    if pa.size == 0:
        return best, arg
    iou = overlap_pairs("bev", a, pa, b, pb) if det_first else overlap_pairs("bev", b, pb, a, pa)
    pos = np.searchsorted(ai, pa)  # ai is sorted
    order = np.lexsort((-iou, pos))  # per record, the best IoU first
    first = np.ones(order.size, bool)
    first[1:] = pos[order][1:] != pos[order][:-1]
    keep = order[first]
    best[pos[keep]] = iou[keep]
    arg[pos[keep]] = np.where(iou[keep] > 0, pb[keep], -1)
    return best, arg


def analyze(
    frame_ids: Sequence[str],
    gt: Sequence[KittiLabels | LidarLabels],
    dt: Sequence[KittiLabels | LidarLabels],
    min_overlap: Mapping[str, float],
    score_threshold: float = SCORE_THRESHOLD,
    level: str | None = None,
    loose_iou: float = LOOSE_IOU,
    background_iou: float = BACKGROUND_IOU,
) -> ErrorAnalysis:
    """Classify the false positives and missed objects of detections ``dt`` against ``gt`` (one per frame of
    ``frame_ids``, KITTI or LiDAR-only records) for the classes of ``min_overlap`` (their minimum BEV IoU), by the
    rule of the module docstring. ``level``: ``moderate`` (KITTI records' default), ``easy``, ``hard``, ``distance``;
    ``overall`` (LiDAR-only records, the only one)."""
    if not (len(frame_ids) == len(gt) == len(dt)):
        raise ValueError(f"{len(frame_ids)} frame ids, {len(gt)} GT frames and {len(dt)} detection frames")
    if not 0 <= background_iou <= loose_iou:
        raise ValueError(f"the IoU thresholds must satisfy 0 <= background_iou ({background_iou}) <= loose_iou "
                         f"({loose_iou})")
    lidar = bool(gt) and isinstance(gt[0], LidarLabels)
    level = level or ("overall" if lidar else "moderate")
    lv = level_of(level, lidar)
    G = Records.from_labels(as_metric_labels(gt), with_score=False)
    D = Records.from_labels(as_metric_labels(dt), with_score=True)
    g_dist, d_dist = G.distance(), D.distance()
    dims = {"gt": G.dimensions, "detection": D.dimensions}
    objects = np.flatnonzero(G.name != "DontCare")
    scored = D.score >= score_threshold
    errors: list[ErrorRecord] = []
    counts: dict[str, ClassCounts] = {}

    def record(side: str, R: Records, i: int, kind: str, iou: float, best: dict | None, dist: np.ndarray,
               taken_by: dict | None = None) -> ErrorRecord:
        f = int(R.frame[i])
        h, w, length = dims[side][i]
        return ErrorRecord(frame_ids[f], kind, side, str(R.name[i]), i - int(R.offsets[f]), float(dist[i]),
                           band_of(float(dist[i])), (float(length), float(w), float(h)),
                           None if side == "gt" else float(R.score[i]), float(iou), best, taken_by)

    def ref(R: Records, i: int) -> dict | None:
        if i < 0:
            return None
        f = int(R.frame[i])
        out = {"class": str(R.name[i]), "record": i - int(R.offsets[f])}
        if R.score is not None:
            out["score"] = float(R.score[i])
        return out

    for cls, ov in min_overlap.items():
        ov = float(ov)
        a = assign(G, D, cls, ov, lv, score_threshold)
        n = ClassCounts(kinds={k: {} for k in KINDS})
        counts[cls] = n
        state = np.full(len(D), -1)
        state[a.det] = a.det_state
        counted = a.gt[a.gt_counted]
        took = a.match[a.gt_counted]
        for g in counted:
            b = band_of(float(g_dist[g]))
            n.n_gt[b] = n.n_gt.get(b, 0) + 1
        found = np.zeros(took.size, bool)
        found[took >= 0] = state[took[took >= 0]] == 0  # took a counted detection: a TP
        for g in counted[found]:
            b = band_of(float(g_dist[g]))
            n.tp[b] = n.tp.get(b, 0) + 1
        # missed objects: counted GT that took nothing
        fn = counted[took < 0]
        cls_dets = np.flatnonzero((D.name == cls) & scored)
        best, arg = _best(G, fn, D, cls_dets, det_first=False)
        for g, iou, d in zip(fn, best, arg, strict=True):
            kind = "found_loose" if iou >= loose_iou and d >= 0 else "missed"
            errors.append(record("gt", G, int(g), kind, iou, ref(D, int(d)), g_dist))
        # false positives: counted detections scored >= threshold that no GT took, outside DontCare regions
        taken = np.zeros(len(D), bool)
        taken[a.match[a.match >= 0]] = True
        fp = a.det[(a.det_state == 0) & scored[a.det] & ~a.det_in_dontcare & ~taken[a.det]]
        fp = np.sort(fp)
        own = np.flatnonzero(np.isin(G.name, [cls, NEIGHBOUR.get(cls, cls)]))
        best, arg = _best(D, fp, G, own, det_first=True)
        any_best, any_arg = _best(D, fp, G, objects, det_first=True)
        match_of = dict(zip(a.gt.tolist(), a.match.tolist(), strict=True))
        for d, iou, g, iou_any, g_any in zip(fp, best, arg, any_best, any_arg, strict=True):
            taken_by = None
            if iou > ov:
                kind = "duplicate"
                took_d = match_of.get(int(g), -1)
                taken_by = ref(D, took_d)
                if taken_by is not None:
                    taken_by["iou"] = float(overlap_pairs("bev", D, np.array([took_d]), G, np.array([g]))[0])
            elif iou >= loose_iou:
                kind = "loose"
            elif iou >= background_iou:
                kind = "mislocated"
            else:
                kind = "other_class" if iou_any >= background_iou else "background"
                iou, g = iou_any, g_any
            errors.append(record("detection", D, int(d), kind, iou, ref(G, int(g)), d_dist, taken_by))
    for e in errors:
        per = counts[e.cls].kinds[e.kind]
        per[e.band] = per.get(e.band, 0) + 1
    errors.sort(key=lambda e: (e.cls, e.frame, e.side, e.record))
    return ErrorAnalysis(list(frame_ids), tuple(min_overlap), {c: float(v) for c, v in min_overlap.items()},
                         float(score_threshold), level, float(loose_iou), float(background_iou), errors, counts)


def worst(errors: Sequence[ErrorRecord], n: int) -> list[ErrorRecord]:
    """The ``n`` worst errors of one kind: false positives by score (highest first); missed objects by the points
    inside (most first) where counted, then by distance (nearest first)."""
    def key(e: ErrorRecord):
        if e.side == "detection":
            return (-(e.score or 0.0), e.distance)
        return (-(e.points if e.points is not None else 0), e.distance)

    return sorted(errors, key=key)[:n]
