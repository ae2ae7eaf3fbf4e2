"""Generate a KITTI-format dataset with the LiDAR simulator (detector.sim).

    detector-make-dataset out=DIR [frames=300] [seed=0] [workers=0] [columns=2083]
    (or: python scripts/make_dataset.py ...)

out      dataset root to write (created; an existing non-empty folder must be an earlier simulator output)
frames   number of frames (ids 000000 …); every 5th frame goes to ImageSets/val.txt, the rest to train.txt
seed     dataset seed: the same seed gives byte-identical files, whatever the number of workers
workers  parallel processes (0: one per CPU core)
columns  azimuth steps per revolution (2083 ≈ 0.173°, the HDL-64E at 10 Hz; fewer is faster and sparser)
progress show a progress bar (true/false)
"""

from __future__ import annotations

import sys

from detector.cli import parse_args
from detector.errors import ConfigError, one_line
from detector.sim import LidarSpec, generate_dataset

USAGE = __doc__
DEFAULTS = {
    "out": None,
    "frames": 300,
    "seed": 0,
    "workers": 0,
    "columns": LidarSpec.columns,
    "progress": True,
}


def main(argv=None) -> int:
    args = parse_args(argv, DEFAULTS, USAGE)
    if args["out"] is None:
        raise SystemExit("error: out=DIR is required (see --help)")
    for key, lo in (("frames", 1), ("seed", 0), ("workers", 0), ("columns", 8)):
        if args[key] < lo:
            raise SystemExit(f"error: {key}={args[key]}: must be >= {lo}")
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


if __name__ == "__main__":
    sys.exit(main())
