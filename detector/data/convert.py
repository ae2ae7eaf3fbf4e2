"""A KITTI-format root written as a LiDAR-only one (:mod:`detector.data.lidar`).

Per frame: the velodyne scan as ``points/<id>.bin`` (the same float32 values), and every labeled object but
DontCare as a line ``x y z dx dy dz heading class`` in the LiDAR frame (the KITTI box through the frame's
calibration, in float64, written with every digit); ``ImageSets/*.txt`` copied (a root without image sets gets
``ImageSets/all.txt``, every frame). What has no place there is left
behind: calibration, images, 2D boxes, truncation, occlusion, road maps. ``fov_only`` keeps only the points in the
camera's view (KITTI labels objects there only: a detector trained on the whole scan would learn that the
unlabeled cars elsewhere are background).

The output is written into a temporary folder beside ``out`` and renamed at the end: nothing half written.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from detector.data.kitti import KittiRoot, write_points
from detector.data.kitti_camera import in_camera_fov, labels_to_boxes
from detector.data.kitti_labels import IMAGE_SIZE
from detector.data.lidar_labels import LidarLabels, write_lidar_label
from detector.errors import KittiFormatError


@dataclass
class ConvertSummary:
    root: Path
    frames: int = 0
    objects: dict[str, int] = field(default_factory=dict)
    dropped_dontcare: int = 0

    def table(self) -> str:
        objs = ", ".join(f"{n} {c}" for n, c in sorted(self.objects.items(), key=lambda kv: -kv[1])) or "none"
        return (f"{self.frames} frames; objects: {objs}"
                + (f"; {self.dropped_dontcare} DontCare record(s) left out" if self.dropped_dontcare else ""))


def convert_kitti_to_lidar(root: str | Path, out: str | Path, split_dir: str = "training",
                           fov_only: bool = False) -> ConvertSummary:
    """Write the LiDAR-only form of the KITTI root ``root`` (its ``split_dir``) into ``out`` (absent or an empty
    folder). Every frame with a velodyne file is converted; a bad file is a :class:`KittiFormatError` naming it
    (and nothing is written)."""
    kroot = KittiRoot(root, split_dir)
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise KittiFormatError(out, "out= must be a new or empty folder (a conversion never writes into a dataset)")
    ids = sorted(p.stem for p in (kroot.dir / "velodyne").glob("*.bin"))
    if not ids:
        raise KittiFormatError(kroot.dir / "velodyne", "no point clouds (*.bin) to convert")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    summary = ConvertSummary(out)
    try:
        (tmp / "points").mkdir()
        (tmp / "ImageSets").mkdir()
        labeled = kroot.has_labels()
        if labeled:
            (tmp / "labels").mkdir()
        sets = {split: kroot.imageset(split) for split in kroot.splits()} or {"all": ids}
        for split, members in sets.items():
            (tmp / "ImageSets" / f"{split}.txt").write_text("".join(f"{i}\n" for i in members))
        for fid in ids:
            frame = kroot.read_frame(fid)
            points = frame.points
            if fov_only:
                points = points[in_camera_fov(points, frame.calib, frame.image_size or IMAGE_SIZE)]
            write_points(tmp / "points" / f"{fid}.bin", points)
            if labeled:
                lab = frame.labels
                obj = lab.name != "DontCare"
                summary.dropped_dontcare += int((~obj).sum())
                boxes = labels_to_boxes(lab.select(obj), frame.calib).tensor.double().numpy()
                write_lidar_label(tmp / "labels" / f"{fid}.txt", LidarLabels(boxes, lab.name[obj]))
                for n in lab.name[obj]:
                    summary.objects[str(n)] = summary.objects.get(str(n), 0) + 1
            summary.frames += 1
        if out.exists():
            out.rmdir()  # empty (checked above)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return summary

