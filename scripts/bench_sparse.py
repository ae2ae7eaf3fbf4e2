"""Sparse-block benchmark: dense vs sparse convolution and residual unit:
the logic is :mod:`detector.bench.sparse`; ``--help`` for the arguments."""

import sys

from detector.bench.sparse import main

if __name__ == "__main__":
    sys.exit(main())
