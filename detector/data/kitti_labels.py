"""KITTI label and result files: the project's one record type (:class:`KittiLabels`, float64 fields), its
reader and writer. Many files at once: :mod:`detector.data.kitti_batch`. The rest of the KITTI layout
(calibration, the translation between 3D boxes and records, point clouds, image sets, road maps, the
dataset root) is in :mod:`detector.data.kitti`, which re-exports these names. Imports nothing of ours but
the error type (no torch), so the metric's CLI starts fast.

Every reader checks its input and raises :class:`KittiFormatError` naming the file and line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from detector.errors import KittiFormatError

# The object types a KITTI label may name (the classes the metric evaluates: detector.eval.protocol.EVAL_CLASSES).
OBJECT_TYPES = ("Car", "Van", "Truck", "Pedestrian", "Person_sitting", "Cyclist", "Tram", "Misc", "DontCare")
_CLASS_SET = frozenset(OBJECT_TYPES)
IMAGE_SIZE = (1242, 375)  # (width, height) of KITTI's left colour camera, used where no image is at hand


# --------------------------------------------------------------------------------------------------
# Labels
# --------------------------------------------------------------------------------------------------
_NUMERIC_FIELDS = ("truncated", "occluded", "alpha", "bbox", "dimensions", "location", "rotation_y", "score")


@dataclass
class KittiLabels:
    """The objects of one label (or result) file, as arrays of length N (KITTI's field order): THE record
    type of the project. The reader, the result writer and the metric (whose
    :class:`~detector.eval.overlap.Records` is a KittiLabels of many frames) all use it.

    name: object type; truncated: 0..1; occluded: 0 (visible) .. 3 (unknown), -1 for DontCare;
    alpha: observation angle; bbox: [N, 4] left, top, right, bottom (pixels); dimensions: [N, 3]
    h, w, l (m); location: [N, 3] bottom centre in the rectified camera frame (m); rotation_y: about
    the camera's y axis; score: detection confidence (result files only, else None).

    Every numeric field is float64 (converted on construction), as the KITTI devkit reads every field as
    a double: the values of a file reach the metric unchanged (no float32 step, no decimal recovery).
    """

    name: np.ndarray
    truncated: np.ndarray
    occluded: np.ndarray
    alpha: np.ndarray
    bbox: np.ndarray
    dimensions: np.ndarray
    location: np.ndarray
    rotation_y: np.ndarray
    score: np.ndarray | None = None

    def __post_init__(self):
        self.name = np.asarray(self.name, dtype=str)
        for key in _NUMERIC_FIELDS:
            v = getattr(self, key)
            if v is not None:
                setattr(self, key, np.asarray(v, dtype=np.float64))

    def __len__(self) -> int:
        return len(self.name)

    @classmethod
    def empty(cls, with_score: bool = False) -> KittiLabels:
        z = np.zeros(0)
        return cls(
            np.zeros(0, dtype="<U16"),
            z,
            z,
            z,
            np.zeros((0, 4)),
            np.zeros((0, 3)),
            np.zeros((0, 3)),
            z,
            z if with_score else None,
        )

    def select(self, idx: np.ndarray) -> KittiLabels:
        """The subset given by a boolean mask or index array."""
        return KittiLabels(
            self.name[idx],
            self.truncated[idx],
            self.occluded[idx],
            self.alpha[idx],
            self.bbox[idx],
            self.dimensions[idx],
            self.location[idx],
            self.rotation_y[idx],
            None if self.score is None else self.score[idx],
        )


def parse_label_lines(lines: list[str], path: str | Path, with_score: bool | None = None) -> KittiLabels:
    """Parse label lines. ``with_score``: True requires the 16th field, False forbids it, None allows
    either (all lines must agree). Every number is read as float64 (as the devkit's ``%lf``); NaN or
    infinite values, non-numeric fields, a wrong field count, negative sizes (except DontCare) and, in
    label files, a non-integer ``occluded`` are errors naming the file and line. Vectorized; on invalid
    input the first offending line is named."""
    numbered = [(i, f) for i, f in enumerate(map(str.split, lines), start=1) if f]
    if not numbered:
        return KittiLabels.empty(with_score=bool(with_score))
    n_fields = len(numbered[0][1])
    try:
        if n_fields not in (15, 16):
            raise ValueError
        name_list = [f[0] for _, f in numbered]
        if not set(name_list) <= _CLASS_SET:
            raise ValueError
        names = np.array(name_list, dtype="<U16")
        a = np.array([f[1:] for _, f in numbered], dtype=np.float64)  # ragged lines raise: slow path
        if not fields_valid(names, a):
            raise ValueError
    except ValueError:
        _raise_first_bad_line(numbered, path)
        raise
    if with_score is True and n_fields == 15:
        raise KittiFormatError(path, "result file lines need a 16th field (score)")
    if with_score is False and n_fields == 16:
        raise KittiFormatError(path, "label lines have 15 fields; found a 16th (score)")
    return labels_from_fields(names, a)


def fields_valid(names: np.ndarray, a: np.ndarray) -> bool:
    """The value rules of label/result lines on parsed fields ``a`` [N, 14 or 15] (all but the name):
    finite, non-negative sizes except for DontCare, an integer ``occluded`` in label files (result files:
    the devkit ignores it)."""
    care = names != "DontCare"
    int_occ = a.shape[1] == 15 or bool((a[:, 1] == np.round(a[:, 1])).all())
    return bool(np.isfinite(a).all()) and int_occ and not (a[care][:, 7:10] < 0).any()


def labels_from_fields(names: np.ndarray, a: np.ndarray) -> KittiLabels:
    """Records from names and the parsed fields [N, 14] (labels) or [N, 15] (results: + score)."""
    return KittiLabels(
        name=names,
        truncated=a[:, 0],
        occluded=a[:, 1],
        alpha=a[:, 2],
        bbox=a[:, 3:7],
        dimensions=a[:, 7:10],
        location=a[:, 10:13],
        rotation_y=a[:, 13],
        score=a[:, 14] if a.shape[1] == 15 else None,
    )


_FIELD_NAMES = ("truncated", "occluded", "alpha", "left", "top", "right", "bottom", "height", "width", "length",
                "x", "y", "z", "rotation_y", "score")


def _raise_first_bad_line(numbered: list[tuple[int, list[str]]], path: str | Path) -> None:
    """The slow path of :func:`parse_label_lines`: find the first invalid line and raise for it."""
    n_fields = None
    for i, f in numbered:
        s = " ".join(f)
        if len(f) not in (15, 16):
            raise KittiFormatError(path, f"expected 15 fields (16 with a score), got {len(f)}: {s!r}", i)
        if n_fields is None:
            n_fields = len(f)
        elif len(f) != n_fields:
            raise KittiFormatError(path, f"{len(f)} fields where earlier lines have {n_fields}", i)
        if f[0] not in OBJECT_TYPES:
            raise KittiFormatError(path, f"unknown object type {f[0]!r} (expected one of {', '.join(OBJECT_TYPES)})", i)
        for k, v in enumerate(f[1:], start=2):
            try:
                float(v)
            except ValueError:
                field = _FIELD_NAMES[k - 2] if k - 2 < len(_FIELD_NAMES) else "score"
                raise KittiFormatError(path, f"non-numeric {field} (field {k}) {v!r} in {s!r}", i) from None
        vals = [float(v) for v in f[1:]]
        if not all(math.isfinite(v) for v in vals):
            raise KittiFormatError(path, f"NaN or infinite value in {s!r}", i)
        if len(f) == 15 and vals[1] != int(vals[1]):
            raise KittiFormatError(path, f"occluded must be an integer, got {f[2]!r}", i)
        if f[0] != "DontCare" and min(vals[7:10]) < 0:
            raise KittiFormatError(path, f"negative box size (h, w, l) = {tuple(vals[7:10])}", i)


def read_label(path: str | Path, with_score: bool | None = None) -> KittiLabels:
    """Read a ``label_2`` file (or a result file with scores). An empty file means no objects. Many files
    at once: :func:`detector.data.kitti_batch.read_labels` (same values, same errors, faster)."""
    path = Path(path)
    return parse_label_lines(read_label_text(path).splitlines(), path, with_score)


def read_label_text(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        raise KittiFormatError(path, "label file not found") from None
    except UnicodeDecodeError:
        raise KittiFormatError(path, "not a text file") from None


def format_label_lines(labels: KittiLabels) -> list[str]:
    """KITTI text lines: 2 decimals as in the official files; the score as the shortest decimal that reads
    back as the same float64 (``repr``), so distinct scores stay distinct in result files."""
    out = []
    for i in range(len(labels)):
        b, d, l = labels.bbox[i], labels.dimensions[i], labels.location[i]
        s = (
            f"{labels.name[i]} {labels.truncated[i]:.2f} {int(labels.occluded[i])} {labels.alpha[i]:.2f} "
            f"{b[0]:.2f} {b[1]:.2f} {b[2]:.2f} {b[3]:.2f} {d[0]:.2f} {d[1]:.2f} {d[2]:.2f} "
            f"{l[0]:.2f} {l[1]:.2f} {l[2]:.2f} {labels.rotation_y[i]:.2f}"
        )
        if labels.score is not None:
            s += f" {float(labels.score[i])!r}"
        out.append(s)
    return out


def as_written(labels: KittiLabels, where: str = "<records>") -> KittiLabels:
    """The records exactly as a file written from them reads back (the writer's 2 decimals, the score's
    shortest decimal): what the metric scores when it must agree with the files. ``where`` names the
    records in an error (e.g. NaN in a box)."""
    return parse_label_lines(format_label_lines(labels), where, with_score=labels.score is not None)


def write_label(path: str | Path, labels: KittiLabels) -> None:
    """Write a label or result file (a frame with no objects gives an empty file)."""
    lines = format_label_lines(labels)
    Path(path).write_text("".join(s + "\n" for s in lines))


def observation_angle(location: np.ndarray, rotation_y: np.ndarray) -> np.ndarray:
    """KITTI's alpha: rotation_y minus the viewing ray's angle, in [-pi, pi)."""
    ray = np.arctan2(location[:, 0], location[:, 2])
    return (rotation_y - ray + np.pi) % (2 * np.pi) - np.pi


# KITTI's difficulty levels: (2D box height must EXCEED this (px), max occlusion level, max truncation).
# The one definition: detector.eval.protocol builds its levels from it.
DIFFICULTY_LEVELS = {"easy": (40.0, 0, 0.15), "moderate": (25.0, 1, 0.30), "hard": (25.0, 2, 0.50)}


def counted_at_level(height, occluded, truncated, level: tuple[float, float, float]):
    """The protocol's rule R3 (:mod:`detector.eval.protocol`) on arrays: an object counts at ``level`` =
    (min 2D height, max occlusion, max truncation) iff its 2D height EXCEEDS the minimum (a box of exactly
    40.00 px is not easy, as in the devkit) and its occlusion and truncation are at most the maxima."""
    min_height, max_occlusion, max_truncation = level
    return (height > min_height) & (occluded <= max_occlusion) & (truncated <= max_truncation)


def difficulty(labels: KittiLabels) -> np.ndarray:
    """Easiest KITTI level of each object: 0 easy, 1 moderate, 2 hard, -1 none (levels are cumulative:
    an easy object also counts for moderate and hard); :func:`counted_at_level` decides."""
    height = labels.bbox[:, 3] - labels.bbox[:, 1]
    out = np.full(len(labels), -1, dtype=np.int8)
    for lvl, level in reversed(list(enumerate(DIFFICULTY_LEVELS.values()))):
        out[counted_at_level(height, labels.occluded, labels.truncated, level)] = lvl
    return out
