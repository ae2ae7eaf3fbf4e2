"""KITTI evaluation benchmark on a KITTI-val-sized synthetic set:
the logic is :mod:`detector.bench.eval`; ``--help`` for the arguments."""

import sys

from detector.bench.eval import main

if __name__ == "__main__":
    sys.exit(main())
