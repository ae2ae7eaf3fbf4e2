"""Speed/accuracy curve of one checkpoint over the computation mask:
the logic is :mod:`detector.bench.tradeoff`; ``--help`` for the arguments."""

import sys

from detector.bench.tradeoff import main

if __name__ == "__main__":
    sys.exit(main())
