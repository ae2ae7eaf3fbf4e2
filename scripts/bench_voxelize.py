"""Voxelizer and computation-mask benchmark:
the logic is :mod:`detector.bench.voxelize`; ``--help`` for the arguments."""

import sys

from detector.bench.voxelize import main

if __name__ == "__main__":
    sys.exit(main())
