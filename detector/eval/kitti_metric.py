"""KITTI evaluation: AP (R40 and R11) for 2D / BEV / 3D boxes and AOS, easy / moderate / hard, plus AP
by distance range. Pure NumPy on the CPU.

    result = evaluate(gt_frames, det_frames)          # Sequence[KittiLabels] each, one per frame
    result.ap("Car", "3d", "moderate")                  # R40, in percent
    result.to_json()                                    # {"Car": {"2d": {"R40": {"easy": ..}, ..}, ..}, ..}
    print(result.table())

The protocol (and the one place where we extend it, AP by distance) is described in
:mod:`detector.eval.protocol`; :mod:`detector.eval.reference` is an independent literal frame-by-frame
form (the test oracle), and :mod:`detector.eval.matching` the vectorized form used here.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from detector.data.kitti_labels import KittiLabels
from detector.eval.matching import LevelCounts, assign_at, build_graph, match_level
from detector.eval.overlap import (
    Records,
    aabb_intersection,
    bev_intersection_records,
    overlap_from_intersection,
)
from detector.eval.protocol import (
    DISTANCE_RANGES,
    EVAL_CLASSES,
    KITTI_LEVELS,
    METRICS,
    MIN_OVERLAP,
    N_SAMPLE_PTS,
    NEIGHBOUR,
    NO_DETECTION,
    Level,
    ap_r11,
    ap_r40,
    distance_levels,
    monotone,
)
from detector.geometry.iou import box2d_overlap_paired

POINTS = ("R40", "R11")


@dataclass
class EvalTimings:
    """Wall-clock seconds of evaluate()'s phases (filled when passed in)."""

    prepare_s: float = 0.0  # flattening, validation, candidate pairs
    overlap_s: float = 0.0  # 2D / BEV / 3D overlaps (IoU and DontCare)
    matching_s: float = 0.0  # graphs, both passes, curves
    total_s: float = 0.0


@dataclass
class KittiResult:
    """Monotone 41-point curves and the AP derived from them.

    ``curves`` [C, M, L, 41]: for metrics "2d", "bev", "3d" the precision, for "aos" the orientation
    similarity, at the KITTI levels ``levels``; ``num_gt`` [C, L] counted GT. ``distance_curves``
    [C, M, R, 41] / ``distance_num_gt`` [C, R] the same for the distance ranges ``distance_levels`` (R may
    be 0). ``min_overlap`` per class. ``counts``: the matching's counts at its score thresholds (the points the
    curves come from: precision-recall curves) per (class, matched metric "2d" / "bev" / "3d", level or range).
    """

    classes: tuple[str, ...]
    metrics: tuple[str, ...]
    levels: tuple[str, ...]
    curves: np.ndarray
    num_gt: np.ndarray
    min_overlap: tuple[float, ...]
    distance_levels: tuple[str, ...] = ()
    distance_curves: np.ndarray = field(default_factory=lambda: np.zeros((0, 0, 0, N_SAMPLE_PTS)))
    distance_num_gt: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))
    counts: dict[tuple[str, str, str], LevelCounts] = field(default_factory=dict)

    def _index(self, cls: str, metric: str) -> tuple[int, int]:
        if cls not in self.classes:
            raise KeyError(f"class {cls!r} was not evaluated (evaluated: {', '.join(self.classes)})")
        if metric not in self.metrics:
            raise KeyError(f"metric {metric!r} was not evaluated (evaluated: {', '.join(self.metrics)})")
        return self.classes.index(cls), self.metrics.index(metric)

    def ap(self, cls: str, metric: str, level: str, points: str = "R40") -> float:
        """AP in percent. ``level``: a KITTI level or a distance range name (e.g. "30-50")."""
        c, m = self._index(cls, metric)
        if level in self.levels:
            curve = self.curves[c, m, self.levels.index(level)]
        elif level in self.distance_levels:
            curve = self.distance_curves[c, m, self.distance_levels.index(level)]
        else:
            raise KeyError(f"level {level!r} unknown (have: {', '.join(self.levels + self.distance_levels)})")
        if points == "R40":
            return ap_r40(curve)
        if points == "R11":
            return ap_r11(curve)
        raise ValueError(f"points must be 'R40' or 'R11', got {points!r}")

    def to_json(self) -> dict:
        """``{cls: {metric: {"R40": {level: AP}, "R11": {...}}}}`` in percent; with distance ranges, also
        ``"distance": {cls: {metric: {"R40": {range: AP}, "R11": {...}}}}``."""
        out: dict = {
            c: {
                m: {p: {lv: self.ap(c, m, lv, p) for lv in self.levels} for p in POINTS} for m in self.metrics
            }
            for c in self.classes
        }
        if self.distance_levels:
            out["distance"] = {
                c: {
                    m: {p: {r: self.ap(c, m, r, p) for r in self.distance_levels} for p in POINTS}
                    for m in self.metrics
                }
                for c in self.classes
            }
        return out

    def table(self) -> str:
        """The familiar text table (per class and sampling: one line per metric, easy / moderate / hard)."""
        label = {"2d": "bbox", "bev": "bev ", "3d": "3d  ", "aos": "aos "}
        lines = []
        for c, cls in enumerate(self.classes):
            ov = self.min_overlap[c]
            for p in POINTS:
                lines.append(f"{cls} AP_{p}@{ov:.2f}, {ov:.2f}, {ov:.2f}:")
                for m in self.metrics:
                    vals = ", ".join(f"{self.ap(cls, m, lv, p):.4f}" for lv in self.levels)
                    lines.append(f"{label.get(m, m)} AP:{vals}")
            lines.append(
                "  num GT (" + ", ".join(self.levels) + "): " + ", ".join(str(int(n)) for n in self.num_gt[c])
            )
        if self.distance_levels:
            lines.append("")
            lines.append("AP_R40 by distance (m; hard-level occlusion/truncation, no minimum 2D height):")
            head = f"{'':<12}{'':<6}" + "".join(f"{r:>10}" for r in self.distance_levels)
            lines.append(head)
            for c, cls in enumerate(self.classes):
                for m in self.metrics:
                    vals = "".join(f"{self.ap(cls, m, r):>10.2f}" for r in self.distance_levels)
                    lines.append(f"{cls:<12}{m:<6}{vals}")
                lines.append(
                    f"{'':<12}{'#GT':<6}" + "".join(f"{int(n):>10d}" for n in self.distance_num_gt[c])
                )
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Input checks
# --------------------------------------------------------------------------------------------------
_FIELDS = (
    ("truncated", ()),
    ("occluded", ()),
    ("alpha", ()),
    ("bbox", (4,)),
    ("dimensions", (3,)),
    ("location", (3,)),
    ("rotation_y", ()),
)


def _check_shapes(frames: Sequence[KittiLabels], what: str, with_score: bool) -> None:
    """Types and array shapes of every frame (values are checked on the flat records)."""
    fields = _FIELDS + ((("score", ()),) if with_score else ())
    for f, lab in enumerate(frames):
        if not isinstance(lab, KittiLabels):
            raise TypeError(f"{what}[{f}]: expected KittiLabels, got {type(lab).__name__}")
        n = len(lab.name)
        if with_score and lab.score is None:
            raise ValueError(f"{what}[{f}]: detections need scores (KittiLabels.score is None)")
        for name, tail in fields:
            shape = np.shape(getattr(lab, name))
            if shape != (n, *tail):
                raise ValueError(
                    f"{what}[{f}]: {name} has shape {shape}, expected {(n, *tail)} for {n} records"
                )


def _check_values(R: Records, what: str) -> None:
    """Finite values everywhere; non-negative sizes except for DontCare records."""
    arrays = [R.truncated, R.alpha, R.bbox, R.dimensions, R.location, R.rotation_y]
    if R.score is not None:
        arrays.append(R.score)
    ok = np.ones(len(R), bool)
    for a in arrays:
        ok &= np.isfinite(a if a.ndim == 2 else a[:, None]).all(axis=1)
    if not ok.all():
        _fail(R, what, int(np.flatnonzero(~ok)[0]), "NaN or infinite value")
    bad = (R.dimensions < 0).any(axis=1) & (R.name != "DontCare")
    if bad.any():
        _fail(R, what, int(np.flatnonzero(bad)[0]), "negative size (h, w, l)")


def _fail(R: Records, what: str, i: int, problem: str) -> None:
    f = int(R.frame[i])
    rec = i - int(R.offsets[f])
    score = "" if R.score is None else f", score {R.score[i]}"
    raise ValueError(
        f"{what}[{f}] record {rec} ({R.name[i]}): {problem} (bbox {R.bbox[i].tolist()}, dimensions "
        f"{R.dimensions[i].tolist()}, location {R.location[i].tolist()}{score})"
    )


# --------------------------------------------------------------------------------------------------
# Candidate pairs
# --------------------------------------------------------------------------------------------------
def _frame_pairs(frame_a: np.ndarray, frame_b: np.ndarray, num_frames: int) -> tuple[np.ndarray, np.ndarray]:
    """All pairs (i, j) of positions in two frame-sorted lists with frame_a[i] == frame_b[j], ordered by
    i then j."""
    cb = np.bincount(frame_b, minlength=num_frames)
    start_b = np.concatenate([[0], np.cumsum(cb)[:-1]])
    reps = cb[frame_a]
    total = int(reps.sum())
    ia = np.repeat(np.arange(frame_a.size), reps)
    first = np.repeat(np.cumsum(reps) - reps, reps)
    jb = np.repeat(start_b[frame_a], reps) + (np.arange(total) - first)
    return ia, jb


@dataclass
class _ClassData:
    """The class's candidates: GT of the class or its neighbour class, detections of the class or lower
    than some level's minimum height, DontCare records; positions refer to the global Records."""

    gt: np.ndarray  # global GT indices
    det: np.ndarray  # global detection indices
    gt_is_class: np.ndarray  # bool per candidate GT (False: neighbour class)
    det_is_class: np.ndarray  # bool per candidate detection
    pair_gt: np.ndarray  # positions in ``gt``
    pair_det: np.ndarray  # positions in ``det``
    dc_pairs: tuple[np.ndarray, np.ndarray]  # (positions in ``det`` of class detections, global DontCare idx)


def _class_data(
    cls: str, G: Records, D: Records, max_min_height: float, det_height: np.ndarray
) -> _ClassData:
    neighbour = NEIGHBOUR.get(cls)
    is_cls = G.name == cls
    gt = np.flatnonzero(is_cls | (G.name == neighbour)) if neighbour else np.flatnonzero(is_cls)
    d_cls = D.name == cls
    # R5: a detection scored at or below NO_DETECTION takes no part at any level.
    det = np.flatnonzero((d_cls | (det_height < max_min_height)) & (D.score > NO_DETECTION))
    pg, pd = _frame_pairs(G.frame[gt], D.frame[det], G.num_frames)
    dc = np.flatnonzero(G.name == "DontCare")
    cls_pos = np.flatnonzero(d_cls[det])
    a, b = _frame_pairs(D.frame[det[cls_pos]], G.frame[dc], G.num_frames)
    return _ClassData(gt, det, is_cls[gt], d_cls[det], pg, pd, (cls_pos[a], dc[b]))


# --------------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------------
def evaluate(
    gt: Sequence[KittiLabels],
    dt: Sequence[KittiLabels],
    classes: Sequence[str] = EVAL_CLASSES,
    metrics: Sequence[str] = METRICS,
    distance_ranges: Sequence[tuple[float, float]] | None = DISTANCE_RANGES,
    min_overlap: Mapping[str, float] | None = None,
    timings: EvalTimings | None = None,
    levels: Sequence[Level] = KITTI_LEVELS,
) -> KittiResult:
    """Evaluate detections ``dt`` against ground truth ``gt`` (one KittiLabels per frame, same order;
    detections need scores). Frames without objects or detections are empty KittiLabels.

    ``metrics`` ⊆ ("2d", "bev", "3d", "aos"); ``distance_ranges`` in metres (None: no AP by distance);
    ``min_overlap`` overrides the per-class minimum overlap (default Car 0.7, Pedestrian/Cyclist 0.5);
    ``levels``: KITTI's easy / moderate / hard, or e.g. :data:`~detector.eval.protocol.OVERALL` (LiDAR-only).
    Does not print. Raises ValueError / TypeError naming the frame and field on bad input.
    """
    t0 = time.perf_counter()
    classes = tuple(classes)
    metrics = tuple(metrics)
    overlaps = {**MIN_OVERLAP, **(dict(min_overlap) if min_overlap else {})}
    for m in metrics:
        if m not in METRICS:
            raise ValueError(f"unknown metric {m!r} (expected a subset of {METRICS})")
    for c in classes:
        if c not in overlaps:
            raise ValueError(
                f"class {c!r} has no minimum overlap (known: {', '.join(overlaps)}); pass min_overlap"
            )
        if not 0 <= overlaps[c] < 1:
            raise ValueError(f"min_overlap[{c!r}] must be in [0, 1), got {overlaps[c]}")
    if len(gt) != len(dt):
        raise ValueError(
            f"got {len(gt)} ground-truth frames but {len(dt)} detection frames; they must pair up"
        )
    if len(gt) == 0:
        raise ValueError("no frames to evaluate")
    _check_shapes(gt, "gt", with_score=False)
    _check_shapes(dt, "dt", with_score=True)
    levels = tuple(levels)
    dlevels = distance_levels(distance_ranges) if distance_ranges else ()
    all_levels = levels + dlevels
    max_min_height = max(lv.min_height for lv in all_levels)

    G = Records.from_labels(gt, with_score=False)
    D = Records.from_labels(dt, with_score=True)
    _check_values(G, "gt")
    _check_values(D, "dt")
    g_height, g_dist = G.height(), G.distance()
    d_height, d_dist = np.abs(D.height()), D.distance()
    match_metrics = tuple(m for m in ("2d", "bev", "3d") if m in metrics or (m == "2d" and "aos" in metrics))

    C, M = len(classes), len(metrics)
    curves = np.zeros((C, M, len(levels), N_SAMPLE_PTS))
    num_gt = np.zeros((C, len(levels)), np.int64)
    dcurves = np.zeros((C, M, len(dlevels), N_SAMPLE_PTS))
    dnum_gt = np.zeros((C, len(dlevels)), np.int64)
    t_overlap = t_match = 0.0
    t_prep = time.perf_counter() - t0
    level_counts: dict[tuple[str, str, str], LevelCounts] = {}

    for c, cls in enumerate(classes):
        ts = time.perf_counter()
        cd = _class_data(cls, G, D, max_min_height, d_height)
        t_prep += time.perf_counter() - ts

        ts = time.perf_counter()
        edges = _edges(cd, G, D, match_metrics, overlaps[cls])
        t_overlap += time.perf_counter() - ts

        ts = time.perf_counter()
        g_alpha, d_alpha, d_score = G.alpha[cd.gt], D.alpha[cd.det], D.score[cd.det]
        states = [_states(lv, cd, G, g_height, g_dist, d_height, d_dist) for lv in all_levels]
        for mm in match_metrics:
            e = edges[mm]
            graph = build_graph(
                cd.pair_gt[e.pairs], cd.pair_det[e.pairs], e.overlap, overlaps[cls], cd.gt.size, cd.det.size
            )
            for li, (gs, ds) in enumerate(states):
                counts = match_level(graph, gs, ds, d_score, e.in_dontcare, g_alpha, d_alpha)
                level_counts[(cls, mm, all_levels[li].name)] = counts
                _store(counts, mm, metrics, c, li, len(levels), curves, num_gt, dcurves, dnum_gt)
        t_match += time.perf_counter() - ts

    if timings is not None:
        timings.prepare_s = t_prep
        timings.overlap_s = t_overlap
        timings.matching_s = t_match
        timings.total_s = time.perf_counter() - t0
    return KittiResult(
        classes,
        metrics,
        tuple(lv.name for lv in levels),
        curves,
        num_gt,
        tuple(overlaps[c] for c in classes),
        tuple(lv.name for lv in dlevels),
        dcurves,
        dnum_gt,
        level_counts,
    )


@dataclass
class Assignment:
    """The metric's matching of one class at one level and one score threshold, record by record: what
    :func:`evaluate` counts at that threshold. Indices are positions in the flat :class:`Records` of the frames.

    ``gt``: the class's GT candidates (the class and its neighbour class, R2), ``gt_counted`` those counted at the
    level (the others ignored); ``det``: its detection candidates, ``det_state`` 0 counted, 1 ignored (R4), -1 not a
    candidate at this level; ``det_in_dontcare`` (R7); ``match`` per GT candidate the detection it took (-1: none).
    A counted GT that took a counted detection is a TP, one that took none a FN; a counted detection scored at least
    the threshold that no GT took and outside DontCare regions is a FP."""

    gt: np.ndarray
    gt_counted: np.ndarray
    det: np.ndarray
    det_state: np.ndarray
    det_in_dontcare: np.ndarray
    match: np.ndarray


def assign(G: Records, D: Records, cls: str, min_overlap: float, level: Level, threshold: float,
           metric: str = "bev") -> Assignment:
    """:func:`evaluate`'s matching of class ``cls`` in ``metric`` ("2d", "bev" or "3d") at ``level`` and one score
    ``threshold`` (its second pass, R8), record by record (see :class:`Assignment`)."""
    d_height = np.abs(D.height())
    cd = _class_data(cls, G, D, level.min_height, d_height)
    e = _edges(cd, G, D, (metric,), min_overlap)[metric]
    graph = build_graph(cd.pair_gt[e.pairs], cd.pair_det[e.pairs], e.overlap, min_overlap, cd.gt.size, cd.det.size)
    gs, ds = _states(level, cd, G, G.height(), G.distance(), d_height, D.distance())
    pos = assign_at(graph, gs, ds, D.score[cd.det], threshold)
    match = np.where(pos >= 0, cd.det[np.maximum(pos, 0)], -1) if cd.det.size else np.full(cd.gt.size, -1)
    return Assignment(cd.gt, gs == 0, cd.det, ds, e.in_dontcare, match)


@dataclass
class _Edges:
    """One metric's overlaps for one class: ``pairs`` (positions in the class's candidate pair list) whose
    overlap exceeds the minimum, their ``overlap``, and ``in_dontcare`` per detection candidate."""

    pairs: np.ndarray
    overlap: np.ndarray
    in_dontcare: np.ndarray


def _edges(
    cd: _ClassData, G: Records, D: Records, metrics: Sequence[str], min_ov: float
) -> dict[str, _Edges]:
    """Overlaps of the class's candidate pairs and its detections' DontCare tests, per matching metric."""
    gi, di = cd.gt[cd.pair_gt], cd.det[cd.pair_det]
    dpos, dcg = cd.dc_pairs  # (positions in cd.det, global DontCare index)
    out = {}
    if "2d" in metrics:
        ov = box2d_overlap_paired(D.bbox[di], G.bbox[gi])
        hit = np.flatnonzero(ov > min_ov)
        dc_ov = box2d_overlap_paired(D.bbox[cd.det[dpos]], G.bbox[dcg], "a")
        out["2d"] = _Edges(hit, ov[hit], _any_at(dpos[dc_ov > min_ov], cd.det.size))
    geo = [m for m in ("bev", "3d") if m in metrics]
    if not geo:
        return out
    # Exact clipping only for pairs whose cheap upper bound (axis-aligned bounds) can exceed the minimum
    # overlap; the slack keeps rounding in the bound from dropping a pair at the boundary.
    floor = min_ov - 1e-9
    bound = aabb_intersection(D, di, G, gi)
    sub = np.flatnonzero(bound > 0)
    keep = np.zeros(sub.size, bool)
    for m in geo:
        keep |= overlap_from_intersection(m, D, di[sub], G, gi[sub], bound[sub]) > floor
    near = sub[keep]
    inter = bev_intersection_records(D, di[near], G, gi[near])
    dc_det = cd.det[dpos]
    bound = aabb_intersection(D, dc_det, G, dcg)
    keep = np.zeros(dpos.size, bool)
    for m in geo:
        keep |= overlap_from_intersection(m, D, dc_det, G, dcg, bound, "a") > floor
    dc_near = np.flatnonzero(keep)
    dc_inter = bev_intersection_records(D, dc_det[dc_near], G, dcg[dc_near])
    for m in geo:
        ov = overlap_from_intersection(m, D, di[near], G, gi[near], inter)
        hit = ov > min_ov
        dc_ov = overlap_from_intersection(m, D, dc_det[dc_near], G, dcg[dc_near], dc_inter, "a")
        out[m] = _Edges(near[hit], ov[hit], _any_at(dpos[dc_near[dc_ov > min_ov]], cd.det.size))
    return out


def _any_at(pos: np.ndarray, n: np.ndarray | int) -> np.ndarray:
    out = np.zeros(int(n), bool)
    out[pos] = True
    return out


def _states(
    lv: Level, cd: _ClassData, G: Records, g_height, g_dist, d_height, d_dist
) -> tuple[np.ndarray, np.ndarray]:
    """(GT state, detection state) of the class's candidates at one level: 0 counted, 1 ignored, -1 (for
    detections) not a candidate."""
    g = cd.gt
    inside = lv.gt_counted(g_height[g], G.occluded[g], G.truncated[g])
    if lv.has_range:
        inside &= (g_dist[g] >= lv.min_distance) & (g_dist[g] < lv.max_distance)
    gs = np.where(cd.gt_is_class & inside, 0, 1)
    d = cd.det
    low = lv.det_ignored(d_height[d])
    ds = np.where(low, 1, np.where(cd.det_is_class, 0, -1))
    if lv.has_range:
        out_of_range = (d_dist[d] < lv.min_distance) | (d_dist[d] >= lv.max_distance)
        ds = np.where(cd.det_is_class & ~low & out_of_range, 1, ds)
    return gs, ds


def _store(counts: LevelCounts, mm: str, metrics, c, li, n_levels, curves, num_gt, dcurves, dnum_gt) -> None:
    prec, aos = counts.curves()
    T = counts.thresholds.size
    targets = [(mm, monotone(prec, T))] if mm in metrics else []
    if mm == "2d" and "aos" in metrics:
        targets.append(("aos", monotone(aos, T)))
    for name, curve in targets:
        m = metrics.index(name)
        if li < n_levels:
            curves[c, m, li] = curve
            num_gt[c, li] = counts.n_gt
        else:
            dcurves[c, m, li - n_levels] = curve
            dnum_gt[c, li - n_levels] = counts.n_gt
