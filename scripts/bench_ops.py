"""Micro-benchmark of the sbnet CPU kernels against naive PyTorch versions:
the logic is :mod:`detector.bench.ops`; ``--help`` for the arguments."""

import sys

from detector.bench.ops import main

if __name__ == "__main__":
    sys.exit(main())
