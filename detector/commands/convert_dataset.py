"""Write a LiDAR-only dataset (points/, labels/ in the LiDAR frame, ImageSets/) from a KITTI-format root.

    detector-convert-dataset root=KITTI_ROOT out=DIR [split_dir=training] [fov_only=false] [skip_bad=false]
    (or: python scripts/convert_dataset.py ...)

root      a KITTI-format root (ImageSets/, training/velodyne, label_2, calib)
out       the LiDAR-only root to write (new or empty; written in full or not at all)
split_dir the KITTI folder to convert (training, or testing: no labels)
fov_only  keep only the points in the camera's view (KITTI labels objects there only); false keeps every point
skip_bad  leave out the frames that do not read (a frame listed in ImageSets without its .bin, a bad file), and
          drop them from the new ImageSets; false (default): the first one stops the conversion, nothing written

The image sets are copied; a root without them gets ImageSets/all.txt (every frame) and no made-up train/val split.
The last lines printed are the training and evaluation commands that run on what was written (docs/custom-data.md).
"""

from __future__ import annotations

import sys

from detector.cli import parse_args
from detector.data.convert import convert_kitti_to_lidar
from detector.errors import KittiFormatError, one_line

USAGE = __doc__


def main(argv=None) -> int:
    args = parse_args(argv, {"root": None, "out": None, "split_dir": "training", "fov_only": False,
                             "skip_bad": False}, USAGE)
    for key in ("root", "out"):
        if args[key] is None:
            raise SystemExit(f"error: {key}=DIR is required (see --help)")
    try:
        summary = convert_kitti_to_lidar(args["root"], args["out"], args["split_dir"], args["fov_only"],
                                         skip_bad=args["skip_bad"])
    except KittiFormatError as e:
        print(one_line(e), file=sys.stderr)
        return 1
    print(f"wrote {summary.root}: {summary.table()}")
    print("\n".join(summary.commands()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
