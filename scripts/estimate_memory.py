"""Predicted peak memory of training and inference per batch size:
the logic is :mod:`detector.bench.estimate_memory`; ``--help`` for the arguments."""

import sys

from detector.bench.estimate_memory import main

if __name__ == "__main__":
    sys.exit(main())
