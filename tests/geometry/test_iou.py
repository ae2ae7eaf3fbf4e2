"""Exact box overlaps: known answers, a brute-force raster reference, frame conventions, bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest

from detector.data.kitti_camera import boxes_from_camera
from detector.eval.overlap import camera_bev
from detector.geometry.iou import (
    bev_intersection,
    bev_iou,
    box2d_overlap,
    iou3d,
    rect_corners,
)


def _raster_intersection(a: np.ndarray, b: np.ndarray, n: int = 500) -> tuple[float, float]:
    """Area of a ∩ b by counting cell centres of an n × n grid over their joint bounding box, and the
    bound on its error (cells crossed by either outline)."""
    ca, cb = rect_corners(a), rect_corners(b)
    pts = np.concatenate([ca, cb])
    lo, hi = pts.min(0), pts.max(0)
    xs = np.linspace(lo[0], hi[0], n, endpoint=False) + (hi[0] - lo[0]) / (2 * n)
    ys = np.linspace(lo[1], hi[1], n, endpoint=False) + (hi[1] - lo[1]) / (2 * n)
    X, Y = np.meshgrid(xs, ys)

    def inside(r):
        c, s = math.cos(r[4]), math.sin(r[4])
        dx, dy = X - r[0], Y - r[1]
        u, v = dx * c + dy * s, -dx * s + dy * c
        return (np.abs(u) <= r[2] / 2) & (np.abs(v) <= r[3] / 2)

    cell = (hi[0] - lo[0]) * (hi[1] - lo[1]) / n**2
    area = (inside(a) & inside(b)).sum() * cell
    perimeter = 2 * (a[2] + a[3] + b[2] + b[3])
    err = perimeter * math.hypot((hi[0] - lo[0]) / n, (hi[1] - lo[1]) / n)
    return float(area), err


def test_identical_boxes_give_exactly_one():
    rng = np.random.default_rng(0)
    r = np.c_[rng.uniform(-50, 50, (200, 2)), rng.uniform(0.3, 10, (200, 2)), rng.uniform(-7, 7, 200)]
    assert np.all(np.diag(bev_iou(r, r)) == 1.0)
    b = np.c_[r[:, :2], rng.uniform(-3, 3, 200), r[:, 2:4], rng.uniform(0.5, 4, 200), r[:, 4]]
    assert np.all(np.diag(iou3d(b, b)) == 1.0)


def test_same_rectangle_rotated_by_180_and_square_by_90():
    r = np.array([[3.0, -2.0, 4.2, 1.7, 0.4]])
    flipped = r.copy()
    flipped[0, 4] += math.pi
    assert bev_iou(r, flipped)[0, 0] == pytest.approx(1.0, abs=1e-12)
    sq = np.array([[1.0, 1.0, 2.0, 2.0, 0.3]])
    sq90 = sq.copy()
    sq90[0, 4] += math.pi / 2
    assert bev_iou(sq, sq90)[0, 0] == pytest.approx(1.0, abs=1e-12)
    # A 4 x 2 rectangle and the same turned by 90 degrees: a 2 x 2 overlap, union 12.
    rr = np.array([[0.0, 0.0, 4.0, 2.0, 0.0]])
    rr90 = np.array([[0.0, 0.0, 4.0, 2.0, math.pi / 2]])
    assert bev_intersection(rr, rr90)[0, 0] == pytest.approx(4.0, abs=1e-12)
    assert bev_iou(rr, rr90)[0, 0] == pytest.approx(4.0 / 12.0, abs=1e-12)


def test_touching_and_disjoint_boxes_give_zero():
    a = np.array([[0.0, 0.0, 2.0, 1.0, 0.0]])
    assert bev_iou(a, np.array([[2.0, 0.0, 2.0, 1.0, 0.0]]))[0, 0] == 0.0  # share an edge
    assert bev_iou(a, np.array([[2.0, 1.0, 2.0, 1.0, 0.0]]))[0, 0] == 0.0  # share a corner
    assert bev_iou(a, np.array([[10.0, 0.0, 2.0, 1.0, 0.7]]))[0, 0] == 0.0
    # Rotated touching: a square turned 45 degrees whose corner touches the other's edge.
    d = 1.0 + math.sqrt(2) / 2
    assert (
        bev_iou(np.array([[0.0, 0.0, 2.0, 2.0, 0.0]]), np.array([[d, 0.0, 1.0, 1.0, math.pi / 4]]))[0, 0]
        == 0.0
    )


def test_known_answers():
    # Unit square and the same turned by 45 degrees: a regular octagon of inradius 1/2.
    sq = np.array([[0.0, 0.0, 1.0, 1.0, 0.0]])
    sq45 = np.array([[0.0, 0.0, 1.0, 1.0, math.pi / 4]])
    octagon = 2 * (math.sqrt(2) - 1)
    assert bev_intersection(sq, sq45)[0, 0] == pytest.approx(octagon, rel=1e-13)
    assert bev_iou(sq, sq45)[0, 0] == pytest.approx(octagon / (2 - octagon), rel=1e-13)
    # Contained box.
    assert bev_iou(np.array([[0, 0, 4.0, 4.0, 0.2]]), np.array([[0, 0, 2.0, 2.0, 0.2]]))[
        0, 0
    ] == pytest.approx(0.25)
    # 3D: same footprint, half the height overlapping.
    a = np.array([[0, 0, 0.0, 4, 2, 2, 0.3]])
    b = np.array([[0, 0, 1.0, 4, 2, 2, 0.3]])
    assert iou3d(a, b)[0, 0] == pytest.approx(8.0 / (16 + 16 - 8), rel=1e-13)
    # Stacked boxes touch: 0.
    assert iou3d(a, np.array([[0, 0, 2.0, 4, 2, 2, 0.3]]))[0, 0] == 0.0


def test_axis_aligned_random_against_closed_form():
    rng = np.random.default_rng(1)
    n = 100
    a = np.c_[
        rng.uniform(0, 4, (n, 2)), rng.uniform(0.1, 4, (n, 2)), rng.choice([0, math.pi / 2, math.pi], n)
    ]
    b = np.c_[rng.uniform(0, 4, (n, 2)), rng.uniform(0.1, 4, (n, 2)), np.zeros(n)]

    def extent(r):  # half extents in x and y (swapped for a quarter turn)
        q = np.isclose(np.abs(np.sin(r[:, 4])), 1)
        return np.where(q, r[:, 3], r[:, 2]) / 2, np.where(q, r[:, 2], r[:, 3]) / 2

    ax, ay = extent(a)
    bx, by = extent(b)
    ix = np.clip(np.minimum(a[:, 0] + ax, b[:, 0] + bx) - np.maximum(a[:, 0] - ax, b[:, 0] - bx), 0, None)
    iy = np.clip(np.minimum(a[:, 1] + ay, b[:, 1] + by) - np.maximum(a[:, 1] - ay, b[:, 1] - by), 0, None)
    expected = ix * iy
    got = np.diag(bev_intersection(a, b))
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


def test_random_rotated_boxes_against_raster():
    rng = np.random.default_rng(2)
    diffs, areas = [], []
    for _ in range(20):
        a = np.r_[rng.uniform(-1, 1, 2), rng.uniform(0.5, 4, 2), rng.uniform(-math.pi, math.pi)]
        b = np.r_[rng.uniform(-1, 1, 2), rng.uniform(0.5, 4, 2), rng.uniform(-math.pi, math.pi)]
        exact = bev_intersection(a[None], b[None])[0, 0]
        approx, err = _raster_intersection(a, b)
        assert abs(exact - approx) <= err, (a, b, exact, approx, err)
        diffs.append(abs(exact - approx))
        areas.append(exact)
    assert sum(x > 0 for x in areas) >= 15  # most pairs overlap: the test exercises clipping
    assert sum(diffs) < 0.002 * sum(areas)


def test_iou_symmetric_and_bounded():
    rng = np.random.default_rng(3)
    r = np.c_[rng.uniform(0, 3, (60, 2)), rng.uniform(0.2, 3, (60, 2)), rng.uniform(-4, 4, 60)]
    m = bev_iou(r, r)
    np.testing.assert_allclose(m, m.T, rtol=0, atol=1e-12)
    assert (m >= 0).all() and (m <= 1 + 1e-12).all()


def test_degenerate_sizes():
    line = np.array([[0.0, 0.0, 2.0, 0.0, 0.3]])
    box = np.array([[0.0, 0.0, 2.0, 1.0, 0.3]])
    point = np.array([[0.0, 0.0, 0.0, 0.0, 0.0]])
    assert bev_intersection(line, box)[0, 0] == 0.0
    assert bev_iou(line, box)[0, 0] == 0.0
    assert bev_iou(line, line)[0, 0] == 0.0  # empty union: defined as 0
    assert bev_iou(point, point)[0, 0] == 0.0
    assert np.isfinite(iou3d(np.zeros((1, 7)), np.zeros((1, 7)))).all()
    assert bev_iou(np.zeros((0, 5)), box).shape == (0, 1)


def test_camera_frame_matches_lidar_frame(calib):
    """The metric's 3D IoU of KITTI camera-frame records equals the IoU of the same boxes in the LiDAR
    frame."""
    from detector.data.kitti_labels import KittiLabels
    from detector.eval.overlap import Records, overlap_pairs

    rng = np.random.default_rng(4)
    n = 40
    loc = np.c_[rng.uniform(-5, 5, n), rng.uniform(1.4, 1.9, n), rng.uniform(5, 15, n)]
    dims = np.c_[rng.uniform(1.2, 2, n), rng.uniform(1.4, 2, n), rng.uniform(3, 5, n)]
    ry = rng.uniform(-math.pi, math.pi, n)
    lidar = boxes_from_camera(loc, dims, ry, calib).tensor.double().numpy()
    z = np.zeros(n)
    R = Records.from_labels([KittiLabels(["Car"] * n, z, z, z, np.zeros((n, 4)), dims, loc, ry, z)], True)
    i, j = np.repeat(np.arange(n), n), np.tile(np.arange(n), n)
    cam = overlap_pairs("3d", R, i, R, j).reshape(n, n)
    np.testing.assert_allclose(cam, iou3d(lidar, lidar), rtol=0, atol=1e-9)
    np.testing.assert_allclose(
        bev_iou(camera_bev(loc, dims, ry), camera_bev(loc, dims, ry)),
        bev_iou(lidar[:, [0, 1, 3, 4, 6]], lidar[:, [0, 1, 3, 4, 6]]),
        rtol=0,
        atol=1e-9,
    )
    assert (cam > 0).sum() > n  # the test set has overlapping pairs


def test_box2d_overlap():
    a = np.array([[0.0, 0.0, 10.0, 10.0]])
    b = np.array([[5.0, 0.0, 15.0, 10.0], [10.0, 0.0, 20.0, 10.0], [2.0, 2.0, 4.0, 4.0]])
    np.testing.assert_allclose(box2d_overlap(a, b), [[50 / 150, 0.0, 4 / 100]])
    np.testing.assert_allclose(box2d_overlap(b, a, "a"), [[0.5], [0.0], [1.0]])
    assert box2d_overlap(a, a)[0, 0] == 1.0


@pytest.mark.parametrize(
    "fn,arr,msg",
    [
        (bev_iou, np.zeros((2, 4)), r"a: expected an \[N, 5\]"),
        (bev_iou, np.array([[0, 0, 1.0, np.nan, 0]]), "NaN"),
        (bev_iou, np.array([[0, 0, -1.0, 1.0, 0]]), "negative box size in row 0"),
        (iou3d, np.array([[0, 0, 0, 1.0, 1.0, -2.0, 0]]), "negative box size"),
        (box2d_overlap, np.zeros((3,)), r"expected an \[N, 4\]"),
    ],
)
def test_bad_input_is_a_clear_error(fn, arr, msg):
    with pytest.raises(ValueError, match=msg):
        fn(arr, arr)


def test_accepts_torch_tensors_and_lists():
    import torch

    a = torch.tensor([[0.0, 0.0, 4.0, 2.0, 0.3]], dtype=torch.float32)
    out = bev_iou(a, a)
    assert isinstance(out, np.ndarray) and out.dtype == np.float64 and out[0, 0] == 1.0
    assert bev_iou([[0, 0, 2, 2, 0]], [[1, 0, 2, 2, 0]])[0, 0] == pytest.approx(1 / 3)


# --------------------------------------------------------------------------------------------------
# The metric's 3D overlap: vertical extent from the bottom y and the height h (not w, not l)
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "det_y,det_h,expected",
    [
        # GT spans y in [0.1, 1.6] (bottom 1.6, h 1.5); footprint 4.0 x 1.6 = 6.4 m² for both boxes.
        (1.0, 1.0, 0.9 * 6.4 / (9.6 + 6.4 - 0.9 * 6.4)),  # det [0.0, 1.0]: 0.9 m shared -> 0.5625
        (2.0, 0.8, 0.4 * 6.4 / (9.6 + 0.8 * 6.4 - 0.4 * 6.4)),  # det [1.2, 2.0]: 0.4 m shared
        (1.6, 1.5, 1.0),  # the same box
        (0.1, 0.5, 0.0),  # det [-0.4, 0.1] touches the GT's top: no volume
        (-0.5, 0.5, 0.0),  # det entirely above
    ],
)
def test_3d_overlap_with_unequal_heights_and_bottoms(det_y, det_h, expected):
    """Hand-computed 3D IoU of two boxes with the same footprint but different bottom y and height; a
    vertical extent taken from w (1.6) or l (4.0), or y taken as the centre, gives other values."""
    from detector.data.kitti_labels import KittiLabels
    from detector.eval.overlap import Records, overlap_pairs

    def rec(y, h, score=None):
        return KittiLabels(["Car"], [0.0], [0], [0.0], [[0.0, 0.0, 50.0, 50.0]], [[h, 1.6, 4.0]], [[2.0, y, 20.0]],
                           [0.3], None if score is None else [score])

    gt = Records.from_labels([rec(1.6, 1.5)], with_score=False)
    det = Records.from_labels([rec(det_y, det_h, 0.5)], with_score=True)
    i = np.zeros(1, np.int64)
    assert overlap_pairs("3d", det, i, gt, i)[0] == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert overlap_pairs("bev", det, i, gt, i)[0] == pytest.approx(1.0, rel=1e-12)
    # Intersection over the detection's volume (the DontCare test): shared height / det height.
    shared = max(min(det_y, 1.6) - max(det_y - det_h, 0.1), 0.0)
    assert overlap_pairs("3d", det, i, gt, i, "a")[0] == pytest.approx(shared / det_h, rel=1e-12, abs=1e-15)
