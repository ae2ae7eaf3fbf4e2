"""Computation masks: road-map resampling and dilation vs brute force, ground mask on a ray-cast scene,
boxes mask, sparsity, and the clear error on frames without a road map."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from detector.data.kitti import KittiRoot
from detector.data.masks import GroundMask, MaskResult, NoMask, RoadMapMask, resample_road_map
from detector.data.road_map import RoadMap
from detector.data.structures import Frame, collate_frames
from detector.geometry.box_masks import boxes_mask, close, dilate
from detector.geometry.boxes import Boxes3D
from detector.geometry.voxelize import BevGrid
from tests.conftest import make_calib

GRID = BevGrid((-4.0, 4.0), (-6.0, 6.0), (-1.0, 1.0), 0.2, 0.5)  # H=60, W=40


def _brute_axis(v: float, lo: float, res: float, n: int) -> int | None:
    for k in range(n):
        if lo + k * res <= v < lo + (k + 1) * res:
            return k
    return None


def _frame(points=None, road=None, boxes=None, frame_id="000000") -> Frame:
    pts = np.zeros((0, 4), np.float32) if points is None else np.asarray(points, np.float32)
    b = Boxes3D.empty() if boxes is None else boxes
    return Frame(frame_id, pts, make_calib(), b, np.array(["Car"] * len(b), dtype="<U16"), None, road)


# --------------------------------------------------------------------------------------------------
# Morphology
# --------------------------------------------------------------------------------------------------
def brute_dilate(mask: np.ndarray, r: float) -> np.ndarray:
    B, H, W = mask.shape
    out = np.zeros_like(mask)
    R = int(math.floor(r))
    for b in range(B):
        for i in range(H):
            for j in range(W):
                for di in range(-R, R + 1):
                    for dj in range(-R, R + 1):
                        ii, jj = i + di, j + dj
                        if di * di + dj * dj <= r * r and 0 <= ii < H and 0 <= jj < W and mask[b, ii, jj]:
                            out[b, i, j] = True
    return out


@pytest.mark.parametrize("radius", [0.0, 0.7, 1.0, 2.5, 3.0, 4.2])
def test_dilate_matches_brute_force(radius):
    rng = np.random.default_rng(int(radius * 10))
    m = rng.random((2, 13, 17)) < 0.04
    m[1, 0, 16] = True  # a corner cell
    got = dilate(torch.from_numpy(m), radius).numpy()
    np.testing.assert_array_equal(got, brute_dilate(m, radius))


def test_close_fills_gaps_narrower_than_the_disk():
    m = torch.zeros(1, 20, 30, dtype=torch.bool)
    m[0, 5:15, 2:10] = True
    m[0, 5:15, 12:28] = True  # a 2-cell gap at columns 10, 11
    c = close(m, 2.0)
    assert c[0, 7:13, 2:28].all()  # (at the blocks' top and bottom rows the disk leaves the gap's corners)
    assert not c[0, :3].any() and not c[0, 17:].any()  # nothing far from the blocks
    assert bool((c | m).eq(c).all())  # extensive
    wide = torch.zeros(1, 20, 30, dtype=torch.bool)
    wide[0, 5:15, 2:8] = True
    wide[0, 5:15, 18:28] = True  # a 10-cell gap stays open
    assert not close(wide, 2.0)[0, 10, 12]


# --------------------------------------------------------------------------------------------------
# Road map
# --------------------------------------------------------------------------------------------------
def test_resample_road_map_matches_brute_force():
    rng = np.random.default_rng(0)
    road = RoadMap(rng.random((37, 23)) < 0.5, x_min=-3.1, y_min=-5.3, resolution=0.25)
    got = resample_road_map(road, GRID).numpy()
    assert got.shape == (GRID.H, GRID.W)
    ref = np.zeros((GRID.H, GRID.W), bool)
    for r in range(GRID.H):
        for c in range(GRID.W):
            x = GRID.x_range[0] + (c + 0.5) * GRID.resolution
            y = GRID.y_range[0] + (r + 0.5) * GRID.resolution
            rc = _brute_axis(x, road.x_min, road.resolution, road.raster.shape[1])
            rr = _brute_axis(y, road.y_min, road.resolution, road.raster.shape[0])
            ref[r, c] = rr is not None and rc is not None and road.raster[rr, rc]
    np.testing.assert_array_equal(got, ref)
    # The raster covers x in [-3.1, 2.65) only: columns whose centre lies outside are not drivable.
    assert not got[:, :4].any() and not got[:, -6:].any()


@pytest.mark.parametrize("op", ["flip", "rotate", "scale"])
def test_resample_road_map_of_an_augmented_map_matches_brute_force(op):
    """After a global flip/rotation/scaling (training augmentation) the raster is not resampled: each BEV
    cell centre is mapped back into the original raster. Brute force: undo the transform on the centre,
    then find the original raster cell by scanning its rows and columns."""
    from detector.data.augment import flip_road_map, rotate_road_map, scale_road_map

    rng = np.random.default_rng(4)
    # a pitch and origin on which no cell centre falls exactly on a raster edge (no ties to round either way)
    road = RoadMap(rng.random((41, 29)) < 0.5, x_min=-3.1127, y_min=-5.3071, resolution=0.2513)
    a, s = 0.4, 1.25
    aug, undo = {
        "flip": (flip_road_map(road), lambda x, y: (x, -y)),
        "rotate": (rotate_road_map(road, a),
                   lambda x, y: (math.cos(a) * x + math.sin(a) * y, -math.sin(a) * x + math.cos(a) * y)),
        "scale": (scale_road_map(road, s), lambda x, y: (x / s, y / s)),
    }[op]
    got = resample_road_map(aug, GRID).numpy()
    ref = np.zeros((GRID.H, GRID.W), dtype=bool)
    for r in range(GRID.H):
        for c in range(GRID.W):
            cx, cy = GRID.cell_center(torch.tensor(r), torch.tensor(c), dtype=torch.float64)
            x, y = undo(float(cx), float(cy))
            rc = _brute_axis(x, road.x_min, road.resolution, road.raster.shape[1])
            rr = _brute_axis(y, road.y_min, road.resolution, road.raster.shape[0])
            ref[r, c] = rr is not None and rc is not None and road.raster[rr, rc]
    assert 0.2 < ref.mean() < 0.8
    np.testing.assert_array_equal(got, ref)


def test_road_map_mask_dilation_radius_and_sparsity():
    raster = np.zeros((GRID.H, GRID.W), bool)
    raster[30, 20] = True  # same grid as the BEV: one drivable cell
    road = RoadMap(raster, GRID.x_range[0], GRID.y_range[0], GRID.resolution)
    far_away = RoadMap(np.ones((2, 2), bool), 100.0, 100.0, 1.0)
    batch = collate_frames([_frame(road=road), _frame(road=far_away)])
    res = RoadMapMask(dilation_m=0.5, downsample=1)(batch, GRID)  # 2.5 cells
    assert res.mask.shape == (2, 1, GRID.H, GRID.W) and res.mask.dtype == torch.float32
    rr, cc = np.nonzero(res.mask[0, 0].numpy())
    d2 = (rr - 30) ** 2 + (cc - 20) ** 2
    expected = {(r, c) for r in range(GRID.H) for c in range(GRID.W) if (r - 30) ** 2 + (c - 20) ** 2 <= 6.25}
    assert set(zip(rr.tolist(), cc.tolist(), strict=True)) == expected and d2.max() <= 6.25
    assert len(expected) == 21
    assert res.mask[1].sum() == 0  # a road map that does not overlap the grid: nothing drivable
    n = GRID.H * GRID.W
    assert res.frame_sparsity == pytest.approx([1 - 21 / n, 1.0])
    assert res.sparsity == pytest.approx(1 - 21 / (2 * n))
    assert RoadMapMask(dilation_m=0.0, downsample=1)(batch, GRID).mask[0].sum() == 1


def test_road_map_mask_on_a_coarser_grid_differs_only_at_the_border():
    raster = np.zeros((GRID.H, GRID.W), bool)
    raster[20:50, :] = True  # a road band along x
    road = RoadMap(raster, GRID.x_range[0], GRID.y_range[0], GRID.resolution)
    batch = collate_frames([_frame(road=road)])
    fine = RoadMapMask(dilation_m=1.0, downsample=1)(batch, GRID).mask[0, 0].numpy() > 0
    coarse = RoadMapMask(dilation_m=1.0, downsample=4)(batch, GRID).mask[0, 0].numpy() > 0
    diff_rows = np.nonzero((fine != coarse).any(axis=1))[0]
    border = np.nonzero(fine.any(axis=1))[0][[0, -1]]
    assert all(min(abs(r - border[0]), abs(r - border[1])) < 4 for r in diff_rows)
    assert coarse[25:45].all()


def test_road_map_mask_without_road_map_raises_clear_error():
    batch = collate_frames([_frame(frame_id="000042")])
    msg = r"frame 000042 has no road map.*mask=predicted, mask=ground or mask=none"
    with pytest.raises(ValueError, match=msg):
        RoadMapMask()(batch, GRID)


def test_road_map_mask_on_real_kitti_raises(kitti_real):
    frame = KittiRoot(kitti_real).read_frame("000000")
    assert frame.road_map is None
    with pytest.raises(ValueError, match=r"real KITTI has none.*mask=ground"):
        RoadMapMask()(collate_frames([frame]), GRID)


def test_no_mask_and_bad_radius():
    res = NoMask()(collate_frames([_frame(), _frame()]), GRID)
    assert res.mask is None and res.sparsity == 0.0 and res.frame_sparsity == [0.0, 0.0]
    with pytest.raises(ValueError, match="dilation_m"):
        RoadMapMask(dilation_m=-1.0)
    with pytest.raises(ValueError, match="zone_edges_m"):
        GroundMask(zone_edges_m=(40.0, 20.0))


def test_mask_result_sparsity():
    m = torch.zeros(2, 1, 4, 5)
    m[0, 0, :2] = 1  # 10 of 20 on
    r = MaskResult.from_mask(m)
    assert r.frame_sparsity == pytest.approx([0.5, 1.0]) and r.sparsity == pytest.approx(0.75)


# --------------------------------------------------------------------------------------------------
# Boxes mask
# --------------------------------------------------------------------------------------------------
def test_boxes_mask_matches_brute_force():
    rng = np.random.default_rng(3)
    boxes = []
    for n in (3, 0, 2):
        t = np.zeros((n, 7))
        t[:, 0] = rng.uniform(-4.5, 4.5, n)
        t[:, 1] = rng.uniform(-6.5, 6.5, n)
        t[:, 3] = rng.uniform(0.3, 4.5, n)
        t[:, 4] = rng.uniform(0.3, 2.0, n)
        t[:, 5] = 1.5
        t[:, 6] = rng.uniform(-np.pi, np.pi, n)
        boxes.append(Boxes3D(torch.from_numpy(t).float()))
    tiny = Boxes3D(torch.tensor([[1.03, 2.05, 0.0, 0.05, 0.05, 0.5, 0.3]]))  # smaller than a coarse cell
    boxes.append(tiny)
    dil, ds = 0.3, 2
    got = boxes_mask(boxes, GRID, dil, downsample=ds)
    g = GRID.downsampled(ds)
    assert got.shape == (4, 1, g.H, g.W)
    ref = np.zeros((4, g.H, g.W), np.float32)
    for b, bx in enumerate(boxes):
        for x, y, _, l, w, _, yaw in bx.tensor.double().tolist():
            for r in range(g.H):
                for c in range(g.W):
                    px = g.x_range[0] + (c + 0.5) * g.resolution
                    py = g.y_range[0] + (r + 0.5) * g.resolution
                    lx = (px - x) * math.cos(yaw) + (py - y) * math.sin(yaw)
                    ly = -(px - x) * math.sin(yaw) + (py - y) * math.cos(yaw)
                    if abs(lx) <= l / 2 + dil and abs(ly) <= w / 2 + dil:
                        ref[b, r, c] = 1
            rc = _brute_axis(x, g.x_range[0], g.resolution, g.W)
            rr = _brute_axis(y, g.y_range[0], g.resolution, g.H)
            if rc is not None and rr is not None:
                ref[b, rr, rc] = 1
    np.testing.assert_array_equal(got[:, 0].numpy(), ref)
    assert got[3].sum() >= 1 and got[1].sum() == 0


# --------------------------------------------------------------------------------------------------
# Ground mask on a ray-cast scene
# --------------------------------------------------------------------------------------------------
def _box_mesh(cx, cy, cz, l, w, h, yaw):
    import open3d as o3d

    m = o3d.geometry.TriangleMesh.create_box(l, w, h)
    m.translate((-l / 2, -w / 2, -h / 2))
    m.rotate(o3d.geometry.get_rotation_matrix_from_xyz((0.0, 0.0, yaw)), center=(0.0, 0.0, 0.0))
    m.translate((cx, cy, cz))
    return m


def raycast_scene(boxes: np.ndarray, extra: list[tuple], ground_z: float = -1.73, slope: float = 0.0):
    """A 64-beam scan (−24.8°..+2°, 0.4° azimuth steps) of a ground plane z = ground_z + slope·x plus
    boxes [N, 7] and extra boxes (cx, cy, cz, l, w, h, yaw). Returns points [M, 4] float32."""
    import open3d as o3d

    scene = o3d.t.geometry.RaycastingScene()
    ground = _box_mesh(0.0, 0.0, ground_z - 0.05, 400.0, 400.0, 0.1, 0.0)
    tilt = o3d.geometry.get_rotation_matrix_from_xyz((0.0, -math.atan(slope), 0.0))
    ground.rotate(tilt, center=(0, 0, ground_z))
    for mesh in [ground] + [_box_mesh(*b) for b in boxes.tolist()] + [_box_mesh(*e) for e in extra]:
        scene.add_triangles(o3d.t.geometry.TriangleMesh.from_legacy(mesh))
    el = np.deg2rad(np.linspace(-24.8, 2.0, 64))
    az = np.deg2rad(np.arange(-180, 180, 0.4))
    E, A = np.meshgrid(el, az, indexing="ij")
    d = np.stack([np.cos(E) * np.cos(A), np.cos(E) * np.sin(A), np.sin(E)], axis=-1).reshape(-1, 3)
    rays = np.concatenate([np.zeros_like(d), d], axis=1).astype(np.float32)
    t = scene.cast_rays(o3d.core.Tensor(rays))["t_hit"].numpy()
    ok = np.isfinite(t) & (t < 80)
    xyz = d[ok] * t[ok, None]
    return np.concatenate([xyz, np.full((len(xyz), 1), 0.5)], axis=1).astype(np.float32)


CARS = np.array([
    [8.0, 3.0, -0.98, 4.2, 1.8, 1.5, 0.0],  # ahead, in lane
    [15.0, -12.0, -0.98, 4.2, 1.8, 1.5, 1.2],
    [25.0, 4.0, -0.98, 4.5, 1.9, 1.5, 0.6],  # diagonal
    [36.0, -2.5, -0.98, 4.2, 1.8, 1.5, 0.0],  # end-on, far
    [44.0, -9.0, -0.93, 4.5, 1.9, 1.6, 1.57],  # broadside, far
    [12.0, 8.5, -0.88, 0.6, 0.6, 1.7, 0.0],  # pedestrian
])
BUILDING = (32.0, 18.0, 2.27, 20.0, 14.0, 8.0, 0.0)  # x 22-42, y 11-25, on the ground


def test_ground_mask_covers_objects_and_excludes_building_interior():
    pts = raycast_scene(CARS, [BUILDING], slope=0.01)
    frame = _frame(points=pts, boxes=Boxes3D(torch.from_numpy(CARS).float()))
    # No object hides another (a fully occluded object has no points: no mask rule can find it).
    # (Ray hits lie on the box surfaces: count them with a small margin.)
    assert (frame.gt_boxes.points_in_boxes(pts, margin=0.05).sum(dim=0) >= 20).all()
    grid = BevGrid((0.0, 51.2), (-19.2, 19.2), (-2.5, 1.0), 0.2, 0.35)
    gm = GroundMask()
    res = gm(collate_frames([frame]), grid)
    assert res.n_fallback == 0 and res.mask.shape == (1, 1, grid.H, grid.W)
    obj = boxes_mask([frame.gt_boxes], grid, 0.0)
    per_box = [float((boxes_mask([frame.gt_boxes[i]], grid, 0.0) * res.mask).sum()
                     / boxes_mask([frame.gt_boxes[i]], grid, 0.0).sum()) for i in range(len(CARS))]
    assert per_box == [1.0] * len(CARS), per_box
    assert float((obj * res.mask).sum()) == float(obj.sum())
    # Inside the building, farther than object depth + closing + dilation (6 m) from its walls: masked out.
    r, c = grid.world_to_cell(torch.tensor([33.0]), torch.tensor([18.5]))
    assert res.mask[0, 0, r, c].item() == 0.0
    assert 0.2 < res.sparsity < 0.95
    # Seeded: the same frame gives the same mask, in any batch position.
    res2 = gm(collate_frames([_frame(points=pts[:500]), frame]), grid)
    assert torch.equal(res2.mask[1], res.mask[0])


def test_ground_mask_follows_a_slope():
    # A 4 % climb: at 40 m the ground is 1.6 m above its height at the sensor; rings fit their own plane.
    pts = raycast_scene(np.zeros((0, 7)), [], slope=0.04)
    grid = BevGrid((0.0, 51.2), (-19.2, 19.2), (-2.5, 1.0), 0.2, 0.35)
    gm = GroundMask(max_object_height=0.0, dilation_m=0.0, closing_m=0.0)
    cells = gm.frame_ground_cells(pts[:, :3].astype(np.float64), grid)
    x, _ = grid.cell_center(torch.zeros(grid.W, dtype=torch.int64), torch.arange(grid.W))
    far = cells[:, x > 40].any()
    assert bool(far), "ground beyond 40 m not found on a slope"


def test_ground_mask_falls_back_with_warning():
    pts = raycast_scene(CARS[:1], [])
    grid = BevGrid((0.0, 51.2), (-19.2, 19.2), (-2.5, 1.0), 0.2, 0.35)
    batch = collate_frames([_frame(points=pts), _frame(points=pts[:20], frame_id="000007")])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        res = GroundMask()(batch, grid)
    assert res.n_fallback == 1
    assert any("000007" in str(x.message) for x in w)
    assert res.mask[1].min() == 1.0 and res.mask[0].min() == 0.0
    assert res.frame_sparsity[1] == 0.0
