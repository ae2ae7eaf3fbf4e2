"""Box masks and morphology on the BEV grid (torch, any device).

- :func:`box_cells`: the grid cells of every box (a cell belongs to a box iff its centre lies in the box's
  rotated BEV rectangle, enlarged by a margin, or it holds the box's centre); :func:`boxes_mask` the mask
  of those cells on a (coarser) grid: the predicted mask's target, and what mask quality measures.
- Morphology with a disk of radius ``r`` metres: dilation turns on every cell whose centre lies within
  ``r`` of an "on" cell's centre (offsets (dr, dc) with dr² + dc² <= (r / res)²); erosion is its dual
  (cells outside the grid count as "on"), closing = dilation then erosion.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from detector.geometry.boxes import Boxes3D
from detector.geometry.voxelize import BevGrid


def check_radius(radius_m: float, name: str) -> float:
    r = float(radius_m)
    if not (math.isfinite(r) and r >= 0):
        raise ValueError(f"{name} must be a finite radius >= 0 metres, got {radius_m!r}")
    return r


def _row_distance(mask: torch.Tensor) -> torch.Tensor:
    """[B, H, W] int32: per row, the column distance to the nearest on cell of that row (> W if none)."""
    W = mask.shape[2]
    idx = torch.arange(W, dtype=torch.int32, device=mask.device).expand_as(mask)
    far = torch.tensor(2 * W + 2, dtype=torch.int32, device=mask.device)
    last = torch.where(mask, idx, -far).cummax(dim=2).values  # nearest on cell at or left of c
    nxt = torch.where(mask, idx, far).flip(2).cummin(dim=2).values.flip(2)  # at or right of c
    return torch.minimum(idx - last, nxt - idx)


def dilate(mask: torch.Tensor, radius_cells: float) -> torch.Tensor:
    """Binary dilation of ``mask`` [B, H, W] bool by a disk of radius ``radius_cells`` (cell units).

    A disk is a union of horizontal runs: cell (r, c) is on iff for some |dy| <= radius the row r + dy
    has an on cell within floor(sqrt(radius² − dy²)) columns of c."""
    if mask.dim() != 3 or mask.dtype != torch.bool:
        raise ValueError(f"dilate expects a [B, H, W] bool tensor, got {tuple(mask.shape)} {mask.dtype}")
    r = int(math.floor(radius_cells + 1e-9))
    if r <= 0 or mask.numel() == 0:
        return mask.clone()
    H = mask.shape[1]
    dist = _row_distance(mask)
    out = dist <= r
    for dy in range(1, min(r, H - 1) + 1):
        half = int(math.floor(math.sqrt(max(radius_cells**2 - dy * dy, 0.0)) + 1e-9))
        run = dist <= half
        out[:, dy:] |= run[:, : H - dy]
        out[:, : H - dy] |= run[:, dy:]
    return out


def erode(mask: torch.Tensor, radius_cells: float) -> torch.Tensor:
    """Binary erosion (dual of :func:`dilate`; cells outside the grid count as on)."""
    return ~dilate(~mask, radius_cells)


def close(mask: torch.Tensor, radius_cells: float) -> torch.Tensor:
    """Binary closing: dilation then erosion with the same disk (fills gaps narrower than the disk)."""
    return erode(dilate(mask, radius_cells), radius_cells)


# --------------------------------------------------------------------------------------------------
# Ground-truth mask from boxes
# --------------------------------------------------------------------------------------------------
def box_cells(boxes_per_frame: Sequence[Boxes3D], grid: BevGrid, dilation_m: float = 0.0,
              device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The grid cells of every box: ``(box, cell)`` int64 pairs, ``box`` indexing the boxes of all frames in
    order, ``cell`` the flat index ``(frame * H + row) * W + col``; each pair once.

    Rule: a cell belongs to a box iff its centre lies inside (or on the border of) the box's rotated BEV
    rectangle enlarged by ``dilation_m`` on every side, or it holds the box's centre (so an object smaller
    than a cell is never lost). Cells outside the grid belong to no box."""
    d = check_radius(dilation_m, "boxes_mask dilation_m")
    B, g = len(boxes_per_frame), grid
    if device is None:
        device = boxes_per_frame[0].tensor.device if B else "cpu"
    counts = [len(b) for b in boxes_per_frame]
    if sum(counts) == 0:
        return torch.zeros(0, dtype=torch.int64, device=device), torch.zeros(0, dtype=torch.int64, device=device)
    t = torch.cat([b.tensor.detach().to(device, torch.float64) for b in boxes_per_frame])  # [K, 7]
    fidx = torch.repeat_interleave(torch.arange(B, device=device), torch.tensor(counts, device=device))
    x, y, yaw = t[:, 0], t[:, 1], t[:, 6]
    hx, hy = t[:, 3] / 2 + d, t[:, 4] / 2 + d
    cos, sin = torch.cos(yaw), torch.sin(yaw)
    ax = cos.abs() * hx + sin.abs() * hy  # half-size of the axis-aligned bounding box
    ay = sin.abs() * hx + cos.abs() * hy
    r0, c0 = g.world_to_cell(x - ax, y - ay)
    r1, c1 = g.world_to_cell(x + ax, y + ay)
    nh = int((r1 - r0).max()) + 1
    nw = int((c1 - c0).max()) + 1
    dr = torch.arange(nh, device=device)
    dc = torch.arange(nw, device=device)
    rows = (r0[:, None, None] + dr[None, :, None]).expand(-1, nh, nw)  # [K, nh, nw]
    cols = (c0[:, None, None] + dc[None, None, :]).expand(-1, nh, nw)
    px, py = g.cell_center(rows, cols, dtype=torch.float64)
    dx, dy = px - x[:, None, None], py - y[:, None, None]
    lx = dx * cos[:, None, None] + dy * sin[:, None, None]
    ly = -dx * sin[:, None, None] + dy * cos[:, None, None]
    on = (lx.abs() <= hx[:, None, None]) & (ly.abs() <= hy[:, None, None]) & g.in_grid(rows, cols)
    on &= (rows <= r1[:, None, None]) & (cols <= c1[:, None, None])
    flat = (fidx[:, None, None] * g.H + rows) * g.W + cols
    rc, cc = g.world_to_cell(x, y)  # the centre cell of every box (once more where the rectangle has it)
    centre = g.in_grid(rc, cc) & ~(on & (flat == ((fidx * g.H + rc) * g.W + cc)[:, None, None])).flatten(1).any(1)
    kid = torch.arange(len(t), device=device)
    box = torch.cat([kid[:, None, None].expand_as(flat)[on], kid[centre]])
    cell = torch.cat([flat[on], ((fidx * g.H + rc) * g.W + cc)[centre]])
    return box, cell


def boxes_mask(
    boxes_per_frame: Sequence[Boxes3D],
    grid: BevGrid,
    dilation_m: float,
    downsample: int = 1,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """[B, 1, H/d, W/d] float32 in {0, 1}: the cells of the ``downsample``-times coarser grid that belong to
    a box enlarged by ``dilation_m`` on every side (:func:`box_cells`' rule).
    ``device``: where the mask goes (default: the first frame's boxes' device).
    """
    g = grid.downsampled(downsample)
    B = len(boxes_per_frame)
    if device is None:
        device = boxes_per_frame[0].tensor.device if B else "cpu"
    out = torch.zeros(B * g.H * g.W, dtype=torch.float32, device=device)
    _, cell = box_cells(boxes_per_frame, g, dilation_m, device)
    out[cell] = 1.0
    return out.view(B, 1, g.H, g.W)
