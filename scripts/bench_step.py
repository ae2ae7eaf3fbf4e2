"""Milliseconds of one training step of a configuration on one fixed batch: the logic is
:mod:`detector.bench.step`; ``--help`` for the arguments."""

import sys

from detector.bench.step import main

if __name__ == "__main__":
    sys.exit(main())
