"""Voxelizer and BEV grid: against a brute-force loop, exact borders, drops, errors, configs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from detector.geometry.voxelize import BevGrid, voxelize
from tests.paths import CONFIGS

BEV = CONFIGS / "bev"


def _brute_axis(v: float, lo: float, hi: float, res: float, n: int) -> int | None:
    """Literal definition: cell k covers [lo + k*res, lo + (k+1)*res) (float64), the last one ends at hi."""
    for k in range(n):
        a = lo + k * res
        b = hi if k == n - 1 else lo + (k + 1) * res
        if a <= v < b:
            return k
    return None


def brute_voxelize(points: np.ndarray, batch_size: int, grid: BevGrid) -> tuple[np.ndarray, np.ndarray]:
    bev = np.zeros((batch_size, grid.C, grid.H, grid.W), np.float32)
    touched = np.zeros((batch_size, grid.H, grid.W), bool)
    dropped = np.zeros(batch_size, np.int64)
    for b, x, y, z, r in points.tolist():  # exact: float32 -> Python float is lossless
        b = int(b)
        c = _brute_axis(x, *grid.x_range, grid.resolution, grid.W)
        row = _brute_axis(y, *grid.y_range, grid.resolution, grid.H)
        s = _brute_axis(z, *grid.z_range, grid.z_resolution, grid.n_slices)
        if c is None or row is None or s is None:
            dropped[b] += 1
            continue
        bev[b, s, row, c] = 1.0
        r32 = np.float32(r)
        if not touched[b, row, c] or r32 > bev[b, -1, row, c]:
            bev[b, -1, row, c] = r32
        touched[b, row, c] = True
    return bev, dropped


def _border_values(lo: float, hi: float, res: float, n: int) -> list[float]:
    vals = []
    for k in range(n + 1):
        b = hi if k == n else lo + k * res
        vals += [b, np.nextafter(b, -np.inf), np.nextafter(b, np.inf)]
    return vals


def random_points(grid: BevGrid, n_per_frame: list[int], seed: int, dtype=torch.float32) -> torch.Tensor:
    """Random points (some outside the range) plus points on and next to every cell border."""
    rng = np.random.default_rng(seed)
    frames = []
    for b, n in enumerate(n_per_frame):
        if n == 0:
            continue
        lo = np.array([grid.x_range[0], grid.y_range[0], grid.z_range[0]])
        hi = np.array([grid.x_range[1], grid.y_range[1], grid.z_range[1]])
        span = hi - lo
        xyz = rng.uniform(lo - 0.1 * span, hi + 0.1 * span, size=(n, 3))
        # Put a third of the coordinates exactly on (or one ulp next to) a border.
        for axis, (a, z, res, cells) in enumerate([
            (*grid.x_range, grid.resolution, grid.W),
            (*grid.y_range, grid.resolution, grid.H),
            (*grid.z_range, grid.z_resolution, grid.n_slices),
        ]):
            borders = np.array(_border_values(a, z, res, cells))
            pick = rng.random(n) < 0.33
            xyz[pick, axis] = rng.choice(borders, size=int(pick.sum()))
        r = rng.uniform(0, 1, size=(n, 1))
        frames.append(np.concatenate([np.full((n, 1), b), xyz, r], axis=1))
    pts = np.concatenate(frames) if frames else np.zeros((0, 5))
    return torch.from_numpy(pts).to(dtype)


SMALL = BevGrid((-1.0, 1.4), (-0.8, 0.8), (-0.5, 0.5), 0.1, 0.25)  # W=24, H=16, 4 slices


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n_per_frame", [[300], [200, 0, 150], [0, 0]])
def test_matches_brute_force(dtype, n_per_frame):
    pts = random_points(SMALL, n_per_frame, seed=len(n_per_frame), dtype=dtype)
    bev, stats = voxelize(pts, len(n_per_frame), SMALL)
    ref, dropped = brute_voxelize(pts.numpy(), len(n_per_frame), SMALL)
    assert bev.shape == (len(n_per_frame), SMALL.C, SMALL.H, SMALL.W) and bev.dtype == torch.float32
    # written in the layout the convolutions read (no permuting copy of the map before the backbone)
    assert bev.is_contiguous(memory_format=torch.channels_last)
    np.testing.assert_array_equal(bev.numpy(), ref)
    np.testing.assert_array_equal(stats.dropped_per_frame.numpy(), dropped)
    assert stats.n_dropped == int(dropped.sum()) and stats.n_points == pts.shape[0]
    assert stats.n_dropped > 0 or pts.shape[0] == 0


def test_float32_border_point_goes_to_upper_cell():
    # 0.5 = 0 + 5 * 0.1 exactly in float64 and is exact in float32: the border of cells 4 | 5.
    g = BevGrid((0.0, 70.4), (-40.0, 40.0), (-2.5, 1.0), 0.1, 0.1)
    pts = torch.tensor(
        [[0, 0.5, -40.0, -2.5, 0.3],  # x on border 5, y on the lower range end, z on the lower end
         [0, 1.5, 0.0, 0.5, 0.7],  # x on border 15, y on border 400, z on border 30 (-2.5 + 30 * 0.1 = 0.5)
         [0, 70.4, 0.0, 0.0, 0.1],  # x at the upper end: dropped
         [0, 0.0, 40.0, 0.0, 0.1],  # y at the upper end: dropped
         [0, 0.0, 0.0, 1.0, 0.1]],  # z at the upper end: dropped
        dtype=torch.float32,
    )
    assert float(np.float32(-2.5 + 30 * 0.1)) == -2.5 + 30 * 0.1
    bev, stats = voxelize(pts, 1, g)
    assert stats.n_dropped == 3
    assert bev[0, 0, 0, 5] == 1 and bev[0, -1, 0, 5] == pytest.approx(0.3)
    assert bev[0, 30, 400, 15] == 1 and bev[0, -1, 400, 15] == pytest.approx(0.7)
    assert int(bev[0, :-1].sum()) == 2
    # One ulp below the border goes to the lower cell.
    below = pts[:2].clone()
    below[:, 1] = torch.tensor(np.nextafter(below[:, 1].numpy(), np.float32(-np.inf)))
    bev2, _ = voxelize(below, 1, g)
    assert bev2[0, 0, 0, 4] == 1 and bev2[0, 30, 400, 14] == 1


def test_intensity_is_column_max_and_occupancy_per_slice():
    pts = torch.tensor(
        [[0, 0.05, 0.05, -0.45, 0.2], [0, 0.05, 0.05, 0.3, 0.9], [0, 0.05, 0.05, 0.31, 0.4],
         [1, 0.05, 0.05, 0.0, 0.0]], dtype=torch.float32,
    )
    bev, stats = voxelize(pts, 2, SMALL)
    r, c = 8, 10
    assert bev[0, :-1, r, c].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert bev[0, -1, r, c] == pytest.approx(0.9)
    assert bev[1, :-1, r, c].tolist() == [0.0, 0.0, 1.0, 0.0] and bev[1, -1, r, c] == 0.0
    assert bev.sum() == pytest.approx(3 + 0.9)
    assert stats.n_dropped == 0


def test_nonfinite_points_are_dropped():
    pts = torch.tensor([[0, float("nan"), 0, 0, 0.5], [0, 0, float("inf"), 0, 0.5], [0, 0.0, 0.0, 0.0, 0.5]])
    bev, stats = voxelize(pts, 1, SMALL)
    assert stats.n_dropped == 2 and int(bev[0, :-1].sum()) == 1


@pytest.mark.parametrize(
    "points,batch_size,match",
    [
        (torch.zeros(3, 4), 1, r"\[N, 5\]"),
        (torch.zeros(3, 5, dtype=torch.int64), 1, "float"),
        (np.zeros((3, 5)), 1, "torch.Tensor"),
        (torch.tensor([[1.0, 0, 0, 0, 0]]), 1, r"batch index .* \[0, 1\); point 0 has 1.0"),
        (torch.tensor([[0.0, 0, 0, 0, 0], [-1.0, 0, 0, 0, 0]]), 2, "point 1 has -1.0"),
        (torch.tensor([[0.5, 0, 0, 0, 0]]), 2, "point 0 has 0.5"),
        (torch.zeros(1, 5), 0, "batch_size"),
    ],
)
def test_bad_input_raises_clear_error(points, batch_size, match):
    with pytest.raises(ValueError, match=match):
        voxelize(points, batch_size, SMALL)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(x_range=(1.0, 1.0)), "min must be < max"),
        (dict(y_range=(2.0, -2.0)), "min must be < max"),
        (dict(resolution=0.0), "resolution must be positive"),
        (dict(z_resolution=-0.1), "z_resolution must be positive"),
        (dict(x_range=(0.0, 0.04)), "zero cells"),
        (dict(x_range=(0.0, 1.05)), "not a whole number"),
        (dict(z_range=(0.0,)), "two numbers"),
        (dict(resolution="a"), "must be a number"),
    ],
)
def test_grid_validation(kwargs, match):
    args = dict(x_range=(0.0, 1.0), y_range=(-1.0, 1.0), z_range=(-1.0, 1.0), resolution=0.1)
    args["z_resolution"] = 0.5
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        BevGrid(**args)


def test_configs_instantiate_with_expected_shapes():
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    kitti = instantiate(OmegaConf.load(BEV / "kitti.yaml"))
    assert isinstance(kitti, BevGrid)
    assert (kitti.H, kitti.W, kitti.C, kitti.n_slices) == (800, 704, 36, 35)
    assert kitti.x_range == (0.0, 70.4) and kitti.y_range == (-40.0, 40.0) and kitti.z_range == (-2.5, 1.0)
    small = instantiate(OmegaConf.load(BEV / "small.yaml"))
    assert isinstance(small, BevGrid)
    assert small.H % 32 == 0 and small.W % 32 == 0
    assert (small.H, small.W, small.C) == (192, 256, 11)
    hash(small)  # frozen: usable as a cache key


def test_world_to_cell_and_cell_center_roundtrip():
    g = BevGrid((0.0, 70.4), (-40.0, 40.0), (-2.5, 1.0), 0.1, 0.1)
    rows, cols = torch.meshgrid(torch.arange(g.H), torch.arange(g.W), indexing="ij")
    x, y = g.cell_center(rows, cols, dtype=torch.float64)
    r2, c2 = g.world_to_cell(x, y)
    assert torch.equal(r2, rows) and torch.equal(c2, cols)
    assert float(x[0, 0]) == pytest.approx(0.05) and float(y[0, 0]) == pytest.approx(-39.95)
    r, c = g.world_to_cell(torch.tensor([-0.01, 70.4, 70.39]), torch.tensor([-40.01, 40.0, 39.99]))
    assert r.tolist() == [-1, 800, 799] and c.tolist() == [-1, 704, 703]
    assert g.in_grid(r, c).tolist() == [False, False, True]
    d = g.downsampled(4)
    assert (d.H, d.W, d.resolution) == (200, 176, pytest.approx(0.4))
    with pytest.raises(ValueError, match="not divisible"):
        g.downsampled(3)


@pytest.mark.gpu
def test_cuda_matches_cpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pts = random_points(SMALL, [500, 0, 400], seed=7)
    bev_cpu, st_cpu = voxelize(pts, 3, SMALL)
    bev_gpu, st_gpu = voxelize(pts.cuda(), 3, SMALL)
    assert bev_gpu.device.type == "cuda"
    assert torch.equal(bev_gpu.cpu(), bev_cpu)
    assert torch.equal(st_gpu.dropped_per_frame.cpu(), st_cpu.dropped_per_frame)
