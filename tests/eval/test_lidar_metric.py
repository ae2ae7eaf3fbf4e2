"""The LiDAR-only rule (detector.eval.protocol L1-L4) on hand-built cases whose AP follows from the rule.

Each case is repeated over 80 frames: with 80 or more counted GT the protocol's score thresholds reach all 41
recall points (R8, R9), so a case where every GT is matched gives AP 100, none 0, precision p at every threshold
100 p, and recall r at full precision 100 round(40 r) / 40 in R40 (the thresholds approximate each recall step by
the nearest recall reached, R8)."""

from __future__ import annotations

import numpy as np
import pytest

from detector.data.lidar_labels import LidarLabels
from detector.errors import ConfigError
from detector.eval.lidar_metric import evaluate_lidar, lidar_table

CAR = [20.0, 0.0, -1.0, 4.0, 2.0, 1.5, 0.0]  # heading 0: a shift along x is along its length
N = 80


def _gt(*boxes, names=None):
    return LidarLabels(np.array(boxes, float).reshape(-1, 7), names or ["Car"] * len(boxes))


def _dt(*boxes, scores, names=None):
    return LidarLabels(np.array(boxes, float).reshape(-1, 7), names or ["Car"] * len(boxes), scores)


def _shift(box, dx):
    b = list(box)
    b[0] += dx
    return b


def _ap(gt, dt, metric="bev", level="overall", points="R40", min_overlap=None, cls="Car"):
    r = evaluate_lidar([gt] * N, [dt] * N, min_overlap or {"Car": 0.7})
    return r.ap(cls, metric, level, points)


# IoU of a 4 x 2 box and the same box shifted dx along its length: (4 - dx) / (4 + dx)
@pytest.mark.parametrize("dx, expected", [(0.0, 100.0), (0.6, 100.0), (0.75, 0.0), (1.0, 0.0)])
def test_one_gt_one_detection_above_or_below_threshold(dx, expected):
    assert (4 - dx) / (4 + dx) > 0.7 if expected else (4 - dx) / (4 + dx) < 0.7
    gt, dt = _gt(CAR), _dt(_shift(CAR, dx), scores=[0.9])
    for metric in ("bev", "3d"):
        for points in ("R40", "R11"):
            assert _ap(gt, dt, metric, points=points) == pytest.approx(expected)


def test_threshold_from_config_and_strictly_greater():
    gt, dt = _gt(CAR), _dt(_shift(CAR, 1.0), scores=[0.9])  # IoU 0.6 exactly in BEV
    assert _ap(gt, dt, min_overlap={"Car": 0.5}) == pytest.approx(100.0)
    assert _ap(gt, dt, min_overlap={"Car": 0.6}) == 0.0  # overlap must exceed the minimum
    truck = [30.0, 5.0, -0.5, 10.0, 2.6, 3.4, 0.0]
    r = evaluate_lidar([_gt(truck, names=["Truck"])] * N, [_dt(_shift(truck, 2.0), scores=[0.8], names=["Truck"])] * N,
                       {"Truck": 0.6})
    assert r.ap("Truck", "bev", "overall") == pytest.approx(100.0)  # IoU 8/12 > 0.6: any class, its threshold
    assert r.min_overlap == (0.6,) and "Truck" in lidar_table(r)


def test_two_detections_on_one_gt():
    gt = _gt(CAR)
    # the duplicate scores lower than every true positive: dropped at every threshold, precision 1
    assert _ap(gt, _dt(CAR, _shift(CAR, 0.3), scores=[0.9, 0.8])) == pytest.approx(100.0)
    # ... or higher: the first pass gives the GT the higher score, the only threshold; the exact one falls below it
    assert _ap(gt, _dt(CAR, _shift(CAR, 0.3), scores=[0.8, 0.9])) == pytest.approx(100.0)
    # equal scores: both above the threshold, the GT takes the larger overlap, the other is a FP: precision 1/2
    assert _ap(gt, _dt(_shift(CAR, 0.3), CAR, scores=[0.9, 0.9])) == pytest.approx(50.0)


def test_distance_bands():
    near, mid, far = CAR, _shift(CAR, 20.0), _shift(CAR, 40.0)  # 20.0, 40.0, 60.0 m from the sensor
    gt = _gt(near, mid, far)
    dt = _dt(near, mid, _shift(far, 1.0), scores=[0.9, 0.8, 0.7])  # the far one misses (IoU 0.6)
    r = evaluate_lidar([gt] * N, [dt] * N, {"Car": 0.7})
    assert r.ap("Car", "bev", "0-30") == pytest.approx(100.0)
    assert r.ap("Car", "bev", "30-50") == pytest.approx(100.0)
    assert r.ap("Car", "bev", "50+") == 0.0
    assert r.distance_num_gt[0].tolist() == [N, N, N] and r.num_gt[0].tolist() == [3 * N]
    # overall: 2 of 3 GT found, at full precision up to recall 2/3 (the missed one's detection, scored below every
    # true positive, is never counted): recall points 1..27 (27/40 is the step nearest 2/3)
    assert r.ap("Car", "bev", "overall") == pytest.approx(100.0 * 27 / 40)


def test_neighbour_and_other_classes():
    # a detection on a Van is neither TP nor FP for Car (ignored GT); a Truck GT plays no part for Car
    gt = _gt(CAR, _shift(CAR, 10.0), _shift(CAR, -10.0), names=["Car", "Van", "Truck"])
    dt = _dt(CAR, _shift(CAR, 10.0), scores=[0.9, 0.95])
    assert _ap(gt, dt) == pytest.approx(100.0)


def test_missing_threshold_is_a_config_error():
    with pytest.raises(ConfigError, match="data.classes has no minimum IoU for class.* Bus"):
        evaluate_lidar([_gt(CAR)], [_dt(CAR, scores=[0.9])], {"Car": 0.7}, classes=["Car", "Bus"])
