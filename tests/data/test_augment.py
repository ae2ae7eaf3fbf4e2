"""Augmentation: points stay inside their boxes through every op, GT sampling pastes consistently and
without collisions, determinism by seed, road maps follow the global transforms, GT database cache."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from detector.data.augment import (
    Augmentor,
    BeamDropout,
    GlobalFlip,
    GlobalRotation,
    GlobalScaling,
    GroundTilt,
    GtSampling,
    IntensityJitter,
    ObjectNoise,
    ObjectPointDropout,
    bev_boxes_overlap,
    elevation_rings,
    tilt_matrix,
)
from detector.data.gt_database import GtDatabase, cache_path
from detector.data.kitti import KittiRoot, write_imageset, write_points
from detector.data.kitti_camera import boxes_to_labels
from detector.data.kitti_labels import read_label, write_label
from detector.data.road_map import RoadMap
from detector.data.structures import Frame
from detector.geometry.boxes import Boxes3D
from tests.conftest import make_calib
from tests.paths import CONFIGS

# Coordinates are stored as float32 (up to ~50 m here: ulp 3.8e-6 m); after a transform both the points
# and the boxes are rounded, so "inside" is checked with this slack.
FLOAT32_TOL = 1e-4


def make_scene(seed: int, n_boxes: int = 6, frame_id: str = "000000", road: RoadMap | None = None) -> Frame:
    """Cars on a 7 m lattice (no two boxes overlap), 60 points strictly inside each, ground points 2 cm
    under the boxes and clutter outside them. Reflectance = the point's id (exact in float32)."""
    rng = np.random.default_rng(seed)
    slots = [(x, y) for x in (8.0, 15.0, 22.0, 29.0) for y in (-7.0, 0.0, 7.0)]
    pick = rng.choice(len(slots), size=n_boxes, replace=False)
    t = np.zeros((n_boxes, 7))
    t[:, 0:2] = np.asarray(slots)[pick] + rng.uniform(-0.5, 0.5, (n_boxes, 2))
    t[:, 3] = rng.uniform(3.5, 4.5, n_boxes)
    t[:, 4] = rng.uniform(1.5, 1.9, n_boxes)
    t[:, 5] = rng.uniform(1.4, 1.7, n_boxes)
    t[:, 2] = -1.73 + t[:, 5] / 2
    t[:, 6] = rng.uniform(-math.pi, math.pi, n_boxes)
    boxes = Boxes3D(torch.from_numpy(t).float())
    local = rng.uniform(-0.48, 0.48, (n_boxes, 60, 3)) * t[:, None, 3:6]
    c, s = np.cos(t[:, 6])[:, None], np.sin(t[:, 6])[:, None]
    lx, ly = local[..., 0], local[..., 1]
    obj = np.stack([lx * c - ly * s, lx * s + ly * c, local[..., 2]], -1)
    obj = (obj + t[:, None, 0:3]).reshape(-1, 3)
    ground = np.column_stack([rng.uniform(0, 40, 1500), rng.uniform(-15, 15, 1500), np.full(1500, -1.75)])
    clutter = np.column_stack(
        [rng.uniform(0, 40, 1500), rng.uniform(-15, 15, 1500), rng.uniform(-1.7, 1.0, 1500)])
    clutter = clutter[~boxes.points_in_boxes(clutter, margin=0.3).numpy().any(1)]
    xyz = np.concatenate([obj, ground, clutter])
    pts = np.column_stack([xyz, np.arange(len(xyz))]).astype(np.float32)
    names = np.array(["Car"] * n_boxes, dtype="<U16")
    return Frame(frame_id, pts, make_calib(), boxes, names, None, road)


def check_points_stay_in_boxes(before: Frame, after: Frame, n_orig: int) -> None:
    """Per object, the points inside its box before (by id) are in the output and inside its box after."""
    inside = before.gt_boxes.points_in_boxes(before.points).numpy()
    ids_after = after.points[:, 3].astype(np.int64)
    pos = {int(i): k for k, i in enumerate(ids_after)}
    for j in range(n_orig):
        ids = before.points[inside[:, j], 3].astype(np.int64)
        assert len(ids) > 0
        assert all(int(i) in pos for i in ids), f"object {j} lost points"
        p = after.points[[pos[int(i)] for i in ids]]
        ok = after.gt_boxes[j].points_in_boxes(p, margin=FLOAT32_TOL).numpy()[:, 0]
        assert ok.all(), f"object {j}: {int((~ok).sum())} of its points left its box"
    yaw = after.gt_boxes.yaw.numpy()
    assert ((yaw >= -math.pi) & (yaw < math.pi)).all()


# --------------------------------------------------------------------------------------------------
# Sim-to-real ops
# --------------------------------------------------------------------------------------------------
RING_ELEVATIONS = np.array([-20.0, -12.0, -8.0, -5.0, -3.0, -1.0, 0.5, 2.0])  # degrees, 8 rings


def make_rings(points_per_ring: int = 200) -> Frame:
    """Points on 8 rings at the elevations above, at ranges 5-40 m and all azimuths; reflectance = point id."""
    rng = np.random.default_rng(0)
    el = np.deg2rad(np.repeat(RING_ELEVATIONS, points_per_ring))
    az = rng.uniform(-math.pi, math.pi, len(el))
    r = rng.uniform(5, 40, len(el))
    xyz = np.column_stack([r * np.cos(el) * np.cos(az), r * np.cos(el) * np.sin(az), r * np.sin(el)])
    pts = np.column_stack([xyz, np.arange(len(xyz))]).astype(np.float32)
    return Frame("000000", pts, make_calib())


def test_elevation_rings_number_rings_from_the_lowest():
    frame = make_rings(50)
    ring = elevation_rings(frame.points)
    np.testing.assert_array_equal(ring, np.repeat(np.arange(8), 50))
    assert len(elevation_rings(np.zeros((0, 4), np.float32))) == 0


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_beam_dropout_removes_exactly_the_chosen_rings(seed):
    """A share of 0.25 of 8 rings: exactly 2 whole rings go, every point of the other 6 stays, in order."""
    frame = make_rings()
    out = BeamDropout(prob=1.0, min_fraction=0.25, max_fraction=0.25)(frame, np.random.default_rng(seed))
    ring_of_id = np.repeat(np.arange(8), 200)
    ids = out.points[:, 3].astype(np.int64)
    kept = set(ring_of_id[ids].tolist())
    assert len(kept) == 6
    expected = np.flatnonzero(np.isin(ring_of_id, sorted(kept)))  # whole rings kept, nothing else
    np.testing.assert_array_equal(ids, expected)
    np.testing.assert_array_equal(out.points, frame.points[expected])
    assert len(out.gt_boxes) == len(frame.gt_boxes)
    # different seeds choose different rings
    chosen = {frozenset(set(range(8)) - set(ring_of_id[BeamDropout(1.0, 0.25, 0.25)(
        frame, np.random.default_rng(s)).points[:, 3].astype(np.int64)].tolist())) for s in range(8)}
    assert len(chosen) > 1


def test_beam_dropout_off_and_bad_arguments():
    frame = make_rings()
    assert BeamDropout(prob=0.0, max_fraction=1.0)(frame, np.random.default_rng(0)) is frame
    assert len(BeamDropout(prob=1.0, min_fraction=0.0, max_fraction=0.0)(frame, np.random.default_rng(0)).points) \
        == len(frame.points)
    for kw in ({"prob": 1.5}, {"min_fraction": 0.5, "max_fraction": 0.2}, {"max_fraction": 1.5},
               {"min_gap_deg": 0.0}):
        with pytest.raises(ValueError, match="BeamDropout"):
            BeamDropout(**kw)


def test_intensity_jitter_scales_reflectance_only():
    frame = make_scene(0)
    frame.points[:, 3] = np.linspace(0, 1, len(frame.points), dtype=np.float32)
    out = IntensityJitter(prob=1.0, min_scale=0.5, max_scale=0.5, noise_std=0.0)(frame, np.random.default_rng(0))
    np.testing.assert_array_equal(out.points[:, :3], frame.points[:, :3])
    np.testing.assert_allclose(out.points[:, 3], frame.points[:, 3] * 0.5, rtol=1e-6)
    assert torch.equal(out.gt_boxes.tensor, frame.gt_boxes.tensor)
    up = IntensityJitter(prob=1.0, min_scale=2.0, max_scale=2.0, noise_std=0.0)(frame, np.random.default_rng(0))
    np.testing.assert_allclose(up.points[:, 3], np.minimum(frame.points[:, 3] * 2.0, 1.0), rtol=1e-6)  # clipped
    noisy = IntensityJitter(prob=1.0, min_scale=1.0, max_scale=1.0, noise_std=0.05)(frame, np.random.default_rng(0))
    d = noisy.points[:, 3] - frame.points[:, 3]
    inner = (frame.points[:, 3] > 0.25) & (frame.points[:, 3] < 0.75)  # far from the clip
    assert abs(float(d[inner].std()) - 0.05) < 0.005 and abs(float(d[inner].mean())) < 0.005
    assert (noisy.points[:, 3] >= 0).all() and (noisy.points[:, 3] <= 1).all()
    assert IntensityJitter(prob=0.0)(frame, np.random.default_rng(0)) is frame


def test_tilt_matrix_known_answers():
    np.testing.assert_allclose(tilt_matrix(0.0, 0.0), np.eye(3))
    # pitch +90°: x (forward) goes to -z (down), z to +x; roll +90°: y (left) goes to +z
    np.testing.assert_allclose(tilt_matrix(0.0, math.pi / 2) @ [1, 0, 0], [0, 0, -1], atol=1e-12)
    np.testing.assert_allclose(tilt_matrix(math.pi / 2, 0.0) @ [0, 1, 0], [0, 0, 1], atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ground_tilt_keeps_points_in_their_moved_boxes_and_tilts_the_ground(seed):
    frame = make_scene(seed)
    op = GroundTilt(prob=1.0, max_angle=0.05)
    out = op(frame, np.random.default_rng(seed))
    check_points_stay_in_boxes(frame, out, len(frame.gt_boxes))
    assert len(out.points) == len(frame.points)
    np.testing.assert_array_equal(out.points[:, 3], frame.points[:, 3])
    # the same draws as the op: one uniform for prob, then roll and pitch
    rng = np.random.default_rng(seed)
    rng.random()
    rot = tilt_matrix(*rng.uniform(-0.05, 0.05, size=2))
    inside = frame.gt_boxes.points_in_boxes(frame.points).numpy().any(1)
    bg = frame.points[~inside, :3].astype(np.float64)
    np.testing.assert_allclose(out.points[~inside, :3], bg @ rot.T, atol=1e-4)  # background rotated
    np.testing.assert_allclose(out.gt_boxes.tensor[:, :3].numpy(), frame.gt_boxes.tensor[:, :3].double().numpy()
                               @ rot.T, atol=1e-4)  # centres rotated
    np.testing.assert_array_equal(out.gt_boxes.tensor[:, 3:].numpy(), frame.gt_boxes.tensor[:, 3:].numpy())
    # the ground plane z = -1.75 is no longer level: its fitted slope is the tilt's
    ground = np.isclose(frame.points[:, 2], -1.75) & ~inside
    g = out.points[ground, :3].astype(np.float64)
    a, *_ = np.linalg.lstsq(np.column_stack([g[:, :2], np.ones(len(g))]), g[:, 2], rcond=None)
    normal = rot @ [0.0, 0.0, 1.0]
    np.testing.assert_allclose(a[:2], -normal[:2] / normal[2], atol=1e-4)
    assert GroundTilt(prob=0.0)(frame, np.random.default_rng(0)) is frame
    with pytest.raises(ValueError, match="GroundTilt.max_angle"):
        GroundTilt(max_angle=1.0)


@pytest.mark.parametrize("seed", [0, 1])
def test_object_point_dropout_thins_objects_only(seed):
    """Share 0.5 for every object: each box keeps exactly n - floor(n/2) of its points, a random half;
    every background point stays, in order."""
    frame = make_scene(seed)
    out = ObjectPointDropout(prob=1.0, min_fraction=0.5, max_fraction=0.5)(frame, np.random.default_rng(seed))
    inside = frame.gt_boxes.points_in_boxes(frame.points).numpy()
    ids = set(out.points[:, 3].astype(np.int64).tolist())
    for j in range(len(frame.gt_boxes)):
        own = frame.points[inside[:, j], 3].astype(np.int64)
        kept = [i for i in own if int(i) in ids]
        assert len(kept) == len(own) - len(own) // 2, j
    bg = frame.points[~inside.any(1), 3].astype(np.int64)
    assert set(bg.tolist()) <= ids
    order = out.points[:, 3]
    assert (np.diff(order) > 0).all()  # order kept
    assert torch.equal(out.gt_boxes.tensor, frame.gt_boxes.tensor)
    none = ObjectPointDropout(prob=0.0, max_fraction=1.0)(frame, np.random.default_rng(0))
    assert none is frame
    with pytest.raises(ValueError, match="ObjectPointDropout"):
        ObjectPointDropout(min_fraction=0.6, max_fraction=0.5)


def test_sim2real_experiment_composes_and_keeps_points_in_boxes(tmp_path):
    """configs/experiment/sim2real.yaml instantiates the ops in its documented order; on a scene (with its own
    GT database) the whole chain keeps the objects' remaining points in their boxes."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.utils import instantiate

    write_root(tmp_path)
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        cfg = compose("train", overrides=["experiment=sim2real", f"data.root={tmp_path}"])
    aug = instantiate(cfg.data.augment)
    assert [type(op).__name__ for op in aug.ops] == [
        "GtSampling", "BeamDropout", "ObjectPointDropout", "ObjectNoise", "IntensityJitter", "GroundTilt",
        "GlobalFlip", "GlobalRotation", "GlobalScaling"]
    # reflectance carries the point ids here: leave IntensityJitter (tested above; it moves no point) out
    aug.ops = [op for op in aug.ops if not isinstance(op, IntensityJitter)]
    frame = make_scene(4, frame_id="000098")
    for seed in range(3):
        out = aug(frame, np.random.default_rng(seed))
        inside = out.gt_boxes.points_in_boxes(out.points, margin=FLOAT32_TOL).numpy()
        before = frame.gt_boxes.points_in_boxes(frame.points).numpy()
        ids_out = out.points[:, 3].astype(np.int64)
        for j in range(len(frame.gt_boxes)):  # an original object's surviving points are in its box
            own = set(frame.points[before[:, j], 3].astype(np.int64).tolist())
            mine = np.isin(ids_out, sorted(own)) & (ids_out < len(frame.points))
            assert inside[mine, j].all()


# --------------------------------------------------------------------------------------------------
# Collision test
# --------------------------------------------------------------------------------------------------
def test_bev_overlap_known_answers():
    sq = [0.0, 0.0, 1.0, 1.0, 0.0]
    cases = [
        ([0.9, 0.0, 1.0, 1.0, 0.0], True),
        ([1.1, 0.0, 1.0, 1.0, 0.0], False),
        ([1.0, 0.0, 1.0, 1.0, 0.0], True),  # touching counts
        ([1.1, 1.1, 1.0, 1.0, math.pi / 4], False),  # bounding boxes overlap, shapes do not
        ([0.95, 0.95, 1.0, 1.0, math.pi / 4], False),  # overlap iff c·√2 − 0.5 <= √2/2, c <= 0.854
        ([0.84, 0.84, 1.0, 1.0, math.pi / 4], True),
        ([0.0, 3.0, 8.0, 0.5, math.pi / 2], True),  # long thin box reaching down
        ([0.0, 4.6, 8.0, 0.5, math.pi / 2], False),
    ]
    for other, expected in cases:
        got = bev_boxes_overlap(np.array([sq]), np.array([other]))
        assert got.shape == (1, 1) and bool(got[0, 0]) == expected, other
        assert bool(bev_boxes_overlap(np.array([other]), np.array([sq]))[0, 0]) == expected  # symmetric
    assert bev_boxes_overlap(np.zeros((0, 5)), np.array([sq])).shape == (0, 1)


def test_bev_overlap_agrees_with_dense_sampling():
    rng = np.random.default_rng(1)
    a = np.column_stack([rng.uniform(-3, 3, (40, 2)), rng.uniform(0.5, 4, (40, 2)), rng.uniform(-3, 3, 40)])
    b = np.column_stack([rng.uniform(-3, 3, (30, 2)), rng.uniform(0.5, 4, (30, 2)), rng.uniform(-3, 3, 30)])
    sat = bev_boxes_overlap(a, b)
    u = np.linspace(-0.5, 0.5, 41)
    grid = np.stack(np.meshgrid(u, u, indexing="ij"), -1).reshape(-1, 2)
    for i in range(len(a)):
        la = grid * a[i, 2:4]
        c, s = math.cos(a[i, 4]), math.sin(a[i, 4])
        pa = np.column_stack([la[:, 0] * c - la[:, 1] * s, la[:, 0] * s + la[:, 1] * c]) + a[i, :2]
        for j in range(len(b)):
            d = pa - b[j, :2]
            c2, s2 = math.cos(b[j, 4]), math.sin(b[j, 4])
            lx, ly = d[:, 0] * c2 + d[:, 1] * s2, -d[:, 0] * s2 + d[:, 1] * c2
            sampled = ((np.abs(lx) <= b[j, 2] / 2) & (np.abs(ly) <= b[j, 3] / 2)).any()
            if sampled:
                assert sat[i, j], (i, j)
    assert 0 < sat.mean() < 1


# --------------------------------------------------------------------------------------------------
# Each op keeps points inside boxes
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "op",
    [GlobalFlip(prob=1.0), GlobalRotation(max_angle=math.pi), GlobalScaling(0.8, 1.2),
     ObjectNoise(translation_std=(1.0, 1.0, 0.2), max_rotation=math.pi / 4)],
    ids=["flip", "rotation", "scaling", "object_noise"],
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_op_keeps_points_in_boxes(op, seed):
    frame = make_scene(seed)
    before_pts, before_boxes = frame.points.copy(), frame.gt_boxes.tensor.clone()
    out = op(frame, np.random.default_rng(seed))
    check_points_stay_in_boxes(frame, out, len(frame.gt_boxes))
    assert np.array_equal(frame.points, before_pts) and torch.equal(frame.gt_boxes.tensor, before_boxes)
    assert out.labels is None and len(out.gt_names) == len(out.gt_boxes)
    assert out.points.dtype == np.float32 and out.gt_boxes.tensor.dtype == torch.float32
    if not isinstance(op, ObjectNoise):
        assert len(out.points) == len(frame.points)  # global ops keep every point, in order
        np.testing.assert_array_equal(out.points[:, 3], frame.points[:, 3])


def test_global_ops_known_answers():
    frame = make_scene(3)
    f = GlobalFlip(prob=1.0)(frame, np.random.default_rng(0))
    np.testing.assert_array_equal(f.points[:, 1], -frame.points[:, 1])
    np.testing.assert_allclose(f.gt_boxes.yaw.numpy(), -frame.gt_boxes.yaw.numpy(), atol=1e-6)
    assert GlobalFlip(prob=0.0)(frame, np.random.default_rng(0)) is frame
    s = GlobalScaling(2.0, 2.0)(frame, np.random.default_rng(0))
    np.testing.assert_allclose(s.points[:, :3], frame.points[:, :3] * 2, rtol=1e-6)
    np.testing.assert_allclose(s.gt_boxes.tensor[:, :6], frame.gt_boxes.tensor[:, :6] * 2, rtol=1e-6)
    r = GlobalRotation(max_angle=0.0)(frame, np.random.default_rng(0))
    np.testing.assert_allclose(r.points, frame.points, atol=1e-6)


def test_object_noise_moves_objects_without_collisions():
    moved_any = False
    for seed in range(10):
        frame = make_scene(seed, n_boxes=10)
        op = ObjectNoise(translation_std=(2.0, 2.0, 0.1), max_rotation=math.pi / 2)
        out = op(frame, np.random.default_rng(seed))
        bev = out.gt_boxes.bev().double().numpy()
        ov = bev_boxes_overlap(bev, bev)
        np.fill_diagonal(ov, False)
        assert not ov.any()
        moved_any |= not torch.allclose(out.gt_boxes.tensor, frame.gt_boxes.tensor)
        # No background point was left inside a moved box.
        inside = out.gt_boxes.points_in_boxes(out.points).numpy().any(1)
        obj_ids = set(frame.points[frame.gt_boxes.points_in_boxes(frame.points).numpy().any(1), 3].tolist())
        assert set(out.points[inside, 3].tolist()) <= obj_ids
    assert moved_any


def test_object_noise_checks_each_move_against_the_moves_before_it():
    # Every slot of the lattice filled and moves of metres: an object's draw often lands where a neighbour
    # moved before it (its original place being free by then), so skipping that check, or missing a pair
    # that a large draw brings together, leaves overlapping boxes in some of these scenes.
    for seed in range(40):
        frame = make_scene(seed, n_boxes=12)
        out = ObjectNoise(translation_std=(3.0, 3.0, 0.1), max_rotation=math.pi)(frame, np.random.default_rng(seed))
        bev = out.gt_boxes.bev().double().numpy()
        ov = bev_boxes_overlap(bev, bev)
        np.fill_diagonal(ov, False)
        assert not ov.any(), seed


def test_object_noise_rejects_every_colliding_move():
    # A box walled in by four boxes 1 cm away: any move beyond 1 cm collides, so it must stay put.
    t = torch.tensor([
        [10.0, 0.0, -1.0, 4.0, 2.0, 1.5, 0.0],
        [14.01, 0.0, -1.0, 4.0, 2.0, 1.5, 0.0], [5.99, 0.0, -1.0, 4.0, 2.0, 1.5, 0.0],
        [10.0, 2.01, -1.0, 4.0, 2.0, 1.5, 0.0], [10.0, -2.01, -1.0, 4.0, 2.0, 1.5, 0.0],
    ])
    pts = np.array([[10.0, 0.0, -1.0, 0.0], [10.5, 0.3, -0.8, 1.0]], np.float32)
    frame = Frame("000000", pts, make_calib(), Boxes3D(t), np.array(["Car"] * 5, dtype="<U16"))
    op = ObjectNoise(translation_std=(1.0, 1.0, 0.0), max_rotation=0.3, num_tries=10)
    for seed in range(5):
        out = op(frame, np.random.default_rng(seed))
        assert torch.equal(out.gt_boxes.tensor[0], t[0])
        np.testing.assert_array_equal(out.points, pts)


# --------------------------------------------------------------------------------------------------
# GT sampling
# --------------------------------------------------------------------------------------------------
def database_from_frames(frames: list[Frame]) -> GtDatabase:
    boxes, names, fids, pts, counts = [], [], [], [], []
    for f in frames:
        inside = f.gt_boxes.points_in_boxes(f.points).numpy()
        for j in range(len(f.gt_boxes)):
            p = f.points[inside[:, j]].copy()
            p[:, 3] += 1_000_000  # pasted ids are distinct from the scene's
            pts.append(p)
            counts.append(len(p))
        boxes.append(f.gt_boxes.numpy())
        names.append(f.gt_names)
        fids.append(np.full(len(f.gt_boxes), f.frame_id, dtype="<U16"))
    return GtDatabase(
        np.concatenate(boxes).astype(np.float32), np.concatenate(names), np.zeros(len(counts), np.int8),
        np.concatenate(fids), np.concatenate(pts).astype(np.float32),
        np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
    )


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_gt_sampling_pastes_consistently(seed):
    db = database_from_frames([make_scene(100 + k, n_boxes=8, frame_id=f"{k + 1:06d}") for k in range(4)])
    frame = make_scene(seed, n_boxes=4)
    op = GtSampling(db, {"Car": 10}, min_points=5, max_difficulty=None)
    out = op(frame, np.random.default_rng(seed))
    n0 = len(frame.gt_boxes)
    n_new = len(out.gt_boxes) - n0
    assert n_new > 0 and len(out.gt_names) == len(out.gt_boxes)
    check_points_stay_in_boxes(frame, out, n0)
    assert torch.equal(out.gt_boxes.tensor[:n0], frame.gt_boxes.tensor)
    bev = out.gt_boxes.bev().double().numpy()
    ov = bev_boxes_overlap(bev, bev)
    np.fill_diagonal(ov, False)
    assert not ov.any(), "pasted boxes collide"
    pasted = out.gt_boxes[n0:]
    is_pasted = out.points[:, 3] >= 1_000_000
    inside = pasted.points_in_boxes(out.points).numpy()
    # Pasted points lie in their pasted box (exactly: they are the stored values), scene points do not.
    assert inside[is_pasted].any(1).all()
    assert not inside[~is_pasted].any()
    assert is_pasted.sum() == sum(int(db.num_points[k]) for k in range(len(db)) if any(
        torch.equal(torch.from_numpy(db.boxes[k]), b) for b in pasted.tensor))


def test_gt_sampling_filters_and_respects_road():
    frames = [make_scene(200 + k, n_boxes=8, frame_id=f"{k + 1:06d}") for k in range(3)]
    db = database_from_frames(frames)
    db.difficulty[:] = np.arange(len(db)) % 4 - 1  # -1, 0, 1, 2, ...
    op = GtSampling(db, {"Car": 5, "Pedestrian": 3}, min_points=61, max_difficulty=1)
    assert op.pool_size("Car") == 0 and op.pool_size("Pedestrian") == 0  # every object has 60 points
    op = GtSampling(db, {"Car": 5}, min_points=5, max_difficulty=1)
    assert op.pool_size("Car") == int(((db.difficulty >= 0) & (db.difficulty <= 1)).sum())
    # A frame whose road map is all non-drivable gets nothing pasted; an all-drivable one does.
    frame = make_scene(5, n_boxes=2, road=RoadMap(np.zeros((100, 100), bool), -10.0, -25.0, 0.5))
    op = GtSampling(db, {"Car": 8}, max_difficulty=None)
    assert op(frame, np.random.default_rng(0)) is frame
    frame.road_map = RoadMap(np.ones((100, 100), bool), -10.0, -25.0, 0.5)
    assert len(op(frame, np.random.default_rng(0)).gt_boxes) > 2
    assert len(GtSampling(db, {"Car": 8}, max_difficulty=None, require_road=False)(
        dataclass_replace_road(frame, np.zeros((100, 100), bool)), np.random.default_rng(0)).gt_boxes) > 2


def dataclass_replace_road(frame: Frame, raster: np.ndarray) -> Frame:
    import dataclasses

    return dataclasses.replace(frame, road_map=RoadMap(raster, -10.0, -25.0, 0.5))


# --------------------------------------------------------------------------------------------------
# Composition, determinism, road maps
# --------------------------------------------------------------------------------------------------
def full_augmentor(db: GtDatabase) -> Augmentor:
    return Augmentor([
        GtSampling(db, {"Car": 6}, max_difficulty=None),
        ObjectNoise(translation_std=(0.5, 0.5, 0.1), max_rotation=0.3),
        GlobalFlip(0.5), GlobalRotation(math.pi / 4), GlobalScaling(0.95, 1.05),
    ])


def test_augmentor_is_deterministic_and_consistent():
    db = database_from_frames([make_scene(300 + k, n_boxes=8, frame_id=f"{k + 1:06d}") for k in range(3)])
    aug = full_augmentor(db)
    frame = make_scene(7)
    a = aug(frame, np.random.default_rng(42))
    b = aug(frame, np.random.default_rng(42))
    c = aug(frame, np.random.default_rng(43))
    np.testing.assert_array_equal(a.points, b.points)
    assert torch.equal(a.gt_boxes.tensor, b.gt_boxes.tensor) and list(a.gt_names) == list(b.gt_names)
    assert not (a.points.shape == c.points.shape and np.array_equal(a.points, c.points))
    check_points_stay_in_boxes(frame, a, len(frame.gt_boxes))
    with pytest.raises(ValueError, match="numpy Generator"):
        aug(frame, 42)


@pytest.mark.parametrize("op", [GlobalFlip(1.0), GlobalRotation(math.pi), GlobalScaling(0.7, 1.3)])
def test_road_map_follows_global_ops(op):
    rng = np.random.default_rng(0)
    blocks = rng.random((12, 16)) < 0.5
    road = RoadMap(np.kron(blocks, np.ones((4, 4), bool)), x_min=-3.0, y_min=-10.0, resolution=0.25)
    # Points near the centres of the 1 m blocks: nearest resampling moves the raster by < 0.2 m.
    by, bx = np.meshgrid(np.arange(12), np.arange(16), indexing="ij")
    xy = np.column_stack([-3.0 + bx.ravel() + 0.5, -10.0 + by.ravel() + 0.5])
    xy += rng.uniform(-0.2, 0.2, (192, 2))
    pts = np.column_stack([xy, np.zeros(len(xy)), np.zeros(len(xy))]).astype(np.float32)
    frame = Frame("000000", pts, make_calib(), Boxes3D.empty(), np.zeros(0, "<U16"), None, road)
    for seed in range(4):
        out = op(frame, np.random.default_rng(seed))
        np.testing.assert_array_equal(out.road_map.lookup(out.points[:, 0], out.points[:, 1]), blocks.ravel())


# --------------------------------------------------------------------------------------------------
# GT database on disk
# --------------------------------------------------------------------------------------------------
def write_root(tmp_path, n_frames: int = 3):
    calib = make_calib()
    for d in ("velodyne", "label_2", "calib"):
        (tmp_path / "training" / d).mkdir(parents=True, exist_ok=True)
    (tmp_path / "ImageSets").mkdir(exist_ok=True)
    ids = []
    for k in range(n_frames):
        fid = f"{k:06d}"
        f = make_scene(400 + k, n_boxes=5, frame_id=fid)
        pts = f.points.copy()
        pts[:, 3] += 1_000_000 * (k + 1)  # point ids distinct from make_scene's other frames
        write_points(tmp_path / "training" / "velodyne" / f"{fid}.bin", pts)
        labels = boxes_to_labels(f.gt_boxes, f.gt_names, calib)
        write_label(tmp_path / "training" / "label_2" / f"{fid}.txt", labels)
        calib.to_file(tmp_path / "training" / "calib" / f"{fid}.txt")
        ids.append(fid)
    write_imageset(tmp_path / "ImageSets" / "train.txt", ids)
    return ids


def test_gt_database_build_cache_and_rebuild(tmp_path, monkeypatch):
    ids = write_root(tmp_path)
    monkeypatch.setenv("DETECTOR_CACHE_DIR", str(tmp_path / "xdg"))  # the default cache folder
    written = set(tmp_path.rglob("*"))
    db = GtDatabase.load_or_build(tmp_path, "train")
    assert set(tmp_path.rglob("*")) - set((tmp_path / "xdg").rglob("*")) == written | {tmp_path / "xdg"}
    path = cache_path(tmp_path, "train", ("Car", "Pedestrian", "Cyclist"))
    assert path.is_file() and path.is_relative_to(tmp_path / "xdg") and len(db) == 15
    # Each object's stored points are the frame's points inside its box.
    f = KittiRoot(tmp_path).read_frame(ids[0])
    k0 = int(np.flatnonzero(db.frame_ids == ids[0])[0])
    ref = f.points[f.gt_boxes[0].points_in_boxes(f.points).numpy()[:, 0]]
    np.testing.assert_array_equal(db.object_points(k0), ref)
    assert (db.num_points >= 55).all()
    with np.load(path, allow_pickle=False) as z:  # plain arrays, no pickle
        assert set(z.files) >= {"boxes", "names", "points", "offsets", "fingerprint"}
    # Cached: a second call does not rebuild.
    calls = []
    real_build = GtDatabase.build.__func__
    counted = classmethod(lambda cls, *a, **k: calls.append(1) or real_build(cls, *a, **k))
    monkeypatch.setattr(GtDatabase, "build", counted)
    db2 = GtDatabase.load_or_build(tmp_path, "train")
    assert calls == [] and np.array_equal(db2.points, db.points)
    # A changed source file is noticed and rebuilt.
    p = tmp_path / "training" / "velodyne" / f"{ids[1]}.bin"
    st = p.stat()
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    GtDatabase.load_or_build(tmp_path, "train")
    assert calls == [1]
    # A corrupt cache is rebuilt too, and load() names the file.
    path.write_bytes(b"not an npz")
    with pytest.raises(ValueError, match="not a valid GT database"):
        GtDatabase.load(path)
    GtDatabase.load_or_build(tmp_path, "train")
    assert calls == [1, 1]


def test_gt_database_difficulty_is_the_metrics_rule(tmp_path):
    """A 2D box exactly at a level's minimum height is below that level (the devkit's rule, R3)."""
    ids = write_root(tmp_path, n_frames=1)
    path = tmp_path / "training" / "label_2" / f"{ids[0]}.txt"
    labels = read_label(path)
    labels.bbox[:, 1] = 100
    labels.bbox[:, 3] = [140, 125, 140.5, 125.5, 110]  # heights 40, 25, 40.5, 25.5, 10 px
    write_label(path, labels)
    db = GtDatabase.build(KittiRoot(tmp_path), ids)
    assert db.difficulty.tolist() == [1, -1, 0, 1, -1]
    labels.occluded[:] = 2
    write_label(path, labels)
    assert GtDatabase.build(KittiRoot(tmp_path), ids).difficulty.tolist() == [2, -1, 2, 2, -1]


def test_real_kitti_gt_sampling(kitti_real, tmp_path):
    db = GtDatabase.load_or_build(kitti_real, frame_ids=["000000", "000001", "000002", "000003"],
                                  cache_dir=tmp_path)
    assert set(db.names) <= {"Car", "Pedestrian", "Cyclist"} and len(db) >= 4
    assert (db.num_points[db.names == "Car"] > 0).all()
    frame = KittiRoot(kitti_real).read_frame("000003")
    op = GtSampling(db, {"Car": 5, "Pedestrian": 5, "Cyclist": 5}, min_points=5, max_difficulty=None)
    out = Augmentor([op, ObjectNoise(), GlobalFlip(1.0), GlobalRotation(), GlobalScaling()])(
        frame, np.random.default_rng(0))
    assert len(out.gt_boxes) > len(frame.gt_boxes)
    before = frame.gt_boxes.points_in_boxes(frame.points).numpy().sum(0)
    after = out.gt_boxes.points_in_boxes(out.points, margin=FLOAT32_TOL).numpy().sum(0)
    assert (after[: len(before)] >= before).all()


def test_points_in_boxes_sparse_equals_dense():
    from detector.geometry.boxes import points_in_boxes_sparse

    frame = make_scene(11, n_boxes=8)
    # Add points exactly on box faces and corners (the borderline cases).
    corners = frame.gt_boxes.corners().reshape(-1, 3).numpy()
    centres = frame.gt_boxes.center.numpy()
    face = centres.copy()
    face[:, 2] += frame.gt_boxes.dims[:, 2].numpy() / 2
    extra = np.concatenate([corners, face])
    pts = np.concatenate([frame.points, np.column_stack([extra, np.zeros(len(extra))])]).astype(np.float32)
    dense = frame.gt_boxes.points_in_boxes(pts).numpy()
    sparse = points_in_boxes_sparse(pts, frame.gt_boxes)
    for j in range(len(frame.gt_boxes)):
        np.testing.assert_array_equal(sparse[j], np.flatnonzero(dense[:, j]))
    assert points_in_boxes_sparse(pts, Boxes3D.empty()) == []
    # Boxes3D.contains: the same test for chosen (point, box) pairs, bit for bit
    rng = np.random.default_rng(0)
    box = rng.integers(0, len(frame.gt_boxes), len(pts))
    np.testing.assert_array_equal(frame.gt_boxes.contains(pts, box).numpy(), dense[np.arange(len(pts)), box])


def test_points_in_boxes_sparse_far_overlapping_and_bad_points():
    """The bucketed search agrees with the dense test where its buckets clamp (boxes and points beyond
    +-128 m, a box straddling the clamp line), on overlapping boxes (a point in both) and on NaN / inf points."""
    from detector.geometry.boxes import points_in_boxes_sparse

    boxes = Boxes3D(torch.tensor([
        [200.0, -150.0, 0.0, 4.0, 2.0, 1.5, 0.3],   # beyond the buckets
        [5000.0, 3000.0, 0.0, 4.0, 2.0, 1.5, 0.3],  # far beyond (a corrupt frame's scale)
        [127.5, 3.0, 0.0, 6.0, 2.0, 1.5, 1.2],      # across the clamp line at x = 128 m
        [10.0, 0.9, 0.0, 4.0, 2.0, 1.5, 0.0],       # bucket edges (x = 10 m, y = 0) inside it
        [11.0, 1.5, 0.0, 4.0, 2.0, 1.5, 0.5],       # overlaps the previous one
        [-3.9, -0.1, -1.0, 0.8, 0.8, 1.8, -2.0],    # around the origin, negative coordinates
    ]))
    rng = np.random.default_rng(3)
    centres = boxes.center.numpy()
    pts = np.concatenate([c + rng.uniform(-4, 4, size=(400, 3)) for c in centres])
    pts = np.concatenate([pts, boxes.corners().reshape(-1, 3).numpy(), rng.uniform(-300, 300, size=(500, 3)),
                          rng.uniform(-1e6, 1e6, size=(50, 3))])
    pts = np.column_stack([pts, np.zeros(len(pts))]).astype(np.float32)
    pts[[5, 405, 805], 0] = [np.nan, np.inf, -np.inf]
    pts[[6, 406, 1206], 1] = [np.nan, np.inf, -np.inf]
    dense = boxes.points_in_boxes(pts).numpy()
    assert dense.sum(0).min() > 0 and (dense.sum(1) > 1).any()  # every box holds points; some hold a point twice
    sparse = points_in_boxes_sparse(pts, boxes)
    for j in range(len(boxes)):
        np.testing.assert_array_equal(sparse[j], np.flatnonzero(dense[:, j]))


@pytest.mark.parametrize("convert", [None, "object"])
def test_augmentor_from_hydra_config(tmp_path, convert):
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    write_root(tmp_path)
    cfg = {
        "_target_": "detector.data.augment.Augmentor",
        "ops": [
            {"_target_": "detector.data.augment.GtSampling",
             "database": {"_target_": "detector.data.gt_database.GtDatabase.load_or_build",
                          "root": str(tmp_path), "split": "train"},
             "counts": {"Car": 4}, "min_points": 5, "max_difficulty": None},
            {"_target_": "detector.data.augment.ObjectNoise", "translation_std": [0.2, 0.2, 0.1]},
            {"_target_": "detector.data.augment.GlobalFlip", "prob": 0.5},
            {"_target_": "detector.data.augment.GlobalRotation", "max_angle": 0.3},
            {"_target_": "detector.data.augment.GlobalScaling", "min_scale": 0.9, "max_scale": 1.1},
        ],
    }
    if convert:
        cfg["_convert_"] = convert
    aug = instantiate(OmegaConf.create(cfg))
    assert [type(op).__name__ for op in aug.ops] == [
        "GtSampling", "ObjectNoise", "GlobalFlip", "GlobalRotation", "GlobalScaling"]
    assert aug.ops[1].translation_std == (0.2, 0.2, 0.1)
    frame = make_scene(9, frame_id="000099")
    out = aug(frame, np.random.default_rng(0))
    check_points_stay_in_boxes(frame, out, len(frame.gt_boxes))
