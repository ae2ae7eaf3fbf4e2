"""The error analysis (detector/eval/error_analysis.py, scripts/analyze_errors.py) on hand-built frames whose errors
follow from the rule: a Car box at BEV IoU 0.6 is "loose" and its Car "found but loose"; of two boxes on one Car the
one the metric did not take is a "duplicate"; a box on empty ground is "background"; a Car with no box near it is
"missed"; distances and bands; both file layouts; the errors are exactly the metric's FP and FN at a threshold; and
the command through a subprocess on folders written by the project's writers, with a dataset root."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from detector.data.kitti import write_points
from detector.data.kitti_camera import boxes_to_labels
from detector.data.kitti_labels import write_label
from detector.data.lidar_labels import LidarLabels
from detector.eval.error_analysis import analyze, band_of
from detector.geometry.boxes import Boxes3D
from detector.module import write_records
from tests.paths import REPO

CAR = (4.0, 2.0, 1.5)  # l, w, h
Z = -0.9  # box centre height (LiDAR frame)


def car(x, y, l=CAR[0], w=CAR[1]):
    return [x, y, Z, l, w, CAR[2], 0.0]


def shift_for(iou: float, length: float = CAR[0]) -> float:
    """The shift along its length that gives a box BEV IoU ``iou`` with itself: (l - d) / (l + d) = iou."""
    return length * (1 - iou) / (1 + iou)


# One frame, LiDAR frame boxes: (box, class) of the ground truth, (box, class, score) of the detections.
GT = [
    (car(12, 3), "Car"),            # A: a tight box (TP) and a second, looser one (duplicate)
    (car(20, -4), "Car"),           # B: one box at IoU 0.6 (loose / found but loose)
    (car(25, 6), "Car"),            # C: nothing near (missed)
    (car(8, -3), "Car"),            # F: a box at IoU 0.25 (mislocated / missed)
    (car(40, 2), "Car"),            # E: a tight box at 40 m (TP in 30-50)
    ([30, -10, -0.4, 8.0, 2.5, 3.0, 0.0], "Truck"),  # a Car box on it (other class)
]
DT = [
    (car(12, 3), "Car", 0.9),
    (car(12 + shift_for(0.8), 3), "Car", 0.8),
    (car(20 + shift_for(0.6), -4), "Car", 0.7),
    (car(8 + shift_for(0.25), -3), "Car", 0.65),
    (car(40, 2), "Car", 0.5),
    (car(30, -10), "Car", 0.45),    # IoU 8 / 20 = 0.4 with the Truck (8 x 2.5 m)
    (car(15, -10), "Car", 0.6),     # empty ground (background)
    (car(18, 8), "Car", 0.2),       # empty ground, below the default score threshold
    (car(55, 0), "Car", 0.4),       # empty ground at 55 m: under 25 px in the image (ignored at moderate, R4)
]
EXPECTED = {  # (side, record) -> kind, at score >= 0.3, LiDAR-only records
    ("detection", 1): "duplicate", ("detection", 2): "loose", ("detection", 3): "mislocated",
    ("detection", 5): "other_class", ("detection", 6): "background", ("detection", 8): "background",
    ("gt", 1): "found_loose", ("gt", 2): "missed", ("gt", 3): "missed",
}


def lidar_frame(gt=GT, dt=DT) -> tuple[LidarLabels, LidarLabels]:
    return (LidarLabels(np.array([b for b, _ in gt]), np.array([n for _, n in gt])),
            LidarLabels(np.array([b for b, _, _ in dt]), np.array([n for _, n, _ in dt]),
                        np.array([s for _, _, s in dt])))


def kitti_frame(calib, gt=GT, dt=DT):
    """The same frame as KITTI records (camera frame, 2D boxes projected), as evaluation writes them."""
    g, d = lidar_frame(gt, dt)
    return (boxes_to_labels(Boxes3D(g.boxes), g.name, calib),
            boxes_to_labels(Boxes3D(d.boxes), d.name, calib, scores=d.score))


def kinds(analysis) -> dict:
    return {(e.side, e.record): e.kind for e in analysis.errors}


def test_each_kind_on_a_hand_built_lidar_frame():
    g, d = lidar_frame()
    a = analyze(["000000"], [g], [d], {"Car": 0.7})
    assert kinds(a) == EXPECTED
    by = {(e.side, e.record): e for e in a.errors}
    assert by["detection", 2].best_iou == pytest.approx(0.6) and by["gt", 1].best_iou == pytest.approx(0.6)
    assert by["detection", 1].best_iou == pytest.approx(0.8)
    assert by["detection", 1].taken_by == {"class": "Car", "record": 0, "score": 0.9, "iou": pytest.approx(1.0)}
    assert by["detection", 3].best_iou == pytest.approx(0.25) and by["gt", 3].best_iou == pytest.approx(0.25)
    assert by["detection", 5].best_iou == pytest.approx(0.4) and by["detection", 5].best["class"] == "Truck"
    assert by["detection", 6].best_iou == 0 and by["detection", 6].best is None
    assert by["gt", 2].best is None  # nothing near the missed car
    # distance from the LiDAR, sqrt(x^2 + y^2), and its band
    assert by["gt", 2].distance == pytest.approx(math.hypot(25, 6)) and by["gt", 2].band == "0-30"
    assert by["detection", 8].distance == pytest.approx(55) and by["detection", 8].band == "50+"
    assert by["detection", 5].size == pytest.approx(CAR) and by["detection", 5].score == 0.45
    n = a.counts["Car"]
    assert n.n_gt == {"0-30": 4, "30-50": 1} and n.tp == {"0-30": 1, "30-50": 1}
    assert n.kinds["background"] == {"0-30": 1, "50+": 1}
    line = a.summary()[0]
    assert line.startswith("errors Car (BEV IoU > 0.70, score >= 0.30, overall): missed 2 | found but loose 1 | "
                           "duplicate 1 | loose 1 | mislocated 1 | other class 1 | background 2 | found 2 of 5 GT")
    # a lower threshold brings the box scored 0.2 in (background), a higher one leaves the 0.45-0.65 boxes out
    assert kinds(analyze(["0"], [g], [d], {"Car": 0.7}, score_threshold=0.1))[("detection", 7)] == "background"
    high = kinds(analyze(["0"], [g], [d], {"Car": 0.7}, score_threshold=0.7))
    assert high == {("detection", 1): "duplicate", ("detection", 2): "loose", ("gt", 1): "found_loose",
                    ("gt", 2): "missed", ("gt", 3): "missed", ("gt", 4): "missed"}


def test_kitti_records_give_the_same_kinds_and_the_camera_distance(calib):
    g, d = kitti_frame(calib)
    a = analyze(["000000"], [g], [d], {"Car": 0.7})  # level moderate
    expected = dict(EXPECTED)
    del expected["detection", 8]  # under 25 px at 55 m: ignored at moderate (R4), not a false positive
    assert kinds(a) == expected
    by = {(e.side, e.record): e for e in a.errors}
    # the metric's distance: from the camera (0.27 m ahead of the LiDAR in make_calib), sqrt(x_cam^2 + z_cam^2)
    assert by["gt", 2].distance == pytest.approx(math.hypot(25 - 0.27, 6), abs=1e-6)
    assert by["detection", 2].best_iou == pytest.approx(0.6)
    # level=distance counts every height (AP by distance's rule): the far box is a false positive there
    assert kinds(analyze(["0"], [g], [d], {"Car": 0.7}, level="distance"))[("detection", 8)] == "background"


def test_duplicate_is_the_box_the_metric_did_not_take():
    """The GT takes the box with the largest IoU (R8), whatever the scores: the higher-scored, looser box is the
    duplicate; with the tighter box scored higher, the lower-scored one is."""
    g, _ = lidar_frame(GT[:1], [])
    for scores, dup in (((0.9, 0.5), 1), ((0.5, 0.9), 1)):
        d = LidarLabels(np.array([car(12, 3), car(12 + shift_for(0.8), 3)]), np.array(["Car", "Car"]),
                        np.array(scores))
        assert kinds(analyze(["0"], [g], [d], {"Car": 0.7})) == {("detection", dup): "duplicate"}


def test_frames_without_detections_miss_every_object():
    g, _ = lidar_frame()
    a = analyze(["0", "1"], [g, LidarLabels.empty()], [LidarLabels.empty(True), LidarLabels.empty(True)],
                {"Car": 0.7})
    assert kinds(a) == {("gt", i): "missed" for i in range(5)}
    assert a.summary()[0].endswith("background 0 | found 0 of 5 GT")


def test_ignored_objects_are_no_errors(calib):
    """A Van under a Car box absorbs it (R2), a Car too small for the level is not missed (R3), a box on a
    DontCare-sized empty spot far away is not on an object: background."""
    gt = [(car(12, 3), "Van"), (car(60, 0), "Car")]
    dt = [(car(12, 3), "Car", 0.9)]
    g, d = kitti_frame(calib, gt, dt)
    a = analyze(["0"], [g], [d], {"Car": 0.7})
    assert a.errors == [] and a.counts["Car"].n_gt == {}


@pytest.mark.parametrize("crowded", [False, True])
def test_errors_are_the_metrics_false_positives_and_negatives(crowded):
    """At each of the metric's score thresholds, found = its TP, missed + found but loose = its FN, and the false
    positives' kinds sum to its FP (BEV, moderate), on synthetic frames crowded enough for the matching to choose."""
    from detector.eval.kitti_metric import evaluate
    from detector.eval.synthetic import synthetic_set

    gts, dts = synthetic_set(12, dets_per_frame=25, seed=3, crowded=crowded)
    res = evaluate(gts, dts, classes=("Car", "Pedestrian"), metrics=("bev",), distance_ranges=None)
    for cls in ("Car", "Pedestrian"):
        counts = res.counts[(cls, "bev", "moderate")]
        for t, tp, fp, fn in list(zip(counts.thresholds, counts.tp, counts.fp, counts.fn, strict=True)):
            a = analyze([str(i) for i in range(12)], gts, dts, {cls: 0.7 if cls == "Car" else 0.5},
                        score_threshold=float(t))
            c = a.counts[cls]
            assert sum(c.tp.values()) == tp and sum(c.n_gt.values()) == counts.n_gt
            assert sum(sum(c.kinds[k].values()) for k in ("missed", "found_loose")) == fn
            assert sum(sum(c.kinds[k].values()) for k in ("duplicate", "loose", "mislocated", "other_class",
                                                          "background")) == fp


def test_bands():
    assert [band_of(d) for d in (0.0, 29.99, 30.0, 49.99, 50.0, 120.0)] == ["0-30", "0-30", "30-50", "30-50", "50+",
                                                                           "50+"]


def _points_in(box, n, rng):
    """``n`` points spread inside a LiDAR box (yaw 0)."""
    x, y, z, length, w, h, _ = box
    p = rng.uniform(-0.45, 0.45, (n, 3)) * [length, w, h] + [x, y, z]
    return np.hstack([p, np.full((n, 1), 0.3)]).astype(np.float32)


def test_command_on_files_written_by_the_project(tmp_path, calib):
    """scripts/analyze_errors.py run=EVAL_DIR root=ROOT on an evaluation folder written by write_records (KITTI
    records) and a KITTI root written by the project's writers: the table, the summary line, errors.json with every
    error and the points inside, the pictures; a LiDAR-only folder by gt=/results=."""
    rng = np.random.default_rng(0)
    root, run = tmp_path / "kitti", tmp_path / "eval"
    for sub in ("training/velodyne", "training/calib", "training/label_2"):
        (root / sub).mkdir(parents=True)
    g, d = kitti_frame(calib)
    # 50 points inside the missed Car C, 7 inside the found-but-loose Car B (in the camera's view), ground noise
    pts = np.vstack([_points_in(GT[2][0], 50, rng), _points_in(GT[1][0], 7, rng),
                     np.hstack([rng.uniform([5, -5, -1.8], [30, 5, -1.7], (200, 3)), np.zeros((200, 1))])])
    write_points(root / "training/velodyne/000007.bin", pts.astype(np.float32))
    calib.to_file(root / "training/calib/000007.txt")
    write_label(root / "training/label_2/000007.txt", g)
    (run / "label_2").mkdir(parents=True)
    (run / "data").mkdir()
    write_records(run / "label_2/000007.txt", g)
    write_records(run / "data/000007.txt", d)
    lidar_run = tmp_path / "lidar_eval"
    lg, ld = lidar_frame()
    for sub, rec in (("label_2", lg), ("data", ld)):
        (lidar_run / sub).mkdir(parents=True)
        write_records(lidar_run / sub / "000007.txt", rec)
    out = subprocess.run([sys.executable, "scripts/analyze_errors.py", f"run={run}", f"root={root}", "pictures=2"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert ("errors Car (BEV IoU > 0.70, score >= 0.30, moderate): missed 2 | found but loose 1 | duplicate 1 | "
            "loose 1 | mislocated 1 | other class 1 | background 1 | found 2 of 5 GT") in out.stdout
    assert "found but loose" in out.stdout and "30-50" in out.stdout  # the table
    result = json.loads((run / "errors" / "errors.json").read_text())
    assert result["settings"]["score_threshold"] == 0.3 and result["settings"]["level"] == "moderate"
    errors = {(e["side"], e["record"]): e for e in result["errors"]}
    assert len(errors) == 8 and errors["gt", 2]["kind"] == "missed" and errors["gt", 2]["frame"] == "000007"
    assert errors["gt", 2]["points"] == 50 and errors["gt", 1]["points"] == 7 and errors["detection", 6]["points"] == 0
    pictures = sorted(p.name for p in (run / "errors" / "pictures").glob("*.png"))
    assert "missed_01_000007_Car.png" in pictures and "background_01_000007_Car.png" in pictures
    assert len(pictures) == 8  # one of each kind found (missed: 2)
    # a folder of other files is refused in one line
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    from detector.commands.analyze_errors import main

    assert main([f"run={run}", f"out={tmp_path / 'busy'}"]) == 1
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"
    # the LiDAR-only layout, told apart by its field count
    assert main([f"gt={lidar_run / 'label_2'}", f"results={lidar_run / 'data'}", "classes=Car"]) == 0
    lidar = json.loads((lidar_run / "errors" / "errors.json").read_text())
    assert lidar["inputs"]["layout"] == "lidar" and lidar["settings"]["level"] == "overall"
    assert {(e["side"], e["record"]): e["kind"] for e in lidar["errors"]} == EXPECTED


def test_bad_input_is_one_line(tmp_path, capsys):
    from detector.commands.analyze_errors import main

    assert main([f"run={tmp_path / 'nothing'}"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "label folder not found" in err and len(err.strip().splitlines()) == 1
    assert main(["root=x"]) == 2
