"""Reading and writing the KITTI object-detection layout.

```
ROOT/ImageSets/{train,val,test}.txt         frame ids, one per line
ROOT/training/velodyne/%06d.bin             float32 x, y, z, reflectance (LiDAR frame)
ROOT/training/label_2/%06d.txt              15 fields per object (16 with a score in result files):
                                            detector.data.kitti_labels
ROOT/training/calib/%06d.txt                P0..P3, R0_rect, Tr_velo_to_cam, Tr_imu_to_velo:
                                            detector.data.kitti_calib
ROOT/training/image_2/%06d.png              left colour image (optional): only its size is read (PNG
                                            header), checked against calib P2 (read_png_size)
ROOT/training/road_map/%06d.png + grid.json drivable area raster (our simulator only):
                                            detector.data.road_map
ROOT/testing/...                            same, without label_2
```
Here: point clouds, image sets and the root that reads a whole frame (:class:`KittiRoot`); boxes ↔ camera
labels: :mod:`detector.data.kitti_camera`. Every reader checks its input and raises
:class:`~detector.errors.KittiFormatError` naming the file (and line).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from detector.data.kitti_calib import Calibration
from detector.data.kitti_labels import read_label
from detector.data.pointcloud import finite_points, read_bin
from detector.data.road_map import read_road_map
from detector.errors import KittiFormatError

if TYPE_CHECKING:  # boxes import torch: the metric's CLI (image sets, label files) does without it
    from detector.data.structures import Frame


def read_points(path: str | Path) -> np.ndarray:
    """[N, 4] float32 (x, y, z, reflectance) from a velodyne ``.bin``; rejects truncated, empty and
    non-finite scans (the readers of :mod:`detector.data.pointcloud`, which ``predict`` uses too)."""
    return finite_points(read_bin(path), path)[0]


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def read_png_size(path: str | Path) -> tuple[int, int]:
    """(width, height) of a PNG from its header (the first 24 bytes: signature, then the IHDR chunk)."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            head = fh.read(24)
    except FileNotFoundError:
        raise KittiFormatError(path, "image not found") from None
    if len(head) < 24 or head[:8] != PNG_SIGNATURE or head[12:16] != b"IHDR":
        raise KittiFormatError(path, "not a PNG image (no PNG signature and IHDR header)")
    w, h = int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
    if w == 0 or h == 0:
        raise KittiFormatError(path, f"PNG header gives an empty image ({w}x{h})")
    return w, h


def check_image_matches_calib(size: tuple[int, int], calib: Calibration, image: Path, calib_path: Path) -> None:
    """A camera's principal point lies near its image's centre (KITTI's P2: (604-610, 172-182) px in
    1224-1242 x 370-376 images); one outside the middle half of the image means the image and the
    calibration do not belong together (e.g. a resized image, another camera's calibration)."""
    w, h = size
    cx, cy = float(calib.P2[0, 2]), float(calib.P2[1, 2])
    if not (w / 4 < cx < 3 * w / 4 and h / 4 < cy < 3 * h / 4):
        raise KittiFormatError(
            image, f"image size {w}x{h} does not match the calibration {calib_path}: P2's principal point "
            f"({cx:.1f}, {cy:.1f}) px lies outside the middle half of the image"
        )


def write_points(path: str | Path, points: np.ndarray) -> None:
    pts = np.ascontiguousarray(points, dtype=np.float32)
    if pts.ndim != 2 or pts.shape[1] != 4:
        raise ValueError(f"points must be [N, 4], got {pts.shape}")
    Path(path).write_bytes(pts.tobytes())


def read_imageset(path: str | Path) -> list[str]:
    path = Path(path)
    try:
        lines = path.read_text().split()
    except FileNotFoundError:
        raise KittiFormatError(path, "image set file not found") from None
    for i, s in enumerate(lines, start=1):
        if not s.isdigit():
            raise KittiFormatError(path, f"frame id must be digits, got {s!r}", i)
    return lines


def write_imageset(path: str | Path, ids: list[str]) -> None:
    Path(path).write_text("".join(f"{i}\n" for i in ids))


def split_names(root: Path) -> list[str]:
    """Names of a dataset root's image sets (``ImageSets/<name>.txt``), sorted."""
    return sorted(p.stem for p in (root / "ImageSets").glob("*.txt"))


def split_file(root: Path, name: str) -> Path:
    """``root/ImageSets/<name>.txt``; missing, a :class:`KittiFormatError` naming it and the splits there are (the
    same for KITTI and LiDAR-only roots)."""
    path = root / "ImageSets" / f"{name}.txt"
    if not path.is_file():
        there = split_names(root)
        raise KittiFormatError(path, f"split '{name}' not found: " + (
            f"the splits here are {', '.join(there)}" if there else "this root has no ImageSets/*.txt"))
    return path


# --------------------------------------------------------------------------------------------------
# A KITTI-format root
# --------------------------------------------------------------------------------------------------
class KittiRoot:
    """A KITTI-format dataset root (real KITTI or our simulator's output). A LiDAR-only root:
    :class:`detector.data.lidar.LidarRoot` (the same methods where they apply)."""

    layout = "kitti"

    def __init__(self, root: str | Path, split_dir: str = "training"):
        self.root = Path(root)
        self.dir = self.root / split_dir
        if not self.root.is_dir():
            raise KittiFormatError(self.root, "dataset root not found")
        if not self.dir.is_dir():
            raise KittiFormatError(self.dir, f"no '{split_dir}' folder in the dataset root")

    def imageset(self, name: str) -> list[str]:
        """Frame ids of ``ImageSets/{name}.txt``; a missing file is an error naming the splits there are."""
        return read_imageset(split_file(self.root, name))

    def splits(self) -> list[str]:
        return split_names(self.root)

    def path(self, kind: str, frame_id: str) -> Path:
        ext = {"velodyne": "bin", "road_map": "png", "image_2": "png"}.get(kind, "txt")
        return self.dir / kind / f"{frame_id}.{ext}"

    @property
    def labels_dir(self) -> Path:
        return self.dir / "label_2"

    def has_labels(self) -> bool:
        return self.labels_dir.is_dir()

    def source_files(self, frame_id: str) -> list[Path]:
        """The files a frame is read from (for cache fingerprints)."""
        return [self.path(kind, frame_id) for kind in ("velodyne", "label_2", "calib")]

    def has_road_maps(self) -> bool:
        return (self.dir / "road_map" / "grid.json").is_file()

    def image_size(self, frame_id: str, calib: Calibration) -> tuple[int, int] | None:
        """(width, height) of the frame's left colour image, checked against its calibration; None where the root
        has no ``image_2`` folder (our simulator writes none; images are optional). A root with images must have
        each frame's: its size sets the camera's view (the points kept) and clips the 2D boxes."""
        path = self.path("image_2", frame_id)
        if not path.is_file():
            if path.parent.is_dir():
                raise KittiFormatError(path, f"frame {frame_id} has no image, and this root has an image_2 folder "
                                             "(its size sets the camera's view): add the image or drop the frame "
                                             "from ImageSets")
            return None
        size = read_png_size(path)
        check_image_matches_calib(size, calib, path, self.path("calib", frame_id))
        return size

    def read_frame(self, frame_id: str, road_map: bool = False) -> Frame:
        """Load a frame; raises KittiFormatError naming the bad or missing file."""
        from detector.data.kitti_camera import labels_to_boxes
        from detector.data.structures import Frame
        from detector.geometry.boxes import Boxes3D

        points = read_points(self.path("velodyne", frame_id))
        calib = Calibration.from_file(self.path("calib", frame_id))
        image_size = self.image_size(frame_id, calib)
        labels = None
        boxes, names = Boxes3D.empty(), np.zeros(0, dtype="<U16")
        if self.has_labels():
            labels = read_label(self.path("label_2", frame_id), with_score=False)
            obj = labels.name != "DontCare"
            names = labels.name[obj]
            boxes = Boxes3D(labels_to_boxes(labels.select(obj), calib).tensor.float())
        road = None
        if road_map:
            if not self.has_road_maps():
                raise KittiFormatError(
                    self.dir / "road_map",
                    "no road maps in this dataset (real KITTI has none): use mask=predicted, ground or none",
                )
            road = read_road_map(self.path("road_map", frame_id))
        return Frame(frame_id, points, calib, boxes, names, labels, road, image_size)
