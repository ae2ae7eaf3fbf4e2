"""Data benchmark: simulator and KITTI reader throughput:
the logic is :mod:`detector.bench.data`; ``--help`` for the arguments."""

import sys

from detector.bench.data import main

if __name__ == "__main__":
    sys.exit(main())
