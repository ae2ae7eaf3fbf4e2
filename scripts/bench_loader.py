"""Training-frame loading with and without the frame cache:
the logic is :mod:`detector.bench.loader`; ``--help`` for the arguments."""

import sys

from detector.bench.loader import main

if __name__ == "__main__":
    sys.exit(main())
