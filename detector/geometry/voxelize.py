"""The BEV grid and the voxelizer: a batch of point clouds → a PIXOR-style BEV tensor.

Grid convention (shared by the voxelizer, the masks and the target encoding):
- column ``c`` grows with x from ``x_min``; row ``r`` grows with y from ``y_min``; slice ``s`` grows with z
  from ``z_min``. A BEV tensor is [B, C, H, W] with H rows (along y) and W columns (along x).
- Cells are half-open. Along each axis with n cells, cell k covers [b_k, b_{k+1}) where the borders are
  ``b_k = lo + k * res`` evaluated in float64 for 0 <= k < n, and ``b_n = hi`` (the range's upper end).
  A point exactly on a border therefore belongs to the upper cell, whatever its dtype: float32
  coordinates are compared exactly (they are widened to float64, which is lossless).
- Memory layout: channels-last (``bev.is_contiguous(memory_format=torch.channels_last)``), the layout the
  backbone and the mask network convolve in: the scatter writes it directly, so no permuting copy of the
  map follows.
- Channels: C = n_slices + 1. Channel s < n_slices is the occupancy (0/1) of height slice s; the last
  channel is the intensity of the BEV cell: the **maximum** reflectance of the in-range points in that
  column (0 for an empty column). Max (not mean) is chosen because it is bitwise deterministic on every
  device (no floating-point accumulation order), and PIXOR only needs "the reflectance of the cell".

Pseudo-code of :func:`voxelize` (what the vectorized code computes)::

    bev = zeros(B, C, H, W)
    for (b, x, y, z, r) in points:
        if not (x_min <= x < x_max and y_min <= y < y_max and z_min <= z < z_max): dropped[b] += 1; continue
        col, row, s = cell(x), cell(y), cell(z)
        bev[b, s, row, col] = 1
        bev[b, C - 1, row, col] = max(bev[b, C - 1, row, col] if touched else -inf, r)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from detector.errors import ConfigError


def _as_range(name: str, value: Sequence[float]) -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ConfigError(f"BevGrid.{name} must be two numbers (min, max), got {value!r}") from None
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ConfigError(f"BevGrid.{name} must be finite, got {(lo, hi)}")
    if lo >= hi:
        raise ConfigError(f"BevGrid.{name}: min must be < max, got {(lo, hi)}")
    return lo, hi


def _n_cells(name: str, lo: float, hi: float, res: float) -> int:
    extent = hi - lo
    n = round(extent / res)
    if n < 1:
        raise ConfigError(f"BevGrid.{name} = {(lo, hi)} holds zero cells of {res} m")
    if abs(n * res - extent) > 1e-6 * max(1.0, extent):
        raise ConfigError(
            f"BevGrid.{name} = {(lo, hi)}: its extent {extent:g} m is not a whole number of {res} m cells"
        )
    return n


@dataclass(frozen=True)
class BevGrid:
    """A BEV voxel grid in the LiDAR frame (metres). See the module docstring for the cell convention.

    ``resolution`` is the BEV cell size (x and y), ``z_resolution`` the height-slice thickness.
    Derived: ``W`` columns (x), ``H`` rows (y), ``n_slices`` height slices, ``C = n_slices + 1`` channels.
    Invalid grids (min >= max, non-positive resolution, zero cells, an extent that is not a whole number
    of cells) raise ConfigError at construction.
    """

    x_range: tuple[float, float]
    y_range: tuple[float, float]
    z_range: tuple[float, float]
    resolution: float
    z_resolution: float

    def __post_init__(self):
        for name in ("resolution", "z_resolution"):
            v = getattr(self, name)
            try:
                v = float(v)
            except (TypeError, ValueError):
                raise ConfigError(f"BevGrid.{name} must be a number, got {v!r}") from None
            if not (math.isfinite(v) and v > 0):
                raise ConfigError(f"BevGrid.{name} must be positive, got {v}")
            object.__setattr__(self, name, v)
        for name in ("x_range", "y_range", "z_range"):
            object.__setattr__(self, name, _as_range(name, getattr(self, name)))
        # Computed once (validates the extents too).
        object.__setattr__(self, "_W", _n_cells("x_range", *self.x_range, self.resolution))
        object.__setattr__(self, "_H", _n_cells("y_range", *self.y_range, self.resolution))
        object.__setattr__(self, "_S", _n_cells("z_range", *self.z_range, self.z_resolution))

    # --- sizes -------------------------------------------------------------------------------------
    @property
    def W(self) -> int:
        """Columns (along x)."""
        return self._W

    @property
    def H(self) -> int:
        """Rows (along y)."""
        return self._H

    @property
    def n_slices(self) -> int:
        return self._S

    @property
    def C(self) -> int:
        """Channels: height slices + 1 intensity channel."""
        return self._S + 1

    @property
    def shape(self) -> tuple[int, int, int]:
        """(C, H, W) of one frame's BEV tensor."""
        return (self.C, self.H, self.W)

    def downsampled(self, factor: int) -> BevGrid:
        """The same extent with cells ``factor`` times larger (H and W must be divisible by it)."""
        if not isinstance(factor, int) or factor < 1:
            raise ValueError(f"downsample factor must be a positive integer, got {factor!r}")
        if self.H % factor or self.W % factor:
            raise ValueError(f"grid {self.H}x{self.W} (HxW) is not divisible by downsample factor {factor}")
        return BevGrid(self.x_range, self.y_range, self.z_range, self.resolution * factor, self.z_resolution)

    # --- coordinates ---------------------------------------------------------------------------------
    def world_to_cell(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, cols) int64 of the cells holding (x, y), exact at borders (module docstring).

        Not clamped: positions outside the grid give rows/cols < 0 or >= H/W (see :meth:`in_grid`)."""
        x = torch.as_tensor(x)
        y = torch.as_tensor(y)
        cols = axis_index(x, *self.x_range, self.resolution, self.W)
        rows = axis_index(y, *self.y_range, self.resolution, self.H)
        return rows, cols

    def z_to_slice(self, z: torch.Tensor) -> torch.Tensor:
        """Height-slice index (int64, not clamped) of heights ``z``."""
        return axis_index(torch.as_tensor(z), *self.z_range, self.z_resolution, self.n_slices)

    def in_grid(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        return (rows >= 0) & (rows < self.H) & (cols >= 0) & (cols < self.W)

    def cell_center(
        self, rows: torch.Tensor, cols: torch.Tensor, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of the centres of cells (rows, cols): ``x = x_min + (col + 0.5) * res`` (float64 math)."""
        rows = torch.as_tensor(rows)
        cols = torch.as_tensor(cols)
        x = self.x_range[0] + (cols.to(torch.float64) + 0.5) * self.resolution
        y = self.y_range[0] + (rows.to(torch.float64) + 0.5) * self.resolution
        return x.to(dtype), y.to(dtype)


def axis_index(v: torch.Tensor, lo: float, hi: float, res: float, n: int) -> torch.Tensor:
    """Index k with b_k <= v < b_{k+1} (b_k = lo + k*res in float64, b_n = hi); below lo: < 0, at or
    above hi: >= n. NaN maps to -1."""
    v = v.to(torch.float64)
    k = torch.floor((v - lo) / res)
    # floor of the quotient can be off by one next to a border: compare with the borders themselves.
    k = k - (v < lo + k * res).to(k.dtype)
    k = k + (v >= lo + (k + 1) * res).to(k.dtype)
    inside = (v >= lo) & (v < hi)
    k = torch.where(inside, k.clamp(0, n - 1), torch.where(v < lo, k.clamp(max=-1), k.clamp(min=n)))
    k = torch.nan_to_num(k, nan=-1.0, posinf=float(n), neginf=-1.0)
    return k.to(torch.int64)


def _index_in_range(
    v: torch.Tensor, lo: float, hi: float, res: float, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, valid): :func:`axis_index` for the in-range values (``valid``: lo <= v < hi, False for NaN);
    ``k`` is meaningless where not valid. Fewer passes than axis_index (the voxelizer's hot path)."""
    v = v.to(torch.float64)
    k = torch.floor((v - lo) / res)
    k = torch.where(v < lo + k * res, k - 1, k)
    k = torch.where(v >= lo + (k + 1) * res, k + 1, k)
    valid = (v >= lo) & (v < hi)
    return k.clamp_(0, n - 1).to(torch.int64), valid


@dataclass
class VoxelStats:
    """What :func:`voxelize` kept and dropped. Tensors stay on the input's device (no sync); the int
    properties synchronize when read."""

    points_per_frame: torch.Tensor  # [B] int64, points given per frame
    dropped_per_frame: torch.Tensor  # [B] int64, points outside the grid's x/y/z range (or non-finite)

    @property
    def n_points(self) -> int:
        return int(self.points_per_frame.sum())

    @property
    def n_dropped(self) -> int:
        return int(self.dropped_per_frame.sum())


def voxelize(points: torch.Tensor, batch_size: int, grid: BevGrid) -> tuple[torch.Tensor, VoxelStats]:
    """Points of a batch [ΣN, 5] = (batch index, x, y, z, reflectance) → (BEV [B, C, H, W] float32 in the
    channels-last layout, stats).

    Runs on the points' device in a single scatter pass (no loop over points or frames). Points outside
    the grid's range (half-open, see the module docstring) or with non-finite coordinates are dropped and
    counted per frame. Raises ValueError on a bad shape, a non-float tensor, or a batch index that is not
    an integer in [0, batch_size).
    """
    if not isinstance(points, torch.Tensor):
        raise ValueError(f"voxelize: points must be a torch.Tensor [N, 5], got {type(points).__name__}")
    if points.dim() != 2 or points.shape[1] != 5:
        raise ValueError(
            f"voxelize: points must be [N, 5] (batch index, x, y, z, reflectance) not {tuple(points.shape)}"
        )
    if not points.is_floating_point():
        raise ValueError(f"voxelize: points must be a float tensor, got {points.dtype}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"voxelize: batch_size must be a positive int, got {batch_size!r}")
    B, C, H, W, S = batch_size, grid.C, grid.H, grid.W, grid.n_slices
    device = points.device

    bidx_f = points[:, 0]
    bidx = bidx_f.to(torch.int64)
    bad_b = (bidx < 0) | (bidx >= B) | (bidx.to(bidx_f.dtype) != bidx_f)
    if bool(bad_b.any()):
        first = int(torch.nonzero(bad_b)[0, 0])
        raise ValueError(
            f"voxelize: batch index must be an integer in [0, {B}); point {first} has {float(bidx_f[first])}"
        )

    cols, valid = _index_in_range(points[:, 1], *grid.x_range, grid.resolution, W)
    rows, ok = _index_in_range(points[:, 2], *grid.y_range, grid.resolution, H)
    valid &= ok
    slc, ok = _index_in_range(points[:, 3], *grid.z_range, grid.z_resolution, S)
    valid &= ok

    # One flat buffer with a trailing dump slot for dropped points: no boolean compaction (no sync).
    n_cells = B * C * H * W
    flat = torch.zeros(n_cells + 1, dtype=torch.float32, device=device)
    column = ((bidx * H + rows) * W + cols) * C  # index of (b, 0, row, col) in the channels-last layout
    occ_idx = torch.where(valid, column + slc, n_cells)
    int_idx = torch.where(valid, column + S, n_cells)
    flat.index_fill_(0, occ_idx, 1.0)
    refl = points[:, 4].to(torch.float32)
    flat.scatter_reduce_(0, int_idx, refl, reduce="amax", include_self=False)
    bev = flat[:n_cells].view(B, H, W, C).permute(0, 3, 1, 2)  # [B, C, H, W], channels-last in memory

    points_per_frame = torch.bincount(bidx, minlength=B)
    dropped_per_frame = torch.bincount(bidx, weights=(~valid).to(torch.float32), minlength=B).to(torch.int64)
    return bev, VoxelStats(points_per_frame, dropped_per_frame)
