"""The README's main run, sparse and its dense twin, trained the same way:
the logic is :mod:`detector.bench.train`; ``--help`` for the arguments."""

import sys

from detector.bench.train import main

if __name__ == "__main__":
    sys.exit(main())
