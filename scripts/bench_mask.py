"""Mask network settings screened without training a detector: recall against MACs:
the logic is :mod:`detector.bench.mask`; ``--help`` for the arguments."""

import sys

from detector.bench.mask import main

if __name__ == "__main__":
    sys.exit(main())
