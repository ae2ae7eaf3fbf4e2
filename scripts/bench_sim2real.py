"""Sim-to-real: a detector trained on the simulator, evaluated on real KITTI frames:
the logic is :mod:`detector.bench.sim2real`; ``--help`` for the arguments."""

import sys

from detector.bench.sim2real import main
from detector.errors import run_cleanly

if __name__ == "__main__":
    sys.exit(run_cleanly(main))
