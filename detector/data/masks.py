"""Computation masks on the BEV grid: where the sparse backbone computes.

A mask provider is called once per batch: ``provider(batch, grid) -> MaskResult`` with ``mask``
[B, 1, H, W] float32 in {0, 1} on the batch's device (None for :class:`NoMask`: dense) and its
``sparsity`` = the fraction of cells that are 0 (so 0.0 is dense, 0.9 means 10 % of the cells compute).

Providers (the ``predicted`` one is a network: detector/models/mask_net.py):
- :class:`RoadMapMask`: the frame's drivable-area raster (our simulator's ``road_map``) resampled to the
  BEV grid and dilated by ``dilation_m`` so objects at the kerb are inside. Real KITTI has no road maps:
  a frame without one raises a clear error.
- :class:`GroundMask`: no map needed. Per frame, a RANSAC plane (open3d ``segment_plane``, seeded) fitted
  per range ring to the points near the expected ground height; the drivable-area estimate is the set
  of BEV cells holding ground points or points of things standing on the ground (extended away from
  the sensor: their bodies lie behind their visible surfaces), morphologically closed (fills the gaps
  between scan rings) and dilated (covers objects standing on the ground). Rule: :class:`GroundMask`.
- :class:`NoMask`: dense.

The "ground-truth" mask from labeled boxes (the predicted mask's target) and the morphology the providers
use (dilation, closing on the grid's cells): :mod:`detector.geometry.box_masks`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from detector.data.structures import Batch
from detector.errors import ConfigError
from detector.geometry.box_masks import check_radius, close, dilate
from detector.geometry.voxelize import BevGrid, axis_index


@dataclass
class MaskResult:
    """A batch's computation mask. ``mask`` [B, 1, H, W] float32 in {0, 1} or None (dense).

    ``sparsity``: fraction of 0 cells over the batch (0.0 when dense); ``frame_sparsity``: per frame.
    ``n_fallback``: frames where the provider could not estimate a mask and used all-ones (GroundMask).
    """

    mask: torch.Tensor | None
    sparsity: float
    frame_sparsity: list[float]
    n_fallback: int = 0

    @classmethod
    def from_mask(cls, mask: torch.Tensor, n_fallback: int = 0) -> MaskResult:
        density = mask.flatten(1).float().mean(dim=1).cpu()
        return cls(mask, 1.0 - float(density.mean()), [1.0 - float(d) for d in density], n_fallback)


# --------------------------------------------------------------------------------------------------
# Providers
# --------------------------------------------------------------------------------------------------
class NoMask:
    """Dense computation: ``mask`` is None, sparsity 0."""

    def __call__(self, batch: Batch, grid: BevGrid) -> MaskResult:
        return MaskResult(None, 0.0, [0.0] * batch.size)


def resample_road_map(road, grid: BevGrid, device: torch.device | str = "cpu") -> torch.Tensor:
    """[H, W] bool: the road raster sampled (nearest) at each BEV cell centre; outside the raster = False.

    ``road`` is a :class:`detector.data.road_map.RoadMap` (row r, column c cover y/x in
    [min + k·res, min + (k+1)·res)); any resolution and extent.
    """
    if road.to_raster is not None:  # augmented: look the cell centres up through the coordinate map
        f64 = torch.float64
        rows, cols = torch.meshgrid(torch.arange(grid.H), torch.arange(grid.W), indexing="ij")
        cx, cy = grid.cell_center(rows, cols, dtype=f64)
        return torch.from_numpy(road.lookup(cx.numpy(), cy.numpy())).to(device)
    raster = torch.as_tensor(np.ascontiguousarray(road.raster, dtype=bool), device=device)
    rows_r, cols_r = raster.shape
    res = float(road.resolution)
    if not (math.isfinite(res) and res > 0):
        raise ValueError(f"road map resolution must be positive, got {road.resolution!r}")
    if rows_r == 0 or cols_r == 0:
        return torch.zeros(grid.H, grid.W, dtype=torch.bool, device=device)
    f64 = torch.float64
    cx, _ = grid.cell_center(torch.zeros(grid.W, dtype=torch.int64), torch.arange(grid.W), dtype=f64)
    _, cy = grid.cell_center(torch.arange(grid.H), torch.zeros(grid.H, dtype=torch.int64), dtype=f64)
    x0, y0 = float(road.x_min), float(road.y_min)
    c = axis_index(cx, x0, x0 + cols_r * res, res, cols_r).to(device)  # [W]
    r = axis_index(cy, y0, y0 + rows_r * res, res, rows_r).to(device)  # [H]
    ok = (r[:, None] >= 0) & (r[:, None] < rows_r) & (c[None, :] >= 0) & (c[None, :] < cols_r)
    vals = raster[r.clamp(0, rows_r - 1)[:, None], c.clamp(0, cols_r - 1)[None, :]]
    return vals & ok


class RoadMapMask:
    """The frame's road map resampled to the grid and dilated by ``dilation_m`` metres.

    ``downsample``: the mask is computed on a grid ``downsample`` times coarser and repeated to full
    resolution (the backbone only reads it per block of 8+ cells; 16x fewer cells to resample and dilate
    at the default 4)."""

    def __init__(self, dilation_m: float = 2.0, downsample: int = 4):
        self.dilation_m = check_radius(dilation_m, "RoadMapMask.dilation_m")
        if not isinstance(downsample, int) or downsample < 1:
            raise ConfigError(f"RoadMapMask.downsample must be a positive integer, got {downsample!r}")
        self.downsample = downsample

    def __call__(self, batch: Batch, grid: BevGrid) -> MaskResult:
        device = batch.points.device
        coarse = grid.downsampled(self.downsample)
        maps = []
        for f in batch.frames:
            if f.road_map is None:
                raise ConfigError(
                    f"mask=road_map: frame {f.frame_id} has no road map (real KITTI has none; our simulator "
                    "writes road_map/): use mask=predicted, mask=ground or mask=none"
                )
            maps.append(resample_road_map(f.road_map, coarse, device))
        if not maps:
            return MaskResult.from_mask(torch.zeros(0, 1, grid.H, grid.W, device=device))
        m = dilate(torch.stack(maps), self.dilation_m / coarse.resolution)[:, None].float()
        if self.downsample > 1:
            m = m.repeat_interleave(self.downsample, 2).repeat_interleave(self.downsample, 3)
        return MaskResult.from_mask(m)


def _plane_height(xyz: np.ndarray, plane: np.ndarray) -> np.ndarray:
    """a x + b y + c z + d for a plane (4,) or per-point planes (4, N); elementwise (a BLAS matmul of
    this size costs more in thread start-up than in arithmetic)."""
    return xyz[:, 0] * plane[0] + xyz[:, 1] * plane[1] + xyz[:, 2] * plane[2] + plane[3]


class GroundMask:
    """Drivable-area estimate from RANSAC ground planes, per frame; no map needed.

    Rule, per frame, on the points inside the grid's x/y range:
    (1) the ground is fitted piecewise in rings of horizontal range split at ``zone_edges_m`` (roads
        climb and dip: one plane per ring follows them). Ring 0's candidates are the points with
        |z - ground_z| <= search_band; ring k's are those within ``search_band`` of ring k-1's plane.
        open3d ``segment_plane`` (seeded with ``seed``; at most ``max_fit_points`` candidates, drawn with a
        seeded Generator) fits each ring. A ring with fewer than ``min_points`` candidates, or whose
        plane tilts more than ``max_tilt_deg`` from horizontal, reuses ring k-1's plane; if ring 0 fails
        the frame falls back (all-ones mask, a warning, counted in ``MaskResult.n_fallback``).
    (2) ground cells = cells holding a point within ``distance_threshold`` of its ring's plane;
        object cells = cells holding a point standing on the ground (higher than ``distance_threshold``
        and at most ``max_object_height`` above the plane), each extended away from the sensor by
        ``object_depth_m`` along its ray (an object's body lies behind its visible surface; far away, the
        ground rings are metres apart and an object's footprint holds no ground point);
    (3) mask = dilate(close(ground cells | object cells, closing_m), dilation_m).
    The result depends only on the frame's points (not on its position in the batch).
    """

    def __init__(
        self,
        dilation_m: float = 2.0,
        closing_m: float = 1.0,
        ground_z: float = -1.73,
        search_band: float = 0.6,
        distance_threshold: float = 0.15,
        zone_edges_m: Sequence[float] = (20.0, 40.0),
        num_iterations: int = 100,
        max_fit_points: int = 3000,
        min_points: int = 100,
        max_tilt_deg: float = 15.0,
        max_object_height: float = 2.5,
        object_depth_m: float = 3.0,
        seed: int = 0,
    ):
        self.dilation_m = check_radius(dilation_m, "GroundMask.dilation_m")
        self.closing_m = check_radius(closing_m, "GroundMask.closing_m")
        for name, v in (("search_band", search_band), ("distance_threshold", distance_threshold)):
            if not (math.isfinite(float(v)) and float(v) > 0):
                raise ConfigError(f"GroundMask.{name} must be positive, got {v!r}")
        if int(min_points) < 3 or int(max_fit_points) < int(min_points) or int(num_iterations) < 1:
            raise ConfigError(
                "GroundMask needs min_points >= 3, max_fit_points >= min_points and num_iterations >= 1, got "
                f"{min_points}, {max_fit_points}, {num_iterations}"
            )
        edges = [float(e) for e in zone_edges_m]
        if any(not (math.isfinite(e) and e > 0) for e in edges) or edges != sorted(set(edges)):
            raise ConfigError(f"GroundMask.zone_edges_m must be increasing positive ranges, got {edges!r}")
        self.zone_edges = np.asarray(edges, dtype=np.float64)
        self.ground_z = float(ground_z)
        self.search_band = float(search_band)
        self.distance_threshold = float(distance_threshold)
        self.num_iterations = int(num_iterations)
        self.max_fit_points = int(max_fit_points)
        self.min_points = int(min_points)
        self.min_normal_z = math.cos(math.radians(float(max_tilt_deg)))
        self.max_object_height = float(max_object_height)
        self.object_depth_m = check_radius(object_depth_m, "GroundMask.object_depth_m")
        self.seed = int(seed)

    def _ransac(self, cand: np.ndarray) -> np.ndarray | None:
        """Plane (a, b, c, d), unit normal with c > 0, fitted to ``cand``; None if not acceptable."""
        import open3d as o3d

        if len(cand) < self.min_points:
            return None
        if len(cand) > self.max_fit_points:
            rng = np.random.default_rng(self.seed)
            cand = cand[rng.choice(len(cand), self.max_fit_points, replace=False)]
        o3d.utility.random.seed(self.seed)
        pc = o3d.geometry.PointCloud(o3d.utility.Vector3dVector(np.ascontiguousarray(cand, dtype=np.float64)))
        model, inliers = pc.segment_plane(self.distance_threshold, 3, self.num_iterations)
        model = np.asarray(model, dtype=np.float64).reshape(4)
        norm = np.linalg.norm(model[:3])
        if len(inliers) < self.min_points or not np.isfinite(model).all() or norm == 0:
            return None
        model = model / norm
        if model[2] < 0:
            model = -model
        return model if model[2] >= self.min_normal_z else None

    def fit_planes(self, xyz: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """(planes [Z, 4], zone [N] of each point) for ``xyz`` [N, 3]; None when ring 0 has no plane."""
        r2 = xyz[:, 0] ** 2 + xyz[:, 1] ** 2
        zone = np.zeros(len(xyz), dtype=np.int64)
        for e in self.zone_edges:  # ring k: edges[k-1] <= range < edges[k]
            zone += r2 >= e * e
        planes = []
        for k in range(len(self.zone_edges) + 1):
            pts = xyz[zone == k]
            if k == 0:
                cand = pts[np.abs(pts[:, 2] - self.ground_z) <= self.search_band]
            else:
                cand = pts[np.abs(_plane_height(pts, planes[-1])) <= self.search_band]
            plane = self._ransac(cand)
            if plane is None:
                if k == 0:
                    return None
                plane = planes[-1]
            planes.append(plane)
        return np.stack(planes), zone

    def frame_ground_cells(self, xyz: np.ndarray, grid: BevGrid) -> torch.Tensor | None:
        """[H, W] bool: cells holding ground points (before morphology); None → fallback."""
        (x0, x1), (y0, y1) = grid.x_range, grid.y_range
        x, y = xyz[:, 0], xyz[:, 1]
        xyz = xyz[(x >= x0) & (x < x1) & (y >= y0) & (y < y1)]  # = the grid's half-open cells
        rows, cols = grid.world_to_cell(torch.from_numpy(xyz[:, 0]), torch.from_numpy(xyz[:, 1]))
        fit = self.fit_planes(xyz)
        if fit is None:
            return None
        planes, zone = fit
        # Signed height above the point's ring plane.
        height = _plane_height(xyz, planes[zone].T)
        ground = torch.from_numpy(np.abs(height) <= self.distance_threshold)
        flat = rows * grid.W + cols
        cells = torch.zeros(grid.H * grid.W, dtype=torch.bool)
        cells[flat[ground]] = True
        if self.max_object_height > 0:
            standing = (height > self.distance_threshold) & (height <= self.max_object_height)
            obst = torch.unique(flat[torch.from_numpy(standing)])
            cells[obst] = True
            if self.object_depth_m > 0 and len(obst):
                # The body of an object lies behind its visible surface: extend away from the sensor.
                cx, cy = grid.cell_center(obst // grid.W, obst % grid.W, dtype=torch.float64)
                rng_xy = torch.hypot(cx, cy).clamp(min=1e-6)
                step = torch.arange(1, int(self.object_depth_m / grid.resolution) + 1, dtype=torch.float64)
                step = step * grid.resolution
                ex = cx[:, None] + (cx / rng_xy)[:, None] * step[None, :]
                ey = cy[:, None] + (cy / rng_xy)[:, None] * step[None, :]
                er, ec = grid.world_to_cell(ex.reshape(-1), ey.reshape(-1))
                ok = grid.in_grid(er, ec)
                cells[(er * grid.W + ec)[ok]] = True
        return cells.view(grid.H, grid.W)

    def __call__(self, batch: Batch, grid: BevGrid) -> MaskResult:
        device = batch.points.device
        pts = batch.points.detach().to("cpu", torch.float64).numpy()
        bidx = pts[:, 0].astype(np.int64)
        cells, fallback = [], []
        for i in range(batch.size):
            c = self.frame_ground_cells(np.ascontiguousarray(pts[bidx == i, 1:4]), grid)
            fallback.append(c is None)
            cells.append(torch.zeros(grid.H, grid.W, dtype=torch.bool) if c is None else c)
        if not cells:
            return MaskResult.from_mask(torch.zeros(0, 1, grid.H, grid.W, device=device))
        m = torch.stack(cells).to(device)
        m = dilate(close(m, self.closing_m / grid.resolution), self.dilation_m / grid.resolution)
        fb = torch.tensor(fallback, device=device)
        m[fb] = True
        n_fb = int(sum(fallback))
        if n_fb:
            ids = [f.frame_id for f, b in zip(batch.frames, fallback, strict=True) if b]
            warnings.warn(
                f"GroundMask: no ground plane found in {n_fb} frame(s) {ids[:5]}: using an all-ones mask",
                stacklevel=2,
            )
        return MaskResult.from_mask(m[:, None].float(), n_fallback=n_fb)
