"""LiDAR-frame label and result files of a LiDAR-only dataset (:mod:`detector.data.lidar`).

One object a line: ``x y z dx dy dz heading class`` (OpenPCDet's custom format: (x, y, z) the box centre, (dx, dy,
dz) length, width, height in metres, heading the yaw about +z from +x in radians), a score as a ninth field in
result files. Every number is read as float64 and written as the shortest decimal that reads back the same.
Every error is a :class:`~detector.errors.KittiFormatError` naming the file and line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from detector.errors import KittiFormatError

LABEL_FIELDS = ("x", "y", "z", "dx", "dy", "dz", "heading")


@dataclass
class LidarLabels:
    """The objects of one LiDAR-frame label (or result) file: ``boxes`` [N, 7] float64 (x, y, z, dx, dy, dz,
    heading; centre), ``name`` [N], ``score`` [N] (result files only, else None), ``line`` [N] the 1-based line of
    each object in its file (0 for records made in memory)."""

    boxes: np.ndarray
    name: np.ndarray
    score: np.ndarray | None = None
    line: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def __post_init__(self):
        self.boxes = np.asarray(self.boxes, dtype=np.float64).reshape(-1, 7)
        self.name = np.asarray(self.name, dtype=str).reshape(-1)
        if self.score is not None:
            self.score = np.asarray(self.score, dtype=np.float64).reshape(-1)
        if len(self.line) != len(self.name):
            self.line = np.zeros(len(self.name), np.int64)

    def __len__(self) -> int:
        return len(self.name)

    @classmethod
    def empty(cls, with_score: bool = False) -> LidarLabels:
        return cls(np.zeros((0, 7)), np.zeros(0, "<U16"), np.zeros(0) if with_score else None)

    def select(self, idx: np.ndarray) -> LidarLabels:
        return LidarLabels(self.boxes[idx], self.name[idx], None if self.score is None else self.score[idx],
                           self.line[idx])


def parse_lidar_label(text: str, path: str | Path, with_score: bool | None = False) -> LidarLabels:
    """Parse a LiDAR-frame label file's text. ``with_score``: True requires the ninth field (a score), False
    forbids it, None allows either (all lines alike). Blank lines are skipped; DontCare records left out. A wrong
    field count, a non-number, NaN or infinity, or a negative size is a :class:`KittiFormatError` naming the
    file and line."""
    counts = (9,) if with_score else (8,) if with_score is False else (8, 9)
    want = " or ".join(str(c) for c in counts)
    boxes, names, scores, lines = [], [], [], []
    n_fields = None
    for i, raw in enumerate(text.splitlines(), start=1):
        f = raw.split()
        if not f:
            continue
        if len(f) not in counts:
            raise KittiFormatError(path, f"expected {want} fields (x y z dx dy dz heading class"
                                   f"{' score' if 9 in counts else ''}), got {len(f)}: {raw.strip()!r}", i)
        if n_fields is not None and len(f) != n_fields:
            raise KittiFormatError(path, f"{len(f)} fields where earlier lines have {n_fields}", i)
        n_fields = len(f)
        numbers = f[:7] + f[8:]
        names_ = (*LABEL_FIELDS, "score")
        vals = []
        for k, v in enumerate(numbers):
            try:
                vals.append(float(v))
            except ValueError:
                raise KittiFormatError(path, f"non-numeric {names_[k]} {v!r} in {raw.strip()!r}", i) from None
        if not all(math.isfinite(v) for v in vals):
            raise KittiFormatError(path, f"NaN or infinite value in {raw.strip()!r}", i)
        if min(vals[3:6]) < 0:
            raise KittiFormatError(path, f"negative box size (dx, dy, dz) = {tuple(vals[3:6])}", i)
        if f[7] == "DontCare":
            continue
        boxes.append(vals[:7])
        names.append(f[7])
        scores.append(vals[7] if len(vals) == 8 else 0.0)
        lines.append(i)
    has_score = n_fields == 9 if n_fields is not None else bool(with_score)
    return LidarLabels(np.asarray(boxes, np.float64).reshape(-1, 7), np.asarray(names, dtype="<U32"),
                       np.asarray(scores) if has_score else None, np.asarray(lines, np.int64))


def read_lidar_label(path: str | Path, with_score: bool | None = False) -> LidarLabels:
    """Read a LiDAR-frame label (``with_score`` False) or result file (True); see :func:`parse_lidar_label`."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise KittiFormatError(path, "label file not found") from None
    except UnicodeDecodeError:
        raise KittiFormatError(path, "not a text file") from None
    return parse_lidar_label(text, path, with_score)


def format_lidar_label(labels: LidarLabels) -> str:
    """The file text: every number as the shortest decimal that reads back as the same float64 (``repr``), so a
    file read back gives the records exactly."""
    out = []
    for i in range(len(labels)):
        s = " ".join(repr(float(v)) for v in labels.boxes[i]) + f" {labels.name[i]}"
        if labels.score is not None:
            s += f" {float(labels.score[i])!r}"
        out.append(s + "\n")
    return "".join(out)


def write_lidar_label(path: str | Path, labels: LidarLabels) -> None:
    """Write a label (or, with scores, result) file; a frame with no objects gives an empty file."""
    Path(path).write_text(format_lidar_label(labels))
