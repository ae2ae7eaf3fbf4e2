"""Write a LiDAR-only dataset (points/, labels/ in the LiDAR frame, ImageSets/) from a KITTI-format root.

    detector-convert-dataset root=KITTI_ROOT out=DIR [split_dir=training] [fov_only=false]
    (or: python scripts/convert_dataset.py ...)

root      a KITTI-format root (ImageSets/, training/velodyne, label_2, calib)
out       the LiDAR-only root to write (new or empty; written in full or not at all)
split_dir the KITTI folder to convert (training, or testing: no labels)
fov_only  keep only the points in the camera's view (KITTI labels objects there only); false keeps every point

Train on it with data=lidar data.root=DIR (docs/custom-data.md).
"""

from __future__ import annotations

import sys

from detector.cli import parse_args
from detector.data.convert import convert_kitti_to_lidar
from detector.errors import KittiFormatError, one_line

USAGE = __doc__


def main(argv=None) -> int:
    args = parse_args(argv, {"root": None, "out": None, "split_dir": "training", "fov_only": False}, USAGE)
    for key in ("root", "out"):
        if args[key] is None:
            raise SystemExit(f"error: {key}=DIR is required (see --help)")
    try:
        summary = convert_kitti_to_lidar(args["root"], args["out"], args["split_dir"], args["fov_only"])
    except KittiFormatError as e:
        print(one_line(e), file=sys.stderr)
        return 1
    print(f"wrote {summary.root}: {summary.table()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
