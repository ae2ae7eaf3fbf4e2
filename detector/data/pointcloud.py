"""Point-cloud files: KITTI ``.bin``, NumPy ``.npy``, ``.pcd`` and ``.ply`` (through open3d), read into the
[N, 4] float32 (x, y, z, reflectance) points a :class:`~detector.data.structures.Frame` holds; and the checks that
tell a user, in one line each, when a cloud does not look like what the detector was trained on.

Formats:
- ``.bin``: float32 x, y, z, reflectance per point (KITTI's velodyne files); the size must be a multiple of 16.
- ``.npy``: a numeric [N, 3] (x, y, z) or [N, 4] (x, y, z, reflectance) array (pickled objects are refused).
- ``.pcd`` / ``.ply``: open3d's reader; fields x, y, z and, when present, one named intensity, reflectance or
  remission. The header's point count is checked against the file size (binary data) and against what was read.

A cloud without a reflectance channel is read with 0 there and says so (:attr:`PointCloud.has_intensity`); points
with NaN or infinite coordinates are an error, or dropped and counted when asked. Every error is a
:class:`~detector.errors.KittiFormatError` naming the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from detector.errors import KittiFormatError
from detector.outputs import atomic_path

if TYPE_CHECKING:  # pragma: no cover
    from detector.geometry.voxelize import BevGrid

POINT_CLOUD_FORMATS = ("bin", "npy", "pcd", "ply")
# attribute names (lower case) read as the reflectance channel of a .pcd / .ply file
INTENSITY_NAMES = ("intensity", "reflectance", "remission", "scalar_intensity", "scalar_reflectance")


@dataclass
class PointCloud:
    """A point cloud as read: ``points`` [N, 4] float32 (x, y, z, reflectance); ``has_intensity`` False where the
    file had no reflectance channel (0 used); ``dropped`` the points with NaN or infinite values left out."""

    path: Path
    points: np.ndarray
    has_intensity: bool
    dropped: int = 0


def cloud_format(path: str | Path, fmt: str = "auto") -> str:
    """The format of ``path``: ``fmt`` itself, or with ``auto`` its extension's."""
    if fmt != "auto":
        if fmt not in POINT_CLOUD_FORMATS:
            raise ValueError(f"format={fmt!r}: choose auto, {', '.join(POINT_CLOUD_FORMATS)}")
        return fmt
    ext = Path(path).suffix.lower().lstrip(".")
    if ext not in POINT_CLOUD_FORMATS:
        raise KittiFormatError(path, f"unknown point-cloud format '{Path(path).suffix or '(no extension)'}': "
                               f"expected {', '.join('.' + f for f in POINT_CLOUD_FORMATS)} (or give format=...)")
    return ext


def list_point_clouds(folder: str | Path, fmt: str = "auto") -> list[Path]:
    """The point-cloud files of a folder (not its sub-folders), sorted by name: those of format ``fmt``, or with
    ``auto`` every file with a known extension. No such file, or two with the same name but for the extension
    (their outputs would collide), is an error naming the folder."""
    folder = Path(folder)
    exts = POINT_CLOUD_FORMATS if fmt == "auto" else (cloud_format(folder, fmt),)
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower().lstrip(".") in exts)
    if not files:
        raise KittiFormatError(folder, f"no point-cloud files ({', '.join('.' + e for e in exts)}) in this folder")
    stems: dict[str, Path] = {}
    for p in files:
        if p.stem in stems:
            raise KittiFormatError(folder, f"two point clouds named {p.stem}: {stems[p.stem].name} and {p.name} "
                                   "(give format=... to choose one)")
        stems[p.stem] = p
    return files


def read_point_cloud(path: str | Path, fmt: str = "auto", drop_nonfinite: bool = False) -> PointCloud:
    """Read a point cloud of any format (``fmt`` ``auto``: by the extension) into [N, 4] float32 points."""
    path = Path(path)
    fmt = cloud_format(path, fmt)
    _nonempty_size(path)
    if fmt == "bin":
        points, has_intensity = read_bin(path), True
    elif fmt == "npy":
        points, has_intensity = _read_npy(path)
    else:
        points, has_intensity = _read_open3d(path, fmt)
    if len(points) == 0:
        raise KittiFormatError(path, "empty point cloud (0 points)")
    points, dropped = finite_points(points, path, drop=drop_nonfinite)
    if len(points) == 0:
        raise KittiFormatError(path, f"no finite points: all {dropped} have NaN or infinite values")
    return PointCloud(path, points, has_intensity, dropped)


def _nonempty_size(path: Path) -> int:
    """The file's size in bytes; a missing or empty file is a :class:`KittiFormatError` naming it."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise KittiFormatError(path, "point cloud file not found") from None
    if size == 0:
        raise KittiFormatError(path, "empty point cloud (0 bytes)")
    return size


def read_bin(path: str | Path) -> np.ndarray:
    """[N, 4] float32 of a KITTI velodyne ``.bin`` as stored (see :func:`finite_points`); rejects truncated and
    empty files."""
    path = Path(path)
    size = _nonempty_size(path)
    if size % 16:
        raise KittiFormatError(
            path, f"truncated point cloud: {size} bytes is not a multiple of 16 (4 float32 per point)"
        )
    pts = np.fromfile(path, dtype=np.float32)
    if pts.size * 4 != size:
        raise KittiFormatError(path, f"could read only {pts.size * 4} of {size} bytes")
    return pts.reshape(-1, 4)


def finite_points(points: np.ndarray, path: str | Path, drop: bool = False) -> tuple[np.ndarray, int]:
    """``(points, dropped)``: points with a NaN or infinite value are an error naming the file and the first of
    them, or with ``drop`` left out and counted."""
    if np.isfinite(points).all():  # the per-point mask only on the (rare) failure path
        return points, 0
    bad = ~np.isfinite(points).all(axis=1)
    if not drop:
        first = int(np.flatnonzero(bad)[0])
        raise KittiFormatError(path, f"{int(bad.sum())} points with NaN or infinite values (first: point {first})")
    return points[~bad], int(bad.sum())


def _with_intensity(xyz: np.ndarray, intensity: np.ndarray | None) -> np.ndarray:
    out = np.zeros((len(xyz), 4), dtype=np.float32)
    out[:, :3] = xyz
    if intensity is not None:
        out[:, 3] = intensity.reshape(len(xyz))
    return out


def _read_npy(path: Path) -> tuple[np.ndarray, bool]:
    try:
        a = np.load(path, allow_pickle=False)
    except ValueError as e:
        what = "holds pickled objects (refused)" if "pickle" in str(e) else f"truncated or corrupt .npy file ({e})"
        raise KittiFormatError(path, what) from None
    except (EOFError, OSError) as e:
        raise KittiFormatError(path, f"truncated or corrupt .npy file ({type(e).__name__})") from None
    if not isinstance(a, np.ndarray) or a.dtype.kind not in "fiu" or a.ndim != 2 or a.shape[1] not in (3, 4):
        shape = getattr(a, "shape", "?")
        raise KittiFormatError(path, f"expected a numeric [N, 3] or [N, 4] array (x, y, z[, reflectance]), "
                               f"got {getattr(a, 'dtype', type(a).__name__)} of shape {shape}")
    a = a.astype(np.float32, copy=False)
    if a.shape[1] == 4:
        return np.ascontiguousarray(a), True
    return _with_intensity(a, None), False


# --- .pcd / .ply (open3d) --------------------------------------------------------------------------------------
_PLY_SIZES = {"char": 1, "int8": 1, "uchar": 1, "uint8": 1, "short": 2, "int16": 2, "ushort": 2, "uint16": 2,
              "int": 4, "int32": 4, "uint": 4, "uint32": 4, "float": 4, "float32": 4, "double": 8, "float64": 8}


def _header_lines(path: Path, end: str) -> tuple[list[list[str]], int]:
    """The header's lines, split into words, up to and including the first one that starts with ``end``, and the
    byte offset where the data begins."""
    with open(path, "rb") as fh:
        head = fh.read(1 << 16)
    lines, offset = [], 0
    for raw in head.split(b"\n"):
        offset += len(raw) + 1
        words = raw.decode("latin-1").split()
        if not words or words[0].startswith("#") or words[0] == "comment":
            continue
        lines.append(words)
        if words[0] == end:
            return lines, offset
    raise KittiFormatError(path, f"not a {path.suffix.lstrip('.').upper() or 'PCD/PLY'} file: "
                           f"no '{end}' line in its header")


def _pcd_points(path: Path, size: int) -> int:
    """The point count a PCD header announces; a binary file too short for it is an error."""
    lines, data_at = _header_lines(path, "DATA")
    head = {w[0].upper(): w[1:] for w in lines}
    fields = head.get("FIELDS", [])
    if not {"x", "y", "z"} <= set(fields):
        raise KittiFormatError(path, f"no x, y, z fields in the PCD header (FIELDS {' '.join(fields)})")
    try:
        n = int(head["POINTS"][0]) if "POINTS" in head else int(head["WIDTH"][0]) * int(head["HEIGHT"][0])
        if head["DATA"][0].lower() == "ascii":
            _check_ascii_rows(path, data_at, n, "PCD")
        elif head["DATA"][0].lower() == "binary":
            counts = head.get("COUNT", ["1"] * len(fields))
            row = sum(int(s) * int(c) for s, c in zip(head["SIZE"], counts, strict=True))
            if size < data_at + n * row:
                raise KittiFormatError(path, f"truncated PCD file: {size} bytes, its header's {n} points of "
                                       f"{row} bytes need {data_at + n * row}")
    except (KeyError, IndexError, ValueError) as e:
        if isinstance(e, KittiFormatError):
            raise
        raise KittiFormatError(path, "unreadable PCD header (POINTS, SIZE, COUNT or DATA missing or bad)") from None
    return n


def _ply_points(path: Path, size: int) -> int:
    """The vertex count a PLY header announces; a binary file too short for it is an error."""
    lines, data_at = _header_lines(path, "end_header")
    if lines[0] != ["ply"]:
        raise KittiFormatError(path, "not a PLY file (it does not start with 'ply')")
    fmt = next((w[1] for w in lines if w[0] == "format" and len(w) > 1), "")
    elements: list[tuple[str, int, list[list[str]]]] = []
    try:
        for w in lines:
            if w[0] == "element":
                elements.append((w[1], int(w[2]), []))
            elif w[0] == "property" and elements:
                elements[-1][2].append(w[1:])
    except (IndexError, ValueError):
        raise KittiFormatError(path, "unreadable PLY header (a bad 'element' line)") from None
    vertex = next((e for e in elements if e[0] == "vertex"), None)
    if vertex is None:
        raise KittiFormatError(path, "no 'element vertex' in the PLY header")
    names = {p[-1] for p in vertex[2]}
    if not {"x", "y", "z"} <= names:
        raise KittiFormatError(path, f"no x, y, z vertex properties in the PLY header ({' '.join(sorted(names))})")
    n = vertex[1]
    if fmt == "ascii":
        _check_ascii_rows(path, data_at, n, "PLY")
    scalar = all(len(p) == 2 and p[0] in _PLY_SIZES for p in vertex[2])
    if fmt.startswith("binary") and elements[0] is vertex and scalar:
        row = sum(_PLY_SIZES[p[0]] for p in vertex[2])
        if size < data_at + n * row:
            raise KittiFormatError(path, f"truncated PLY file: {size} bytes, its header's {n} vertices of {row} "
                                   f"bytes need {data_at + n * row}")
    return n


def _check_ascii_rows(path: Path, data_at: int, n: int, kind: str) -> None:
    """ASCII data must hold at least the header's row count (open3d fills missing rows with garbage)."""
    with open(path, "rb") as fh:
        fh.seek(data_at)
        rows = sum(1 for line in fh if line.strip())
    if rows < n:
        raise KittiFormatError(path, f"truncated {kind} file: its header says {n} points, {rows} in the file")


def _read_open3d(path: Path, fmt: str) -> tuple[np.ndarray, bool]:
    size = path.stat().st_size
    n = _pcd_points(path, size) if fmt == "pcd" else _ply_points(path, size)
    if n == 0:
        raise KittiFormatError(path, "empty point cloud (its header says 0 points)")
    import open3d as o3d

    level = o3d.utility.get_verbosity_level()
    o3d.utility.set_verbosity_level(o3d.utility.VerbosityLevel.Error)  # failures are reported below, in one line
    try:
        pc = o3d.t.io.read_point_cloud(str(path), format=fmt)
    finally:
        o3d.utility.set_verbosity_level(level)
    if "positions" not in pc.point:
        raise KittiFormatError(path, f"open3d could not read this {fmt.upper()} file (corrupt or truncated data)")
    xyz = pc.point.positions.numpy()
    if len(xyz) != n:
        raise KittiFormatError(path, f"truncated {fmt.upper()} file: its header says {n} points, {len(xyz)} read")
    intensity = next((pc.point[k].numpy() for k in pc.point if k.lower() in INTENSITY_NAMES), None)
    return _with_intensity(xyz, intensity), intensity is not None


# --- writing -------------------------------------------------------------------------------------------------
def write_point_cloud(path: str | Path, points: np.ndarray, fmt: str = "auto") -> None:
    """Write [N, 3] or [N, 4] points (x, y, z[, reflectance]) as ``fmt`` (``auto``: by the extension), whole or not
    at all. ``.bin`` needs the reflectance column (KITTI's layout has one); ``.pcd``/``.ply`` store it as the field
    ``intensity``."""
    path = Path(path)
    fmt = cloud_format(path, fmt)
    pts = np.ascontiguousarray(points, dtype=np.float32)
    if pts.ndim != 2 or pts.shape[1] not in (3, 4) or (fmt == "bin" and pts.shape[1] != 4):
        raise ValueError(f"{path}: points must be [N, 4]{'' if fmt == 'bin' else ' or [N, 3]'}, got {pts.shape}")
    with atomic_path(path) as tmp:
        if fmt == "bin":
            tmp.write_bytes(pts.tobytes())
        elif fmt == "npy":
            with open(tmp, "wb") as fh:  # np.save on a path would append .npy to the temporary name
                np.save(fh, pts)
        else:
            import open3d as o3d

            pc = o3d.t.geometry.PointCloud()
            pc.point.positions = o3d.core.Tensor(np.ascontiguousarray(pts[:, :3]))
            if pts.shape[1] == 4:
                pc.point.intensity = o3d.core.Tensor(np.ascontiguousarray(pts[:, 3:4]))
            if not o3d.t.io.write_point_cloud(str(tmp), pc, write_ascii=False):
                raise OSError(f"{path}: open3d could not write the {fmt.upper()} file")


# --- does it look like the training data? --------------------------------------------------------------------
MIN_INSIDE = 0.25  # a full 360-degree scan has about half its points in a forward-looking grid
SHAPE_MIN_POINTS = 100  # the units / up-axis checks need a few points to mean anything


def sanity_notes(cloud: PointCloud, grid: BevGrid) -> list[tuple[str, str]]:
    """``(kind, one line)`` for each way the cloud does not look like the detector's training data (KITTI-like:
    metres, x forward, y left, z up, sensor ~1.7 m above the ground, reflectance in [0, 1]):

    - ``no_intensity``: the file has no reflectance channel (0 used);
    - ``nonfinite``: points with NaN / infinite values were dropped;
    - ``intensity_range``: reflectance beyond [0, 1] (e.g. 8-bit 0-255 values);
    - ``units``: the median distance from the sensor is over 200 (a scan's is ~5-30 m): centimetres, or over 2000:
      millimetres;
    - ``up_axis``: x or y spreads less than half as much as z (5th to 95th percentile): that axis looks vertical;
    - ``outside_grid``: fewer than :data:`MIN_INSIDE` of the points lie inside the grid (x, y and z).
    """
    pts = cloud.points
    notes = []
    if not cloud.has_intensity:
        notes.append(("no_intensity", "no intensity channel: 0 used for every point (the detector was trained "
                      "with the LiDAR's reflectance in [0, 1]; expect fewer or weaker detections)"))
    if cloud.dropped:
        notes.append(("nonfinite", f"{cloud.dropped} points with NaN or infinite values dropped"))
    if cloud.has_intensity and len(pts) and (pts[:, 3].max() > 1.0 or pts[:, 3].min() < 0.0):
        notes.append(("intensity_range", f"reflectance ranges over [{pts[:, 3].min():.4g}, {pts[:, 3].max():.4g}] "
                      "where the training data's lies in [0, 1] (8-bit values: intensity_scale=0.00392 scales by "
                      "1/255)"))
    xyz = pts[:, :3].astype(np.float64)
    if len(pts) >= SHAPE_MIN_POINTS:
        med = float(np.median(np.linalg.norm(xyz, axis=1)))
        if med > 200:
            unit, factor = ("millimetres", 1000) if med > 2000 else ("centimetres", 100)
            notes.append(("units", f"coordinates look like {unit}: the median distance from the sensor is {med:.0f} "
                          f"(a LiDAR scan's is ~5-30 m), about {factor}x too large; the detector expects metres"))
        spread = np.percentile(xyz, 95, axis=0) - np.percentile(xyz, 5, axis=0)
        flat = int(np.argmin(spread[:2]))
        if spread[2] > 2 * spread[flat]:
            axis = "xy"[flat]
            notes.append(("up_axis", f"{axis} looks vertical, not z: the points spread {spread[flat]:.2f} along "
                          f"{axis} but {spread[2]:.2f} along z (5th-95th percentile); the detector expects x forward, "
                          "y left, z up"))
    gx, gy, gz = grid.x_range, grid.y_range, grid.z_range
    in_xy = (xyz[:, 0] >= gx[0]) & (xyz[:, 0] < gx[1]) & (xyz[:, 1] >= gy[0]) & (xyz[:, 1] < gy[1])
    in_z = (xyz[:, 2] >= gz[0]) & (xyz[:, 2] < gz[1])
    inside = float((in_xy & in_z).mean())
    if inside < MIN_INSIDE:
        line = (f"most points lie outside the detector's grid: {inside:.0%} inside x [{gx[0]:g}, {gx[1]:g}) "
                f"y [{gy[0]:g}, {gy[1]:g}) z [{gz[0]:g}, {gz[1]:g}) m (a full 360-degree scan has about half)")
        if in_xy.mean() >= MIN_INSIDE:
            line += (f"; their heights are the cause: median z {np.median(xyz[in_xy, 2]):.2f} m, where the training "
                     "data's sensor sits ~1.7 m above the ground (ground at z ~ -1.7 m)")
        notes.append(("outside_grid", line))
    return notes
