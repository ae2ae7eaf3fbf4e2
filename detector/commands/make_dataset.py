"""Generate a KITTI-format dataset with the LiDAR simulator (detector.sim).

    detector-make-dataset out=DIR [frames=300] [seed=0] [workers=0] [columns=2083] [format=kitti|lidar]
    (or: python scripts/make_dataset.py ...)

out      dataset root to write (created; an existing non-empty folder must be an earlier simulator output)
frames   number of frames (ids 000000 …); every 5th frame goes to ImageSets/val.txt, the rest to train.txt
seed     dataset seed: the same seed gives byte-identical files, whatever the number of workers
workers  parallel processes (0: one per CPU core)
columns  azimuth steps per revolution (2083 ≈ 0.173°, the HDL-64E at 10 Hz; fewer is faster and sparser)
progress show a progress bar (true/false)
format   kitti (the KITTI layout) or lidar: a LiDAR-only dataset (points/, labels/, ImageSets/; docs/custom-data.md),
         converted from the simulator's KITTI output (detector.data.convert) with the points in the camera's view
         (the simulator labels objects there only, as KITTI does)
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from detector.cli import parse_args
from detector.errors import ConfigError, KittiFormatError, one_line
from detector.sim import LidarSpec, generate_dataset

USAGE = __doc__
DEFAULTS = {
    "out": None,
    "frames": 300,
    "seed": 0,
    "workers": 0,
    "columns": LidarSpec.columns,
    "progress": True,
    "format": "kitti",
}


def main(argv=None) -> int:
    args = parse_args(argv, DEFAULTS, USAGE)
    if args["out"] is None:
        raise SystemExit("error: out=DIR is required (see --help)")
    for key, lo in (("frames", 1), ("seed", 0), ("workers", 0), ("columns", 8)):
        if args[key] < lo:
            raise SystemExit(f"error: {key}={args[key]}: must be >= {lo}")
    if args["format"] not in ("kitti", "lidar"):
        raise SystemExit(f"error: format={args['format']}: choose kitti or lidar")
    if args["format"] == "lidar":
        return _lidar(args)
    try:
        summary = generate_dataset(
            args["out"],
            args["frames"],
            seed=args["seed"],
            workers=args["workers"] or None,
            spec=LidarSpec(columns=args["columns"]),
            progress=args["progress"],
        )
    except ConfigError as e:
        print(one_line(e), file=sys.stderr)
        return 1
    print(f"wrote {summary.root}")
    print(summary.table())
    return 0


def _lidar(args: dict) -> int:
    """The simulator's KITTI output in a temporary folder beside ``out``, converted into ``out``."""
    from detector.data.convert import convert_kitti_to_lidar

    out = Path(args["out"]).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        print(f"error: {out}: out= must be a new or empty folder for format=lidar", file=sys.stderr)
        return 1
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.kitti.", dir=out.parent))
    try:
        generate_dataset(tmp, args["frames"], seed=args["seed"], workers=args["workers"] or None,
                         spec=LidarSpec(columns=args["columns"]), progress=args["progress"])
        summary = convert_kitti_to_lidar(tmp, out, fov_only=True)
    except (ConfigError, KittiFormatError) as e:
        print(one_line(e), file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"wrote {summary.root} (LiDAR-only): {summary.table()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
