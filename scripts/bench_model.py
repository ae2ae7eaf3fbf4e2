"""Inference time per frame of the whole detector, dense vs sparse:
the logic is :mod:`detector.bench.model`; ``--help`` for the arguments."""

import sys

from detector.bench.model import main

if __name__ == "__main__":
    sys.exit(main())
