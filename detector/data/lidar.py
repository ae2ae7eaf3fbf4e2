"""LiDAR-only datasets: point clouds and boxes in the LiDAR frame, no calibration, no images.

```
ROOT/ImageSets/{train,val,...}.txt   frame ids, one per line
ROOT/points/<id>.bin | <id>.npy      float32 x, y, z, reflectance (.bin), or an [N, 3|4] array (.npy):
                                     detector.data.pointcloud
ROOT/labels/<id>.txt                 one object a line: x y z dx dy dz heading class
```
Labels (:mod:`detector.data.lidar_labels`) follow OpenPCDet's custom format: (x, y, z) the box centre and (dx, dy,
dz) its length, width and height in metres, heading the yaw about +z from +x in radians
(:class:`~detector.geometry.boxes.Boxes3D`'s convention); result files add a score as a ninth field. Class names are
the config's (``data.classes``, each with its minimum IoU); names listed in ``data.ignore_classes`` are known but
neither trained nor scored (Van and Person_sitting still mark their neighbours' boxes as ignored, as for KITTI); any
other name is *unknown*: its objects stay in the frame (never silently dropped), take part in neither training nor
scoring, and are counted and reported (:meth:`LidarRoot.unknown`, one warning per dataset, ``inspect_dataset``'s
summary).
``DontCare`` records have no meaning without an image: the reader leaves them out.

:func:`open_root` opens a root of either kind (this one or :class:`~detector.data.kitti.KittiRoot`); both
read into the same :class:`~detector.data.structures.Frame` (``calib`` and ``image_size`` None here).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from detector.data.kitti import KittiRoot, split_file, split_names
from detector.data.lidar_labels import LidarLabels, read_lidar_label
from detector.data.pointcloud import read_point_cloud
from detector.errors import ConfigError, KittiFormatError

if TYPE_CHECKING:  # boxes import torch
    from detector.data.structures import Frame

LAYOUTS = ("kitti", "lidar", "auto")
POINT_EXTS = ("bin", "npy")
# KITTI's names other than its three evaluated classes: known, neither trained nor scored unless data.classes names them
DEFAULT_IGNORE = ("DontCare", "Van", "Truck", "Tram", "Misc", "Person_sitting")


def _check_names(names: Iterable[str], key: str) -> tuple[str, ...]:
    out = tuple(str(n) for n in names)
    for n in out:
        if not n or any(c.isspace() for c in n):
            raise ConfigError(f"{key}: class name {n!r} must be a non-empty word without spaces")
    return out


def read_split_ids(path: Path) -> list[str]:
    """Frame ids of an ``ImageSets`` file: one word per line (any name a file can have, no path separators)."""
    try:
        ids = path.read_text().split()
    except FileNotFoundError:
        raise KittiFormatError(path, "image set file not found") from None
    for i, s in enumerate(ids, start=1):
        if "/" in s or "\\" in s or s in (".", ".."):
            raise KittiFormatError(path, f"frame id must be a file name, got {s!r}", i)
    return ids


class LidarRoot:
    """A LiDAR-only dataset root (layout in the module docstring).

    Args:
        root: the folder holding ``ImageSets/``, ``points/`` and (for labeled data) ``labels/``.
        classes: the class names of the dataset (None: Car, Pedestrian, Cyclist).
        ignore_classes: names known but neither trained nor scored (None: :data:`DEFAULT_IGNORE`).
    """

    layout = "lidar"

    def __init__(self, root: str | Path, classes: Iterable[str] | None = None,
                 ignore_classes: Iterable[str] | None = None):
        self.root = Path(root).expanduser()
        self.dir = self.root
        if not self.root.is_dir():
            raise KittiFormatError(self.root, "dataset root not found")
        if not (self.root / "points").is_dir():
            raise KittiFormatError(self.root / "points", "no 'points' folder in this LiDAR-only dataset root")
        self.classes = _check_names(classes if classes is not None else ("Car", "Pedestrian", "Cyclist"),
                                    "data.classes")
        self.ignore_classes = _check_names(ignore_classes if ignore_classes is not None else DEFAULT_IGNORE,
                                           "data.ignore_classes")
        self._known = frozenset(self.classes) | frozenset(self.ignore_classes)

    # --- files ------------------------------------------------------------------------------------
    def imageset(self, name: str) -> list[str]:
        return read_split_ids(split_file(self.root, name))

    def splits(self) -> list[str]:
        return split_names(self.root)

    @property
    def labels_dir(self) -> Path:
        return self.root / "labels"

    def points_path(self, frame_id: str) -> Path:
        """The frame's point cloud: ``points/<id>.bin`` or ``points/<id>.npy`` (both there is an error)."""
        found = [p for p in (self.root / "points" / f"{frame_id}.{e}" for e in POINT_EXTS) if p.is_file()]
        if len(found) > 1:
            raise KittiFormatError(found[0].parent, f"two point clouds for frame {frame_id}: "
                                   f"{found[0].name} and {found[1].name}")
        if not found:
            raise KittiFormatError(self.root / "points" / f"{frame_id}.bin",
                                   f"frame {frame_id} is listed in ImageSets but has no point cloud (.bin or .npy)")
        return found[0]

    def path(self, kind: str, frame_id: str) -> Path:
        """``points`` or ``labels`` file of a frame."""
        return self.points_path(frame_id) if kind == "points" else self.labels_dir / f"{frame_id}.txt"

    def frame_ids(self) -> list[str]:
        """Ids of the point clouds on disk, sorted."""
        return sorted({p.stem for e in POINT_EXTS for p in (self.root / "points").glob(f"*.{e}")})

    def source_files(self, frame_id: str) -> list[Path]:
        """The files a frame is read from (for cache fingerprints)."""
        paths = [self.root / "points" / f"{frame_id}.{e}" for e in POINT_EXTS]
        return paths + ([self.path("labels", frame_id)] if self.has_labels() else [])

    def has_labels(self) -> bool:
        return self.labels_dir.is_dir()

    def has_road_maps(self) -> bool:
        return False

    # --- reading ----------------------------------------------------------------------------------
    def check_frame(self, frame_id: str) -> LidarLabels | None:
        """The cheap check of a frame (its point file's presence and size, its labels parsed); returns its labels
        (None without a labels folder)."""
        path = self.points_path(frame_id)
        size = path.stat().st_size
        if size == 0:
            raise KittiFormatError(path, "empty point cloud (0 bytes)")
        if path.suffix == ".bin" and size % 16:
            raise KittiFormatError(path, f"truncated point cloud: {size} bytes is not a multiple of 16 "
                                   "(4 float32 per point)")
        return self.read_labels(frame_id) if self.has_labels() else None

    def read_labels(self, frame_id: str) -> LidarLabels:
        return read_lidar_label(self.path("labels", frame_id), with_score=False)

    def read_points(self, frame_id: str) -> np.ndarray:
        """[N, 4] float32; a ``.npy`` of [N, 3] reads with reflectance 0 (:mod:`detector.data.pointcloud`)."""
        return read_point_cloud(self.points_path(frame_id)).points

    def unknown(self, labels: LidarLabels) -> np.ndarray:
        """Bool [N]: objects whose class is neither in ``classes`` nor in ``ignore_classes``."""
        return np.array([n not in self._known for n in labels.name], bool)

    def read_frame(self, frame_id: str, road_map: bool = False) -> Frame:
        """Load a frame (points and, where the root has labels, every object but DontCare, unknown classes
        included); raises KittiFormatError naming the bad or missing file."""
        from detector.data.structures import Frame
        from detector.geometry.boxes import Boxes3D

        if road_map:
            raise KittiFormatError(self.root / "road_map", "no road maps in a LiDAR-only dataset: "
                                   "use mask=predicted, ground or none")
        points = self.read_points(frame_id)
        labels = None
        boxes, names = Boxes3D.empty(), np.zeros(0, dtype="<U16")
        if self.has_labels():
            labels = self.read_labels(frame_id)
            boxes, names = Boxes3D(labels.boxes.astype(np.float32)), labels.name.copy()
        return Frame(frame_id, points, None, boxes, names, labels)


class UnknownClasses:
    """Counts of the objects of unknown classes (per name), with where the first of each was seen."""

    def __init__(self):
        self.counts: Counter[str] = Counter()
        self.first: dict[str, str] = {}

    def add(self, labels: LidarLabels, unknown: np.ndarray, path: Path) -> None:
        for name, line in zip(labels.name[unknown], labels.line[unknown], strict=True):
            self.counts[str(name)] += 1
            self.first.setdefault(str(name), f"{path}:{int(line)}")

    def __bool__(self) -> bool:
        return bool(self.counts)

    def message(self, classes: Sequence[str]) -> str:
        """One line: the names, their counts and the first file and line of each."""
        names = ", ".join(f"{n} {c} (first: {self.first[n]})" for n, c in self.counts.most_common())
        return (f"{sum(self.counts.values())} labeled object(s) of classes not in data.classes "
                f"({', '.join(classes)}) nor data.ignore_classes: {names}; they stay in the frames but are neither "
                "trained nor scored: add the name to data.classes (with its minimum IoU) or data.ignore_classes")


def root_layout(root: str | Path, layout: str = "auto") -> str:
    """``kitti`` or ``lidar``: ``layout``, or for ``auto`` the kind of root there is (a ``points/`` folder:
    LiDAR-only, else KITTI - also where nothing is there yet)."""
    if layout not in LAYOUTS:
        raise ConfigError(f"data.layout={layout!r}: choose {', '.join(LAYOUTS)}")
    if layout == "auto":
        return "lidar" if (Path(root).expanduser() / "points").is_dir() else "kitti"
    return layout


def open_root(root: str | Path, layout: str = "auto", classes: Iterable[str] | None = None,
              ignore_classes: Iterable[str] | None = None) -> KittiRoot | LidarRoot:
    """The dataset root at ``root``: ``kitti`` (:class:`KittiRoot`), ``lidar`` (:class:`LidarRoot`) or ``auto``
    (:func:`root_layout`: a ``points/`` folder, LiDAR-only, else KITTI)."""
    if root_layout(root, layout) == "lidar":
        return LidarRoot(root, classes, ignore_classes)
    return KittiRoot(Path(root).expanduser())
