"""KITTI I/O: round trips, calibration transforms, bad input, and the real KITTI frames."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from detector.data.dataset import KittiDataset
from detector.data.kitti import KittiRoot, read_imageset, read_points, write_imageset, write_points
from detector.data.kitti_calib import Calibration
from detector.data.kitti_camera import (
    boxes_from_camera,
    boxes_to_camera,
    boxes_to_labels,
    labels_to_boxes,
    project_to_image,
)
from detector.data.kitti_labels import OBJECT_TYPES, difficulty, read_label, write_label
from detector.data.road_map import RoadMap, read_road_map, write_road_map
from detector.data.structures import collate_frames
from detector.errors import KittiFormatError
from detector.geometry.boxes import Boxes3D
from tests.conftest import make_calib

LABEL_TEXT = """\
Car 0.00 0 -1.58 587.01 173.33 614.12 200.12 1.65 1.67 3.64 -0.65 1.71 46.70 -1.59
Van 0.12 1 1.85 387.63 181.54 423.81 203.12 2.10 1.87 4.69 -16.53 2.39 58.49 1.57
Truck 0.00 0 -1.57 599.41 156.40 629.75 189.25 2.85 2.63 12.34 0.47 1.49 69.44 -1.56
Pedestrian 0.00 0 -0.20 712.40 143.00 810.73 307.92 1.89 0.48 1.20 1.84 1.47 8.41 0.01
Person_sitting 0.30 2 0.20 700.00 150.00 720.00 200.00 1.20 0.60 0.80 2.00 1.50 10.00 0.00
Cyclist 0.00 3 -1.65 676.60 163.95 688.98 193.93 1.86 0.60 2.02 4.59 1.32 45.84 -1.55
Tram 0.00 0 0.50 100.00 150.00 300.00 250.00 3.50 2.60 16.00 -10.00 1.80 30.00 0.40
Misc 0.00 0 0.10 500.00 170.00 520.00 190.00 1.00 1.00 1.00 5.00 1.60 40.00 0.20
DontCare -1 -1 -10 503.89 169.71 590.61 190.13 -1 -1 -1 -1000 -1000 -1000 -10
"""


def _root(tmp_path, n=3, calib=None, labels=LABEL_TEXT):
    calib = calib or make_calib()
    for d in ("velodyne", "label_2", "calib"):
        (tmp_path / "training" / d).mkdir(parents=True, exist_ok=True)
    (tmp_path / "ImageSets").mkdir(exist_ok=True)
    ids = [f"{i:06d}" for i in range(n)]
    rng = np.random.default_rng(0)
    for i in ids:
        write_points(tmp_path / "training/velodyne" / f"{i}.bin", rng.normal(size=(100, 4)).astype(np.float32))
        (tmp_path / "training/label_2" / f"{i}.txt").write_text(labels)
        calib.to_file(tmp_path / "training/calib" / f"{i}.txt")
    write_imageset(tmp_path / "ImageSets/train.txt", ids)
    return tmp_path, ids


# --- labels -------------------------------------------------------------------------------------
def test_label_every_class_and_round_trip(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text(LABEL_TEXT)
    lab = read_label(p)
    assert list(lab.name) == list(OBJECT_TYPES)
    assert lab.score is None
    assert lab.occluded.tolist() == [0, 1, 0, 0, 2, 3, 0, 0, -1]
    np.testing.assert_allclose(lab.bbox[0], [587.01, 173.33, 614.12, 200.12], atol=1e-4)
    np.testing.assert_allclose(lab.dimensions[2], [2.85, 2.63, 12.34], atol=1e-5)
    write_label(tmp_path / "b.txt", lab)
    assert (tmp_path / "b.txt").read_text() == LABEL_TEXT.replace("-1 -1 -10 503.89", "-1.00 -1 -10.00 503.89").replace(
        "-1 -1 -1 -1000 -1000 -1000 -10\n", "-1.00 -1.00 -1.00 -1000.00 -1000.00 -1000.00 -10.00\n")


def test_result_file_with_scores_round_trip(tmp_path, calib):
    boxes = Boxes3D(torch.tensor([[10.0, 1.0, -0.8, 4.0, 1.7, 1.5, 0.3], [25.0, -3.0, -0.9, 3.8, 1.6, 1.4, -2.0]]))
    lab = boxes_to_labels(boxes, np.array(["Car", "Car"]), calib, scores=np.array([0.9, 0.25]))
    write_label(tmp_path / "r.txt", lab)
    back = read_label(tmp_path / "r.txt", with_score=True)
    np.testing.assert_allclose(back.score, [0.9, 0.25], atol=1e-4)
    np.testing.assert_allclose(back.location, lab.location, atol=0.006)
    np.testing.assert_allclose(back.bbox, lab.bbox, atol=0.006)
    with pytest.raises(KittiFormatError, match="16th"):
        read_label(tmp_path / "r.txt", with_score=False)


def test_empty_label_file_is_a_frame_without_objects(tmp_path):
    (tmp_path / "e.txt").write_text("")
    lab = read_label(tmp_path / "e.txt")
    assert len(lab) == 0 and lab.bbox.shape == (0, 4)
    write_label(tmp_path / "f.txt", lab)
    assert (tmp_path / "f.txt").read_text() == ""


@pytest.mark.parametrize(
    "line, match",
    [
        ("Car 0.00 0 -1.58 587.01 173.33 614.12 200.12 1.65 1.67 3.64 -0.65 1.71 46.70", "expected 15 fields"),
        ("Car 0.00 0 -1.58 587.01 173.33 614.12 200.12 1.65 1.67 3.64 -0.65 1.71 46.70 -1.59 0.5 7", "got 17"),
        ("Bus 0.00 0 -1.58 587.01 173.33 614.12 200.12 1.65 1.67 3.64 -0.65 1.71 46.70 -1.59",
         "unknown object type 'Bus'"),
        ("Car 0.00 0 -1.58 587.01 173.33 614.12 200.12 1.65 1.67 3.64 -0.65 1.71 46.70 nan", "NaN"),
        ("Car 0.00 0 -1.58 587.01 173.33 614.12 200.12 1.65 -1.67 3.64 -0.65 1.71 46.70 -1.59", "negative box size"),
        ("Car 0.00 x -1.58 587.01 173.33 614.12 200.12 1.65 1.67 3.64 -0.65 1.71 46.70 -1.59", "non-numeric"),
    ],
)
def test_malformed_label_line_names_file_and_line(tmp_path, line, match):
    p = tmp_path / "bad.txt"
    p.write_text(LABEL_TEXT.splitlines()[0] + "\n" + line + "\n")
    with pytest.raises(KittiFormatError, match=match) as e:
        read_label(p)
    assert str(e.value).startswith(f"{p}:2:")


# --- boxes and calibration -----------------------------------------------------------------------
@pytest.mark.parametrize("rot", [0.0, 1.5])
def test_label_boxes_label_round_trip(calib, rot):
    calib = make_calib(rot)
    rng = np.random.default_rng(1)
    n = 50
    t = np.column_stack([rng.uniform(5, 60, n), rng.uniform(-20, 20, n), rng.uniform(-1.5, 0, n),
                         rng.uniform(3, 5, n), rng.uniform(1.4, 2, n), rng.uniform(1.3, 1.8, n),
                         rng.uniform(-np.pi, np.pi, n)])
    boxes = Boxes3D(torch.from_numpy(t))
    lab = boxes_to_labels(boxes, np.array(["Car"] * n), calib)
    back = boxes_from_camera(*boxes_to_camera(boxes, calib), calib)
    np.testing.assert_allclose(back.numpy()[:, :6], t[:, :6], atol=1e-9)
    d = np.angle(np.exp(1j * (back.numpy()[:, 6] - t[:, 6])))
    np.testing.assert_allclose(d, 0, atol=1e-9)
    # through float32 records (what a file holds before rounding)
    back32 = labels_to_boxes(lab, calib).numpy()
    np.testing.assert_allclose(back32[:, :6], t[:, :6], atol=2e-5 * 60)


def test_rotation_convention(calib):
    # A box heading straight forward (yaw 0) in the LiDAR frame has rotation_y = -pi/2 in KITTI.
    boxes = Boxes3D(torch.tensor([[10.0, 0.0, 0.0, 4.0, 1.6, 1.5, 0.0], [10.0, 0.0, 0.0, 4.0, 1.6, 1.5, math.pi / 2]]))
    loc, dims, ry = boxes_to_camera(boxes, calib)
    np.testing.assert_allclose(np.cos(ry), [0, -1], atol=1e-7)
    np.testing.assert_allclose(np.sin(ry), [-1, 0], atol=1e-7)
    np.testing.assert_allclose(dims[0], [1.5, 1.6, 4.0])
    # bottom centre: 0.75 m below the centre; camera 0.08 m below the LiDAR and 0.27 m ahead
    np.testing.assert_allclose(loc[0], [0.0, 0.75 - 0.08, 10.0 - 0.27], atol=1e-12)


def test_calibration_transforms(calib, tmp_path):
    rng = np.random.default_rng(0)
    pts = rng.uniform(-50, 50, size=(100, 3))
    np.testing.assert_allclose(calib.rect_to_lidar(calib.lidar_to_rect(pts)), pts, atol=1e-10)
    # hand-computed projection: LiDAR (10.27, -1, 0.5-0.08) -> rect (1, -0.5, 10) -> image
    uv, depth = calib.lidar_to_image(np.array([[10.27, -1.0, 0.42]]))
    assert depth[0] == pytest.approx(10.0 + 0.0)  # P2 row 3 = (0, 0, 1, 0)
    np.testing.assert_allclose(uv[0], [610 + 720 * (1 + 0.06) / 10, 175 + 720 * (-0.5) / 10])
    rect = calib.lidar_to_rect(pts[:5])
    uv, d = calib.rect_to_image(rect)
    np.testing.assert_allclose(calib.image_to_rect(uv, d), rect, atol=1e-8)
    calib.to_file(tmp_path / "c.txt")
    c2 = Calibration.from_file(tmp_path / "c.txt")
    for k in ("P0", "P1", "P2", "P3", "R0_rect", "Tr_velo_to_cam", "Tr_imu_to_velo"):
        np.testing.assert_allclose(getattr(c2, k), getattr(calib, k), rtol=1e-12, atol=1e-15)  # KITTI writes %.12e


def test_calibration_transforms_are_the_matrix_products(calib):
    """The transforms are R0_rect · Tr_velo_to_cam and P2 applied to [x, y, z, 1], whatever the input's dtype
    and strides (the data loader passes the xyz columns of a float32 [N, 4] cloud)."""
    rng = np.random.default_rng(1)
    cloud = rng.uniform(-60, 60, size=(1000, 4)).astype(np.float32)
    xyz1 = np.column_stack([cloud[:, :3].astype(np.float64), np.ones(len(cloud))])
    velo_to_cam = np.vstack([calib.Tr_velo_to_cam, [0, 0, 0, 1]])
    rect = (calib.R0_rect @ velo_to_cam[:3]) @ xyz1.T
    np.testing.assert_allclose(calib.lidar_to_rect(cloud[:, :3]), rect.T, rtol=1e-12, atol=1e-9)
    h = calib.P2 @ np.vstack([rect, np.ones(len(cloud))])
    uv, depth = calib.lidar_to_image(cloud[:, :3])
    np.testing.assert_allclose(depth, h[2], rtol=1e-12, atol=1e-9)
    front = h[2] > 1.0
    np.testing.assert_allclose(uv[front], (h[:2] / h[2]).T[front], rtol=1e-10)
    np.testing.assert_allclose(calib.rect_to_lidar(rect.T), cloud[:, :3], atol=1e-5)


def test_calibration_missing_matrix(tmp_path, calib):
    calib.to_file(tmp_path / "c.txt")
    lines = (tmp_path / "c.txt").read_text().splitlines()
    (tmp_path / "c.txt").write_text("\n".join(line for line in lines if not line.startswith("Tr_velo_to_cam")))
    with pytest.raises(KittiFormatError, match="missing matrix Tr_velo_to_cam") as e:
        Calibration.from_file(tmp_path / "c.txt")
    assert str(tmp_path / "c.txt") in str(e.value)
    (tmp_path / "d.txt").write_text("\n".join(lines[:2] + ["P2: 1 2 3"] + lines[3:]))
    with pytest.raises(KittiFormatError, match=r"d.txt:3: P2 needs 12 numbers, got 3"):
        Calibration.from_file(tmp_path / "d.txt")


def test_projection_clips_to_image_and_handles_boxes_behind(calib):
    boxes = Boxes3D(torch.tensor([
        [20.0, 0.0, -0.9, 4.0, 1.7, 1.5, 0.0],     # fully visible
        [3.0, 4.0, -0.9, 4.0, 1.7, 1.5, 0.0],      # truncated at the left border
        [-20.0, 0.0, -0.9, 4.0, 1.7, 1.5, 0.0],    # behind the camera
        [0.5, -1.0, -0.9, 4.0, 1.7, 1.5, 0.0],     # straddles the camera plane
    ], dtype=torch.float64))
    bbox, vis = project_to_image(boxes, calib)
    assert vis.tolist() == [True, True, False, True]
    assert (bbox[:, [0, 2]] >= 0).all() and (bbox[:, [0, 2]] <= 1241).all()
    assert (bbox[:, [1, 3]] >= 0).all() and (bbox[:, [1, 3]] <= 374).all()
    assert bbox[1, 0] == 0.0 and bbox[3, 2] == 1241.0
    # fully visible box: the 2D box is exactly the min/max of the projected corners
    uv, _ = calib.lidar_to_image(boxes[0].corners().numpy()[0])
    np.testing.assert_allclose(bbox[0], [*uv.min(0), *uv.max(0)])


def test_points_in_boxes():
    boxes = Boxes3D(torch.tensor([[0.0, 0.0, 0.0, 4.0, 2.0, 2.0, math.pi / 2]]))
    pts = torch.tensor([[0.0, 1.9, 0.0], [0.0, 2.1, 0.0], [0.9, 0.0, 0.0], [1.1, 0.0, 0.0], [0.0, 0.0, 1.0]])
    assert boxes.points_in_boxes(pts)[:, 0].tolist() == [True, False, True, False, True]
    corners = boxes.corners()[0]
    assert boxes.points_in_boxes(corners * 0.999).all()


def test_difficulty_levels():
    lab = read_label_from_text("""\
Car 0.00 0 0 0 100 10 140.5 1.5 1.6 4 0 1 10 0
Car 0.20 1 0 0 100 10 126 1.5 1.6 4 0 1 10 0
Car 0.40 2 0 0 100 10 126 1.5 1.6 4 0 1 10 0
Car 0.00 0 0 0 100 10 124 1.5 1.6 4 0 1 10 0
Car 0.60 0 0 0 100 10 200 1.5 1.6 4 0 1 10 0
""")
    assert difficulty(lab).tolist() == [0, 1, 2, -1, -1]


def read_label_from_text(text):
    from detector.data.kitti_labels import parse_label_lines

    return parse_label_lines(text.splitlines(), "mem")


# --- point clouds and roots ----------------------------------------------------------------------
def test_points_round_trip_and_bad_bins(tmp_path):
    pts = np.random.default_rng(0).normal(size=(37, 4)).astype(np.float32)
    write_points(tmp_path / "a.bin", pts)
    np.testing.assert_array_equal(read_points(tmp_path / "a.bin"), pts)
    (tmp_path / "t.bin").write_bytes(pts.tobytes()[:-3])
    with pytest.raises(KittiFormatError, match="truncated point cloud"):
        read_points(tmp_path / "t.bin")
    (tmp_path / "e.bin").write_bytes(b"")
    with pytest.raises(KittiFormatError, match="empty"):
        read_points(tmp_path / "e.bin")
    bad = pts.copy()
    bad[5, 1] = np.nan
    bad[9, 0] = np.inf
    write_points(tmp_path / "n.bin", bad)
    with pytest.raises(KittiFormatError, match=r"n.bin: 2 points with NaN or infinite values \(first: point 5\)"):
        read_points(tmp_path / "n.bin")


def test_root_reads_frames_and_collates(tmp_path):
    root, ids = _root(tmp_path)
    ds = KittiDataset(root, "train", fov_only=False)
    assert len(ds) == 3
    f = ds[1]
    assert f.frame_id == ids[1] and f.points.shape == (100, 4)
    assert list(f.gt_names) == [c for c in OBJECT_TYPES if c != "DontCare"]
    assert len(f.labels) == 9
    b = collate_frames([ds[0], ds[2]])
    assert b.points.shape == (200, 5) and b.points[:100, 0].eq(0).all() and b.points[100:, 0].eq(1).all()


def test_dataset_bad_frames_raise_or_skip(tmp_path):
    root, ids = _root(tmp_path, n=4)
    (root / "training/velodyne" / f"{ids[1]}.bin").write_bytes(b"\0" * 20)
    (root / "training/calib" / f"{ids[2]}.txt").unlink()
    write_imageset(root / "ImageSets/train.txt", ids + ["000099"])
    with pytest.raises(KittiFormatError, match="000001.bin: truncated"):
        KittiDataset(root, "train")
    ds = KittiDataset(root, "train", skip_bad_frames=True)
    assert ds.ids == [ids[0], ids[3]]
    assert [s[0] for s in ds.skipped] == [ids[1], ids[2], "000099"]
    assert "calibration file not found" in ds.skipped[1][1]
    assert "listed in ImageSets but has no point cloud" in ds.skipped[2][1]
    # a frame whose points turn bad after the check is replaced by the next one, and counted
    pts = np.full((10, 4), np.nan, np.float32)
    write_points(root / "training/velodyne" / f"{ids[0]}.bin", pts)
    assert ds[0].frame_id == ids[3] and ds.skipped[-1][0] == ids[0]


def test_dataset_cache_serves_the_same_frames_and_hands_out_own_arrays(tmp_path):
    root, ids = _root(tmp_path)
    plain = KittiDataset(root, "train", fov_only=False)
    cached = KittiDataset(root, "train", fov_only=False, cache_mb=1)
    for i in range(3):  # first loads fill the cache
        cached[i]
    assert len(cached._cache) == 3
    (root / "training/velodyne" / f"{ids[1]}.bin").unlink()
    with pytest.raises(KittiFormatError, match="000001.bin"):
        plain[1]
    f = cached[1]  # held in memory: its files are not read again
    f0 = plain[0]
    c0 = cached[0]
    np.testing.assert_array_equal(c0.points, f0.points)
    assert torch.equal(c0.gt_boxes.tensor, f0.gt_boxes.tensor) and list(c0.gt_names) == list(f0.gt_names)
    assert len(c0.labels) == len(f0.labels) and f.frame_id == ids[1] and f.points.shape == (100, 4)
    # writing into what one load returned changes nothing the next load returns
    c0.points[:] = 0
    c0.gt_boxes.tensor[:] = 0
    c0.gt_names[:] = "X"
    again = cached[0]
    np.testing.assert_array_equal(again.points, f0.points)
    assert torch.equal(again.gt_boxes.tensor, f0.gt_boxes.tensor) and list(again.gt_names) == list(f0.gt_names)


def test_dataset_cache_keeps_to_its_budget(tmp_path):
    root, ids = _root(tmp_path, n=4)
    one = 100 * 4 * 4 + 8 * 7 * 4 + 4096  # a frame's points, its 8 boxes, the allowance for the rest
    ds = KittiDataset(root, "train", fov_only=False, cache_mb=2.5 * one / 2**20)
    frames = [ds[i] for i in range(4)]
    assert list(ds._cache) == ids[:2] and ds._cached == 2 * one  # the first two fit, the others are read each time
    assert [f.frame_id for f in frames] == ids
    assert len(KittiDataset(root, "train", fov_only=False)._cache) == 0  # off by default
    for bad in (-1, "512", True):
        with pytest.raises(ValueError, match="data.cache_mb"):
            KittiDataset(root, "train", cache_mb=bad)


def test_imageset_and_road_map(tmp_path):
    (tmp_path / "s.txt").write_text("000001\nabc\n")
    with pytest.raises(KittiFormatError, match=r"s.txt:2: frame id must be digits"):
        read_imageset(tmp_path / "s.txt")
    raster = np.zeros((40, 30), bool)
    raster[10:20, 5:25] = True
    write_road_map(tmp_path / "000000.png", RoadMap(raster, 0.0, -4.0, 0.2))
    rm = read_road_map(tmp_path / "000000.png")
    np.testing.assert_array_equal(rm.raster, raster)
    assert (rm.x_min, rm.y_min, rm.resolution) == (0.0, -4.0, 0.2)


def test_road_map_missing_on_real_layout(tmp_path):
    root, _ = _root(tmp_path)
    with pytest.raises(KittiFormatError, match="real KITTI has none"):
        KittiDataset(root, "train", road_map=True)


# --- real KITTI ----------------------------------------------------------------------------------
def test_real_kitti_frames(kitti_real):
    root = KittiRoot(kitti_real)
    n_cars = 0
    for fid in ("000000", "000001", "000002", "000003"):
        f = root.read_frame(fid)
        assert f.points.shape[1] == 4 and len(f.points) > 100_000
        objs = f.labels.select(f.labels.name != "DontCare")
        inside = f.gt_boxes.points_in_boxes(f.points).sum(0).numpy()
        grown = f.gt_boxes.clone()
        grown.tensor[:, 3:5] += 0.6  # a 0.3 m shell around the sides (not below: that is ground)
        enlarged = grown.points_in_boxes(f.points).sum(0).numpy()
        bbox, vis = project_to_image(f.gt_boxes, f.calib)
        for k, name in enumerate(f.gt_names):
            if name != "Car":
                continue
            n_cars += 1
            # the car's points are inside its box: few points in a 0.3 m shell around it
            assert inside[k] >= 5 and inside[k] >= 0.75 * enlarged[k], (fid, k, inside[k], enlarged[k])
            # the projected 3D box agrees with the annotated 2D box
            assert vis[k]
            np.testing.assert_allclose(bbox[k], objs.bbox[k], atol=3.0)
    assert n_cars == 3


def test_camera_field_of_view(calib):
    from detector.data.kitti_camera import in_camera_fov

    pts = np.array([[10.0, 0.0, 0.0], [-10.0, 0.0, 0.0], [10.0, 30.0, 0.0], [10.0, -30.0, 0.0], [10.0, 0.0, 20.0],
                    [10.0, 8.0, 0.0]])
    assert in_camera_fov(pts, calib).tolist() == [True, False, False, False, False, True]


def test_dataset_keeps_field_of_view_points(tmp_path):
    root, ids = _root(tmp_path)
    pts = np.array([[10.0, 0.0, 0.0, 0.5], [-10.0, 0.0, 0.0, 0.5]], np.float32)
    write_points(root / "training/velodyne" / f"{ids[0]}.bin", pts)
    assert len(KittiDataset(root, "train")[0].points) == 1
    assert len(KittiDataset(root, "train", fov_only=False)[0].points) == 2


# --- bad real frames: labels, calibration, image size ------------------------------------------------
def _png_header(width: int, height: int) -> bytes:
    """The first bytes of a PNG: signature and IHDR chunk (8-bit RGB); all the reader looks at."""
    import struct
    import zlib

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + ihdr
            + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr)))


def test_frame_without_label_or_calib_names_the_file(tmp_path):
    root, ids = _root(tmp_path, n=3)
    (root / "training/label_2" / f"{ids[1]}.txt").unlink()
    with pytest.raises(KittiFormatError, match=r"label_2/000001.txt: label file not found"):
        KittiDataset(root, "train")
    with pytest.raises(KittiFormatError, match=r"label_2/000001.txt: label file not found"):
        KittiRoot(root).read_frame(ids[1])
    calib = root / "training/calib" / f"{ids[2]}.txt"
    calib.unlink()
    with pytest.raises(KittiFormatError, match=r"calib/000002.txt: calibration file not found"):
        KittiRoot(root).read_frame(ids[2])


def test_image_size_is_read_and_checked_against_the_calibration(tmp_path):
    """make_calib's P2 principal point is (610, 175): it fits KITTI's 1242x375 and 1224x370 images, not a
    half-size 621x188 image (610 > 3/4 of 621) nor a file that is not a PNG."""
    root, ids = _root(tmp_path, n=4)
    img = root / "training" / "image_2"
    img.mkdir()
    (img / f"{ids[0]}.png").write_bytes(_png_header(1242, 375))
    (img / f"{ids[1]}.png").write_bytes(_png_header(1224, 370))
    kroot = KittiRoot(root)
    assert kroot.read_frame(ids[0]).image_size == (1242, 375)
    assert kroot.read_frame(ids[1]).image_size == (1224, 370)
    # a root with images must have each frame's (its size sets the camera's view): frame 3's is missing
    with pytest.raises(KittiFormatError, match=r"image_2/000003.png: frame 000003 has no image"):
        kroot.read_frame(ids[3])
    (img / f"{ids[3]}.png").write_bytes(_png_header(1242, 375))
    (img / f"{ids[2]}.png").write_bytes(_png_header(621, 188))
    mismatch = r"image_2/000002.png: image size 621x188 does not match the calibration .*calib/000002.txt: "
    with pytest.raises(KittiFormatError, match=mismatch + r"P2's principal point \(610.0, 175.0\)"):
        kroot.read_frame(ids[2])
    with pytest.raises(KittiFormatError, match=r"image_2/000002.png: image size 621x188"):
        KittiDataset(root, "train")
    assert KittiDataset(root, "train", skip_bad_frames=True).ids == [ids[0], ids[1], ids[3]]
    (img / f"{ids[2]}.png").write_bytes(b"GIF89a" + bytes(30))
    with pytest.raises(KittiFormatError, match=r"000002.png: not a PNG image"):
        kroot.read_frame(ids[2])


def test_field_of_view_uses_the_frame_image_width(tmp_path):
    """A point projecting at u ~ 1233 px is inside a 1242 px wide image and outside a 1224 px wide one."""
    from detector.data.kitti_camera import in_camera_fov

    calib = make_calib()
    # at x = 20 m, u - u(y=0) is proportional to -y: scale a first guess to u = 1233
    u0, u1 = calib.lidar_to_image(np.array([[20.0, 0.0, 0.0], [20.0, -10.0, 0.0]]))[0][:, 0]
    y = -10.0 * (1233.0 - u0) / (u1 - u0)
    pts = np.array([[20.0, y, 0.0, 0.5], [20.0, 0.0, 0.0, 0.5]], np.float32)
    u = calib.lidar_to_image(pts[:, :3])[0][:, 0]
    assert 1224 < u[0] < 1242
    assert in_camera_fov(pts, calib, (1242, 375)).tolist() == [True, True]
    assert in_camera_fov(pts, calib, (1224, 370)).tolist() == [False, True]
    root, ids = _root(tmp_path, n=1)
    write_points(root / "training/velodyne" / f"{ids[0]}.bin", pts)
    (root / "training" / "image_2").mkdir()
    (root / "training/image_2" / f"{ids[0]}.png").write_bytes(_png_header(1224, 370))
    assert len(KittiDataset(root, "train")[0].points) == 1
    (root / "training/image_2" / f"{ids[0]}.png").write_bytes(_png_header(1242, 375))
    assert len(KittiDataset(root, "train")[0].points) == 2


def test_real_kitti_image_sizes_match_their_calibration(kitti_real):
    root = KittiRoot(kitti_real)
    sizes = {root.read_frame(p.stem).image_size for p in sorted((kitti_real / "training/velodyne").glob("*.bin"))}
    assert (1242, 375) in sizes and (1224, 370) in sizes  # real KITTI's image sizes vary


def test_training_on_a_root_without_labels_names_the_folder(tmp_path):
    import shutil

    from detector.data.datamodule import KittiDataModule
    from detector.geometry.voxelize import BevGrid

    root, _ = _root(tmp_path)
    shutil.rmtree(root / "training" / "label_2")
    dm = KittiDataModule(str(root), BevGrid((0.0, 25.6), (-12.8, 12.8), (-2.5, 1.0), 0.2, 0.5), num_workers=0,
                         train_split="train", val_split="train")
    assert len(dm.dataset("val")) == 3  # reading (e.g. to write result files) needs none
    with pytest.raises(KittiFormatError, match=r"training/label_2: training needs labels"):
        dm.dataset("train")
