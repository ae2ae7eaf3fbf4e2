"""The protocol's rules (detector/eval/protocol.py R1–R9), each on hand-built cases whose expected AP follows
from the rule as the devkit states it; and the fast evaluator against the independent oracle on
adversarial frames (boundary heights, borders, NO_DETECTION scores).

AP values used below, derived by hand from the 41-point rule (R8, R9):
- n GT all found with precision 1 (n >= 41): AP 100.
- 41 GT all found + one counted false positive scored above every TP: precision (i+1)/(i+2) at the i-th
  threshold, monotone → 41/42 at every point: AP 41/42 · 100.
- n TPs of n+1 counted GT (n = 40 or 41), precision 1: the recall steps k/40 each get the TP whose recall
  is closest, the last TP's recall n/(n+1) < 1 leaves step 40 empty: 40 thresholds, AP 39/40 · 100 = 97.5.
"""

from __future__ import annotations

import numpy as np
import pytest

from detector.data.kitti_labels import parse_label_lines
from detector.eval.kitti_metric import evaluate
from detector.eval.protocol import KITTI_LEVELS, NO_DETECTION, distance_levels
from detector.eval.reference import reference_curve
from detector.eval.synthetic import synthetic_set
from tests.eval.test_kitti_metric import ev, perfect, rec

FULL, TOP_FP, ONE_MISSED = 100.0, 41 / 42 * 100, 39 / 40 * 100
LEVELS = ("easy", "moderate", "hard")


def aps(r, metric="2d"):
    return [r.ap("Car", metric, lv) for lv in LEVELS]


def with_bottom(i, top, bottom, **kw):
    """Record i with a 2D box from ``top`` to ``bottom`` (its 3D place stays object i's)."""
    u = 60.0 * (i % 20)
    return rec("Car", i, bbox=(u, top, u + 50.0, bottom), **kw)


# --------------------------------------------------------------------------------------------------
# R3: a GT is counted only if its 2D height EXCEEDS the level's minimum (40 / 25 / 25 px)
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "height,num_gt,expected",
    [
        (40.00, [41, 42, 42], [FULL, ONE_MISSED, ONE_MISSED]),  # at the easy minimum: not easy
        (40.01, [42, 42, 42], [ONE_MISSED] * 3),
        (39.99, [41, 42, 42], [FULL, ONE_MISSED, ONE_MISSED]),
        (25.00, [41, 41, 41], [FULL] * 3),  # at the moderate/hard minimum: in no level
        (25.01, [41, 42, 42], [FULL, ONE_MISSED, ONE_MISSED]),
        (24.99, [41, 41, 41], [FULL] * 3),
    ],
)
def test_gt_height_at_just_above_and_just_below_each_minimum(height, num_gt, expected):
    """41 tall GT found + one undetected GT of the given height: counted, it is a miss (97.5); at or below
    the minimum it is ignored (100)."""
    gt, dt = perfect(41)
    r = ev(gt + [with_bottom(60, 100.0, 100.0 + height)], dt)
    assert r.num_gt[0].tolist() == num_gt
    assert aps(r) == pytest.approx(expected, abs=1e-9)


# --------------------------------------------------------------------------------------------------
# R4: a detection is ignored only if its 2D height is strictly BELOW the minimum
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "height,expected",
    [
        (40.00, [TOP_FP] * 3),  # at the minimum: counted, a false positive everywhere
        (40.01, [TOP_FP] * 3),
        (39.99, [FULL, TOP_FP, TOP_FP]),  # below easy's 40: ignored there
        (25.00, [FULL, TOP_FP, TOP_FP]),
        (24.99, [FULL] * 3),  # below 25: ignored in every level
    ],
)
def test_detection_height_at_just_above_and_just_below_each_minimum(height, expected):
    """41 GT found + one false positive of the given height scored above them all."""
    gt, dt = perfect(41)
    fp = dict(with_bottom(70, 100.0, 100.0 + height), score=0.99)
    assert aps(ev(gt, dt + [fp])) == pytest.approx(expected, abs=1e-9)
    # A negative height (top below bottom) counts by its absolute value, as the devkit's fabs.
    flipped = dict(with_bottom(70, 100.0 + height, 100.0), score=0.99)
    assert aps(ev(gt, dt + [flipped])) == pytest.approx(expected, abs=1e-9)


# --------------------------------------------------------------------------------------------------
# R1: values as read from the files, float64
# --------------------------------------------------------------------------------------------------
def label_line(name, top, bottom, *, i=0, trunc="0.00", occ="0", score=None):
    """A KITTI line for object i (2D box in its own 60 px column, 3D box on its own 8 m spot; the metric
    does not clip boxes to an image)."""
    u = 60 * i
    x, z = 8.0 * (i % 10) - 40.0, 10.0 + 8.0 * (i // 10)
    line = f"{name} {trunc} {occ} 0.0 {u} {top} {u + 50} {bottom} 1.5 1.6 4.0 {x} 1.6 {z} 0.0"
    return line + ("" if score is None else f" {score}")


def frames_from_text(gt_lines, dt_lines):
    return parse_label_lines(gt_lines, "gt.txt", False), parse_label_lines(dt_lines, "dt.txt", True)


def _base(n=41, score="0.9"):
    gt = [label_line("Car", "100", "150", i=i) for i in range(n)]
    return gt, [label_line("Car", "100", "150", i=i, score=score) for i in range(n)]


def test_heights_read_from_files_are_float64():
    """A GT 40 + 1e-7 px tall is easy and a detection 40 − 1e-7 px tall is ignored at easy (float32 would
    round both to 40.0 and decide the other way)."""
    gt, dt = _base()
    tall = label_line("Car", "100", "140.0000001", i=60)
    G, D = frames_from_text(gt + [tall], dt)
    assert evaluate([G], [D]).num_gt[0].tolist() == [42, 42, 42]
    low_fp = label_line("Car", "100", "139.9999999", i=70, score="0.99")
    G, D = frames_from_text(gt, dt + [low_fp])
    assert aps(evaluate([G], [D])) == pytest.approx([FULL, TOP_FP, TOP_FP], abs=1e-9)


def test_scores_1e9_apart_stay_distinct():
    """41 TPs all scored 0.5 and 41 false positives scored 0.499999999: every threshold is 0.5, so no
    false positive reaches one (AP 100). Scored exactly 0.5 (what float32 makes of both), they would all
    count: precision 1/2 (AP 50)."""
    gt, dt = _base(score="0.5")
    fps = [label_line("Car", "100", "150", i=100 + k, score="0.499999999") for k in range(41)]
    G, D = frames_from_text(gt, dt + fps)
    assert aps(evaluate([G], [D])) == pytest.approx([FULL] * 3, abs=1e-9)
    ties = [s.replace("0.499999999", "0.5") for s in fps]
    G, D = frames_from_text(gt, dt + ties)
    assert aps(evaluate([G], [D])) == pytest.approx([50.0] * 3, abs=1e-9)


# --------------------------------------------------------------------------------------------------
# R5: NO_DETECTION
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "score,expected",
    [
        ("-10000000", ONE_MISSED),  # exactly NO_DETECTION: never assigned, its GT is a miss
        ("-1e7", ONE_MISSED),
        ("-10000000.5", ONE_MISSED),
        ("-1e300", ONE_MISSED),
        ("-9999999.999", FULL),  # just above: an ordinary (very low) score, a TP
        ("-5", FULL),
    ],
)
def test_no_detection_scores_are_never_assigned(score, expected):
    """40 GT found with positive scores; the 41st found only by a detection with the given score."""
    gt, dt = _base()
    dt[40] = dt[40].rsplit(" ", 1)[0] + f" {score}"
    G, D = frames_from_text(gt, dt)
    assert float(D.score[40]) <= NO_DETECTION or expected == FULL
    assert aps(evaluate([G], [D])) == pytest.approx([expected] * 3, abs=1e-9)


def test_no_detection_scores_are_not_false_positives_nor_absorb_ignored_gt():
    """A NO_DETECTION detection on an ignored GT (a Van) and one on nothing: no effect at all."""
    gt, dt = _base()
    van = label_line("Van", "100", "150", i=80)
    on_van = label_line("Car", "100", "150", i=80, score="-1e7")
    on_nothing = label_line("Car", "100", "150", i=90, score="-2e7")
    G, D = frames_from_text(gt + [van], dt + [on_van, on_nothing])
    assert aps(evaluate([G], [D])) == pytest.approx([FULL] * 3, abs=1e-9)


# --------------------------------------------------------------------------------------------------
# R3: occlusion and truncation exactly at each border (inclusive)
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "trunc,occ,levels",
    [
        ("0.15", "0", [1, 1, 1]),
        ("0.1500001", "0", [0, 1, 1]),
        ("0.00", "1", [0, 1, 1]),
        ("0.30", "1", [0, 1, 1]),
        ("0.3000001", "1", [0, 0, 1]),
        ("0.30", "2", [0, 0, 1]),
        ("0.50", "2", [0, 0, 1]),
        ("0.5000001", "2", [0, 0, 0]),
        ("0.00", "3", [0, 0, 0]),
    ],
)
def test_occlusion_and_truncation_at_each_border(trunc, occ, levels):
    """One extra undetected GT: counted in a level iff occlusion ≤ 0/1/2 and truncation ≤ 0.15/0.30/0.50."""
    gt, dt = _base()
    G, D = frames_from_text(gt + [label_line("Car", "100", "150", i=60, trunc=trunc, occ=occ)], dt)
    r = evaluate([G], [D])
    assert (r.num_gt[0] - 41).tolist() == levels
    assert aps(r) == pytest.approx([ONE_MISSED if c else FULL for c in levels], abs=1e-9)


# --------------------------------------------------------------------------------------------------
# The fast evaluator equals the independent oracle on adversarial frames
# --------------------------------------------------------------------------------------------------
def _adversarial(seed: int):
    """Crowded synthetic frames with 2D heights put exactly on the minimums, occlusion/truncation on the
    borders and NO_DETECTION scores sprinkled in."""
    gt, dt = synthetic_set(6, dets_per_frame=25, seed=seed, crowded=True)
    rng = np.random.default_rng(seed)
    for g in gt:
        care = g.name != "DontCare"
        pick = care & (rng.random(len(g)) < 0.4)
        g.bbox[pick, 3] = g.bbox[pick, 1] + rng.choice([25.0, 40.0, 24.99, 39.99, 40.01], pick.sum())
        border = care & (rng.random(len(g)) < 0.3)
        g.truncated[border] = rng.choice([0.15, 0.3, 0.5], border.sum())
    for d in dt:
        pick = rng.random(len(d)) < 0.3
        d.bbox[pick, 3] = d.bbox[pick, 1] + rng.choice([25.0, 40.0, 24.99, 39.99], pick.sum())
        sentinel = rng.random(len(d)) < 0.15
        d.score[sentinel] = rng.choice([NO_DETECTION, NO_DETECTION - 1, NO_DETECTION + 1], sentinel.sum())
    return gt, dt


@pytest.mark.parametrize("seed", [3, 4])
def test_fast_evaluator_equals_the_oracle_on_adversarial_frames(seed):
    gt, dt = _adversarial(seed)
    r = evaluate(gt, dt)
    levels = KITTI_LEVELS + distance_levels()
    for c, cls in enumerate(("Car", "Pedestrian", "Cyclist")):
        for m, metric in enumerate(("2d", "bev", "3d")):
            for li in (0, 1, 2, 3):
                ref = reference_curve(gt, dt, cls, levels[li], metric)
                fast = r.curves[c, m, li] if li < 3 else r.distance_curves[c, m, li - 3]
                n_gt = r.num_gt[c, li] if li < 3 else r.distance_num_gt[c, li - 3]
                assert n_gt == ref.n_gt, (cls, metric, li)
                np.testing.assert_array_equal(fast, ref.precision, err_msg=f"{cls} {metric} {levels[li].name}")
