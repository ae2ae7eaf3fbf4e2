"""Estimated vs measured peak memory of a training step and of inference:
the logic is :mod:`detector.bench.memory`; ``--help`` for the arguments."""

import sys

from detector.bench.memory import main

if __name__ == "__main__":
    sys.exit(main())
