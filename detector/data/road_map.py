"""Road maps: a frame's drivable area as a BEV raster (``training/road_map/%06d.png`` + ``grid.json``).

Our simulator writes them; real KITTI has none. The raster is never resampled by augmentation: a road map
carries the affine map from the (augmented) LiDAR frame to its own coordinates instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from detector.errors import KittiFormatError


@dataclass
class RoadMap:
    """Drivable area as a BEV raster: ``raster`` [rows, cols] bool, row r / column c covering
    y' in [y_min + r·res, y_min + (r+1)·res) and x' in [x_min + c·res, ...), where (x', y') are the
    raster's own coordinates: the LiDAR frame's (x, y), or ``to_raster`` [2, 3] @ (x, y, 1) once
    augmentation has flipped, rotated or scaled the scene (the raster itself is never resampled)."""

    raster: np.ndarray
    x_min: float
    y_min: float
    resolution: float
    to_raster: np.ndarray | None = None

    def grid(self) -> dict:
        return {
            "x_min": self.x_min,
            "y_min": self.y_min,
            "resolution": self.resolution,
            "rows": int(self.raster.shape[0]),
            "cols": int(self.raster.shape[1]),
            "rows_axis": "y",
            "cols_axis": "x",
            "frame": "lidar",
        }

    def transformed(self, matrix: np.ndarray) -> RoadMap:
        """The road map of the scene after the linear map ``matrix`` [2, 2] (points p -> matrix @ p)."""
        inv = np.linalg.inv(np.asarray(matrix, dtype=np.float64))
        cur = np.eye(2, 3) if self.to_raster is None else self.to_raster
        new = np.concatenate([cur[:, :2] @ inv, cur[:, 2:]], axis=1)
        return RoadMap(self.raster, self.x_min, self.y_min, self.resolution, new)

    def lookup(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Drivable (bool, same shape as x) at LiDAR positions (x, y); outside the raster: False."""
        x = np.asarray(x, dtype=np.float64)
        y = np.asarray(y, dtype=np.float64)
        if self.to_raster is not None:
            m = self.to_raster
            x, y = m[0, 0] * x + m[0, 1] * y + m[0, 2], m[1, 0] * x + m[1, 1] * y + m[1, 2]
        rows, cols = self.raster.shape
        c = np.floor((x - self.x_min) / self.resolution).astype(np.int64)
        r = np.floor((y - self.y_min) / self.resolution).astype(np.int64)
        ok = (r >= 0) & (r < rows) & (c >= 0) & (c < cols)
        out = np.zeros(x.shape, dtype=bool)
        out[ok] = self.raster[r[ok], c[ok]]
        return out


def write_road_map(png_path: str | Path, road: RoadMap) -> None:
    """Write the raster as an 8-bit PNG (255 = drivable) and the grid as ``grid.json`` beside it."""
    import open3d as o3d

    if road.to_raster is not None:
        raise ValueError("write_road_map: a transformed (augmented) road map cannot be written")
    png_path = Path(png_path)
    img = np.ascontiguousarray(road.raster.astype(np.uint8) * 255)
    if not o3d.io.write_image(str(png_path), o3d.geometry.Image(img)):
        raise OSError(f"{png_path}: could not write PNG")
    grid_path = png_path.parent / "grid.json"
    text = json.dumps(road.grid(), indent=1)
    if not grid_path.exists() or grid_path.read_text() != text:
        grid_path.write_text(text)


def read_road_map(png_path: str | Path) -> RoadMap:
    import open3d as o3d

    png_path = Path(png_path)
    grid_path = png_path.parent / "grid.json"
    if not png_path.exists():
        raise KittiFormatError(png_path, "road map not found")
    try:
        grid = json.loads(grid_path.read_text())
    except FileNotFoundError:
        raise KittiFormatError(grid_path, "road map grid description not found") from None
    except json.JSONDecodeError as e:
        raise KittiFormatError(grid_path, f"invalid JSON: {e}") from None
    img = np.asarray(o3d.io.read_image(str(png_path)))
    if img.ndim == 3:
        img = img[..., 0]
    if img.shape != (grid.get("rows"), grid.get("cols")):
        raise KittiFormatError(
            png_path, f"raster is {img.shape}, grid.json says {(grid.get('rows'), grid.get('cols'))}"
        )
    return RoadMap(img > 127, float(grid["x_min"]), float(grid["y_min"]), float(grid["resolution"]))
