"""The KITTI protocol: hand-built cases with known answers, and equality with the literal reference."""

from __future__ import annotations

import math

import numpy as np
import pytest

from detector.data.kitti_labels import KittiLabels
from detector.eval.kitti_metric import EvalTimings, evaluate
from detector.eval.protocol import KITTI_LEVELS, N_SAMPLE_PTS, distance_levels, score_thresholds
from detector.eval.reference import _thresholds as thresholds_literal  # the rule as a plain loop
from detector.eval.reference import reference_curve
from detector.eval.synthetic import synthetic_set


# --------------------------------------------------------------------------------------------------
# Building frames by hand
# --------------------------------------------------------------------------------------------------
def rec(
    name="Car",
    i=0,
    *,
    bbox=None,
    loc=None,
    dims=(1.5, 1.6, 4.0),
    ry=0.0,
    alpha=None,
    trunc=0.0,
    occ=0,
    score=None,
    height=50.0,
):
    """One record. Object i gets its own 2D box (60 px grid) and 3D place (8 m grid), so different i never
    overlap; ``height`` sets the 2D box height."""
    if bbox is None:
        u, v = 60.0 * (i % 20), 60.0 * (i // 20)
        bbox = (u, v, u + 50.0, v + height)
    if loc is None:
        loc = (8.0 * (i % 10) - 40.0, 1.6, 10.0 + 8.0 * (i // 10))
    if alpha is None:
        alpha = ry - math.atan2(loc[0], loc[2])
    return dict(
        name=name, bbox=bbox, loc=loc, dims=dims, ry=ry, alpha=alpha, trunc=trunc, occ=occ, score=score
    )


def frame(records, with_score=None) -> KittiLabels:
    with_score = any(r["score"] is not None for r in records) if with_score is None else with_score
    if not records:
        return KittiLabels.empty(with_score=with_score)
    f64 = lambda key, w=None: np.asarray([r[key] for r in records], np.float64).reshape(  # noqa: E731
        (-1,) if w is None else (-1, w)
    )
    return KittiLabels(
        np.asarray([r["name"] for r in records], "<U16"),
        f64("trunc"),
        f64("occ"),
        f64("alpha"),
        f64("bbox", 4),
        f64("dims", 3),
        f64("loc", 3),
        f64("ry"),
        f64("score") if with_score else None,
    )


def perfect(n, name="Car", **kw):
    gt = [rec(name, i, **kw) for i in range(n)]
    dt = [dict(r, score=0.9 - 0.001 * i) for i, r in enumerate(gt)]
    return gt, dt


def ev(gt_records, dt_records, **kw):
    return evaluate([frame(gt_records, False)], [frame(dt_records, True)], **kw)


LEVELS = ("easy", "moderate", "hard")
ALL = ("2d", "bev", "3d", "aos")


# --------------------------------------------------------------------------------------------------
# Known answers
# --------------------------------------------------------------------------------------------------
def test_perfect_detections_score_100_everywhere():
    gt, dt = perfect(50)
    r = ev(gt, dt)
    for m in ALL:
        for lv in LEVELS:
            assert r.ap("Car", m, lv, "R40") == pytest.approx(100.0, abs=1e-9)
            assert r.ap("Car", m, lv, "R11") == pytest.approx(100.0, abs=1e-9)
    assert r.num_gt[0].tolist() == [50, 50, 50]
    assert r.ap("Pedestrian", "3d", "moderate") == 0.0  # no GT, no detections
    assert r.num_gt[1].tolist() == [0, 0, 0]


@pytest.mark.parametrize(
    "n,r40,r11",
    [
        (1, 0.0, 100 / 11),
        (20, 19 / 40 * 100, 5 / 11 * 100),
        (40, 39 / 40 * 100, 10 / 11 * 100),
        (41, 100.0, 100.0),
        (100, 100.0, 100.0),
    ],
)
def test_the_41_point_rule(n, r40, r11):
    """With n < 41 perfect detections only n of the 41 recall points get a threshold; the rest are 0."""
    gt, dt = perfect(n)
    r = ev(gt, dt)
    for m in ("2d", "bev", "3d"):
        assert r.ap("Car", m, "moderate", "R40") == pytest.approx(r40, abs=1e-9)
        assert r.ap("Car", m, "moderate", "R11") == pytest.approx(r11, abs=1e-9)


def test_no_detections_score_zero():
    gt, _ = perfect(50)
    r = ev(gt, [])
    assert all(r.ap("Car", m, lv, p) == 0.0 for m in ALL for lv in LEVELS for p in ("R40", "R11"))
    assert r.num_gt[0, 1] == 50


def _shifted(n, iou, name="Car", dims=(1.5, 1.6, 4.0)):
    """GT and detections shifted along the box length so that the BEV and 3D IoU equal ``iou``
    ((l - d) / (l + d)), and the 2D box shifted sideways with the same 2D IoU."""
    gt = [rec(name, i, dims=dims) for i in range(n)]
    l = dims[2]
    d = l * (1 - iou) / (1 + iou)
    s = 50.0 * (1 - iou) / (1 + iou)
    dt = []
    for g in gt:
        x, y, z = g["loc"]
        b = g["bbox"]
        dt.append(dict(g, loc=(x + d, y, z), bbox=(b[0] + s, b[1], b[2] + s, b[3]), score=0.5))
    return gt, dt


@pytest.mark.parametrize("name,thr", [("Car", 0.7), ("Pedestrian", 0.5), ("Cyclist", 0.5)])
def test_overlap_just_below_and_just_above_the_minimum(name, thr):
    dims = {"Car": (1.5, 1.6, 4.0), "Pedestrian": (1.7, 0.6, 0.8), "Cyclist": (1.7, 0.6, 1.8)}[name]
    above = ev(*_shifted(50, thr + 0.01, name, dims))
    below = ev(*_shifted(50, thr - 0.01, name, dims))
    for m in ("2d", "bev", "3d"):
        assert above.ap(name, m, "moderate") == pytest.approx(100.0)
        assert below.ap(name, m, "moderate") == 0.0


def test_overlap_must_exceed_the_minimum_strictly():
    """2D IoU exactly 0.7 (inter 7000 / union 10000) is not a match; a hair more is."""
    gt = [rec("Car", i, bbox=(0.0, 100.0 * i, 100.0, 100.0 * i + 100.0)) for i in range(50)]
    exact = [dict(g, bbox=(0.0, g["bbox"][1], 70.0, g["bbox"][3]), score=0.5) for g in gt]
    more = [dict(g, bbox=(0.0, g["bbox"][1], 70.5, g["bbox"][3]), score=0.5) for g in gt]
    assert ev(gt, exact).ap("Car", "2d", "easy") == 0.0
    assert ev(gt, more).ap("Car", "2d", "easy") == pytest.approx(100.0)


def test_hand_computed_precision_recall_curve():
    """4 GT; detections by score: TP, FP, TP, FP, TP. Thresholds at the 3 TP scores; precision 1, 2/3,
    3/5 at points 0, 1, 2 and 0 beyond."""
    gt = [rec("Car", i) for i in range(4)]
    far = [rec("Car", 30 + k) for k in range(2)]  # detections on nothing
    dt = [
        dict(gt[0], score=0.9),
        dict(far[0], score=0.8),
        dict(gt[1], score=0.7),
        dict(far[1], score=0.6),
        dict(gt[2], score=0.5),
    ]
    r = ev(gt, dt)
    curve = r.curves[0, 0, 1]
    np.testing.assert_allclose(curve[:4], [1.0, 2 / 3, 3 / 5, 0.0])
    assert not curve[3:].any()
    assert r.ap("Car", "2d", "moderate", "R40") == pytest.approx((2 / 3 + 3 / 5) / 40 * 100)
    assert r.ap("Car", "2d", "moderate", "R11") == pytest.approx(1 / 11 * 100)


def test_false_positives_above_and_below_all_true_positives():
    gt, dt = perfect(50)
    top = [dict(rec("Car", 60 + k), score=0.99) for k in range(10)]
    bottom = [dict(rec("Car", 60 + k), score=0.01) for k in range(10)]
    # 10 FP above: precision (i+1)/(i+11) grows with recall, so every point takes the last one, 50/60.
    r = ev(gt, dt + top)
    for p in ("R40", "R11"):
        assert r.ap("Car", "3d", "moderate", p) == pytest.approx(50 / 60 * 100)
    # FP below the lowest true positive never reach a threshold.
    assert ev(gt, dt + bottom).ap("Car", "3d", "moderate") == pytest.approx(100.0)


def test_r11_and_r40_differ_on_the_same_data():
    gt, dt = perfect(60)
    for k, d in enumerate(dt):
        d["score"] = 0.9 - 0.01 * k
    fps = [dict(rec("Car", 100 + k), score=0.9 - 0.01 * (3 * k) - 0.005) for k in range(20)]
    r = ev(gt, dt + fps)
    r40, r11 = r.ap("Car", "bev", "moderate", "R40"), r.ap("Car", "bev", "moderate", "R11")
    curve = r.curves[0, 1, 1]
    assert r40 == pytest.approx(curve[1:].mean() * 100)
    assert r11 == pytest.approx(curve[::4].mean() * 100)
    assert abs(r40 - r11) > 0.1 and 0 < r40 < 100


def test_neighbour_classes_are_ignored():
    gt, dt = perfect(50)
    van = rec("Van", 70, dims=(2.2, 1.9, 5.0))
    on_van = dict(van, name="Car", score=0.99)
    assert ev(gt + [van], dt + [on_van]).ap("Car", "2d", "moderate") == pytest.approx(100.0)
    truck = dict(van, name="Truck")  # not a neighbour of Car: the detection is a false positive
    assert ev(gt + [truck], dt + [on_van]).ap("Car", "2d", "moderate") == pytest.approx(50 / 51 * 100)
    pgt, pdt = perfect(50, "Pedestrian", dims=(1.7, 0.6, 0.8))
    sitting = rec("Person_sitting", 70, dims=(1.2, 0.6, 0.8))
    on_sitting = dict(sitting, name="Pedestrian", score=0.99)
    assert ev(pgt + [sitting], pdt + [on_sitting]).ap("Pedestrian", "3d", "hard") == pytest.approx(100.0)
    # A Van is not a neighbour for Pedestrian evaluation, and other classes' GT do not count.
    r = ev(pgt + [van], pdt)
    assert r.num_gt[1].tolist() == [50, 50, 50] and r.num_gt[0].tolist() == [0, 0, 0]


def test_detections_lower_than_the_level_minimum_are_ignored():
    gt, dt = perfect(50)
    low_fp = dict(rec("Car", 80, height=30.0), score=0.99)  # 30 px: below easy's 40, above moderate's 25
    r = ev(gt, dt + [low_fp])
    assert r.ap("Car", "bev", "easy") == pytest.approx(100.0)
    assert r.ap("Car", "bev", "moderate") == pytest.approx(50 / 51 * 100)


def test_gt_outside_the_level_is_ignored_not_missed():
    gt, dt = perfect(50)
    small = rec("Car", 90, height=30.0)  # moderate, not easy
    occluded = rec("Car", 91, occ=2)  # hard only
    truncated = rec("Car", 92, trunc=0.4)  # hard only
    r = ev(gt + [small, occluded, truncated], dt)  # none of the three detected
    assert r.num_gt[0].tolist() == [50, 51, 53]
    assert r.ap("Car", "2d", "easy") == pytest.approx(100.0)
    # Detected, they are TPs where counted and neutral where ignored (never FP).
    found = [dict(g, score=0.95) for g in (small, occluded, truncated)]
    r = ev(gt + [small, occluded, truncated], dt + found)
    assert [r.ap("Car", "2d", lv) for lv in LEVELS] == pytest.approx([100.0, 100.0, 100.0])


def test_dontcare_regions_matter_in_2d_only():
    gt, dt = perfect(50)
    dc = dict(
        rec(
            "DontCare",
            0,
            bbox=(900.0, 300.0, 1000.0, 370.0),
            loc=(-1000.0, -1000.0, -1000.0),
            dims=(-1.0, -1.0, -1.0),
            ry=-10.0,
            alpha=-10.0,
            trunc=-1.0,
            occ=-1,
        )
    )
    fp_in_dc = dict(rec("Car", 95, bbox=(910.0, 310.0, 990.0, 360.0)), score=0.99)
    r = ev(gt + [dc], dt + [fp_in_dc])
    assert r.ap("Car", "2d", "moderate") == pytest.approx(100.0)
    assert r.ap("Car", "bev", "moderate") == pytest.approx(50 / 51 * 100)
    assert r.ap("Car", "3d", "moderate") == pytest.approx(50 / 51 * 100)
    # The DontCare test uses the class's minimum overlap: 60 % inside is a FP for Car (0.7), not for
    # Pedestrian (0.5).
    fp_60_in = dict(fp_in_dc, bbox=(940.0, 310.0, 1040.0, 360.0))
    assert ev(gt + [dc], dt + [fp_60_in]).ap("Car", "2d", "moderate") == pytest.approx(50 / 51 * 100)
    pgt, pdt = perfect(50, "Pedestrian", dims=(1.7, 0.6, 0.8))
    ped_60_in = dict(fp_60_in, name="Pedestrian")
    assert ev(pgt + [dc], pdt + [ped_60_in]).ap("Pedestrian", "2d", "moderate") == pytest.approx(100.0)
    assert ev(pgt, pdt + [ped_60_in]).ap("Pedestrian", "2d", "moderate") == pytest.approx(50 / 51 * 100)


def test_aos_uses_the_orientation():
    gt, dt = perfect(50)
    flipped = [dict(d, ry=d["ry"] + math.pi, alpha=d["alpha"] + math.pi) for d in dt]
    r = ev(gt, flipped)
    assert r.ap("Car", "2d", "moderate") == pytest.approx(100.0)
    assert r.ap("Car", "bev", "moderate") == pytest.approx(100.0)
    assert r.ap("Car", "aos", "moderate") == pytest.approx(0.0, abs=1e-9)
    half = [dict(d, alpha=d["alpha"] + math.pi / 2) for d in dt]  # similarity (1 + cos 90°) / 2
    assert ev(gt, half).ap("Car", "aos", "moderate") == pytest.approx(50.0, abs=1e-4)


def test_ap_by_distance():
    near = [rec("Car", i, loc=(2.0 * (i % 10) - 10, 1.6, 20.0 + i // 10)) for i in range(50)]
    mid = [rec("Car", 50 + i, loc=(2.0 * (i % 10) - 10, 1.6, 40.0 + i // 10)) for i in range(50)]
    dt = [dict(g, score=0.9) for g in near]
    r = ev(near + mid, dt)
    assert r.distance_levels == ("0-30", "30-50", "50+")
    assert r.distance_num_gt[0].tolist() == [50, 50, 0]
    assert r.ap("Car", "3d", "0-30") == pytest.approx(100.0)
    assert r.ap("Car", "3d", "30-50") == 0.0
    assert r.ap("Car", "3d", "50+") == 0.0
    # A detection just inside 30 m on a GT just beyond it (BEV/3D IoU 0.88) is neither TP nor FP in 0-30
    # (its GT is out of range); without that GT it is a false positive there.
    edge_gt = rec("Car", 98, loc=(0.0, 1.6, 30.05))
    edge_dt = dict(rec("Car", 98, loc=(0.0, 1.6, 29.95)), score=0.95)
    with_gt = ev(near + mid + [edge_gt], dt + [edge_dt])
    without = ev(near + mid, dt + [edge_dt])
    for m in ("bev", "3d"):
        assert with_gt.ap("Car", m, "0-30") == pytest.approx(100.0)
        assert without.ap("Car", m, "0-30") == pytest.approx(50 / 51 * 100)
    assert with_gt.distance_num_gt[0].tolist() == [50, 51, 0]
    custom = ev(near + mid, dt, distance_ranges=((0, 100),))
    assert custom.distance_levels == ("0-100",) and custom.distance_num_gt[0, 0] == 100
    assert ev(near, dt, distance_ranges=None).distance_levels == ()


def test_json_shape_and_table():
    gt, dt = perfect(45)
    r = ev(gt, dt)
    js = r.to_json()
    assert list(js) == ["Car", "Pedestrian", "Cyclist", "distance"]
    for c in ("Car", "Pedestrian", "Cyclist"):
        assert list(js[c]) == ["2d", "bev", "3d", "aos"]
        for m in js[c]:
            assert list(js[c][m]) == ["R40", "R11"]
            assert list(js[c][m]["R40"]) == ["easy", "moderate", "hard"]
    assert js["Car"]["3d"]["R40"]["moderate"] == pytest.approx(100.0)
    assert list(js["distance"]["Car"]["bev"]["R40"]) == ["0-30", "30-50", "50+"]
    text = r.table()
    assert "Car AP_R40@0.70, 0.70, 0.70:" in text and "3d   AP:100.0000, 100.0000, 100.0000" in text
    assert "Pedestrian AP_R11@0.50, 0.50, 0.50:" in text


def test_subset_of_classes_and_metrics():
    gt, dt = perfect(45)
    r = ev(gt, dt, classes=("Car",), metrics=("aos",))
    assert r.metrics == ("aos",) and r.ap("Car", "aos", "easy") == pytest.approx(100.0)
    with pytest.raises(KeyError, match="metric '3d' was not evaluated"):
        r.ap("Car", "3d", "easy")
    trucks = ev(
        [dict(g, name="Truck") for g in gt],
        [dict(d, name="Truck") for d in dt],
        classes=("Truck",),
        min_overlap={"Truck": 0.7},
    )
    assert trucks.ap("Truck", "3d", "easy") == pytest.approx(100.0)


def test_timings_are_filled():
    gt, dt = perfect(10)
    t = EvalTimings()
    ev(gt, dt, timings=t)
    assert t.total_s > 0 and t.total_s >= t.overlap_s and t.matching_s > 0


# --------------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------------
def test_bad_input_is_a_clear_error():
    gt, dt = perfect(3)
    G, D = frame(gt, False), frame(dt, True)
    with pytest.raises(ValueError, match="2 ground-truth frames but 1 detection frames"):
        evaluate([G, G], [D])
    with pytest.raises(ValueError, match="no frames"):
        evaluate([], [])
    with pytest.raises(ValueError, match=r"dt\[0\]: detections need scores"):
        evaluate([G], [G])
    bad = frame(dt, True)
    bad.score[1] = np.nan
    with pytest.raises(ValueError, match=r"dt\[0\] record 1 \(Car\): NaN or infinite value"):
        evaluate([G], [bad])
    neg = frame(dt, True)
    neg.dimensions[2, 0] = -1.0
    with pytest.raises(ValueError, match=r"dt\[0\] record 2 \(Car\): negative size"):
        evaluate([G], [neg])
    shape = frame(dt, True)
    shape.bbox = shape.bbox[:, :3]
    with pytest.raises(ValueError, match=r"dt\[0\]: bbox has shape \(3, 3\), expected \(3, 4\)"):
        evaluate([G], [shape])
    with pytest.raises(TypeError, match=r"gt\[0\]: expected KittiLabels"):
        evaluate([{"name": []}], [D])
    with pytest.raises(ValueError, match="unknown metric 'iou'"):
        evaluate([G], [D], metrics=("iou",))
    with pytest.raises(ValueError, match="class 'Truck' has no minimum overlap"):
        evaluate([G], [D], classes=("Truck",))


# --------------------------------------------------------------------------------------------------
# Score thresholds and the literal reference
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(6))
def test_score_thresholds_match_the_literal_rule(seed):
    rng = np.random.default_rng(seed)
    n_gt = int(rng.integers(1, 300))
    n_tp = int(rng.integers(0, n_gt + 1))
    scores = np.round(rng.random(n_tp), 2)  # with ties
    got = score_thresholds(scores, n_gt)
    assert got.tolist() == thresholds_literal(scores.tolist(), n_gt)
    assert len(got) <= N_SAMPLE_PTS


def _compare_with_reference(gt, dt, combos):
    r = evaluate(gt, dt)
    levels = KITTI_LEVELS + distance_levels()
    for cls, metric, li in combos:
        ref = reference_curve(gt, dt, cls, levels[li], metric)
        c, m = r.classes.index(cls), r.metrics.index(metric)
        fast = r.curves[c, m, li] if li < 3 else r.distance_curves[c, m, li - 3]
        n_gt = r.num_gt[c, li] if li < 3 else r.distance_num_gt[c, li - 3]
        assert n_gt == ref.n_gt, (cls, metric, li)
        np.testing.assert_array_equal(fast, ref.precision, err_msg=f"{cls} {metric} {levels[li].name}")
        if metric == "2d":
            fa = r.curves[c, 3, li] if li < 3 else r.distance_curves[c, 3, li - 3]
            np.testing.assert_allclose(fa, ref.aos, rtol=0, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1])
def test_fast_evaluator_equals_the_literal_reference_on_crowded_frames(seed):
    """Crowded frames: detections overlapping several GT, duplicates, DontCare on objects, low boxes."""
    gt, dt = synthetic_set(6, dets_per_frame=25, seed=seed, crowded=True)
    rng = np.random.default_rng(seed)
    combos = [
        (c, m, int(rng.integers(0, 6))) for c in ("Car", "Pedestrian", "Cyclist") for m in ("2d", "bev", "3d")
    ]
    _compare_with_reference(gt, dt, combos)


@pytest.mark.slow
@pytest.mark.parametrize("seed,crowded", [(10, True), (11, True), (12, False)])
def test_fast_evaluator_equals_the_literal_reference_everywhere(seed, crowded):
    gt, dt = synthetic_set(12, dets_per_frame=40, seed=seed, crowded=crowded)
    combos = [
        (c, m, li) for c in ("Car", "Pedestrian", "Cyclist") for m in ("2d", "bev", "3d") for li in range(6)
    ]
    _compare_with_reference(gt, dt, combos)


def test_chunked_second_pass_gives_the_same_counts(monkeypatch):
    import detector.eval.matching as matching

    gt, dt = synthetic_set(8, dets_per_frame=30, seed=5, crowded=True)
    whole = evaluate(gt, dt)
    monkeypatch.setattr(matching._chunks, "__defaults__", (1,))  # one component per chunk
    chunked = evaluate(gt, dt)
    np.testing.assert_array_equal(whole.curves[:, :3], chunked.curves[:, :3])  # precision: same counts
    np.testing.assert_array_equal(whole.distance_curves[:, :3], chunked.distance_curves[:, :3])
    np.testing.assert_allclose(whole.curves[:, 3], chunked.curves[:, 3], rtol=0, atol=1e-12)  # AOS sums
