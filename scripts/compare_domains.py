"""Domain report: simulated vs real point-cloud statistics:
the logic is :mod:`detector.bench.compare_domains`; ``--help`` for the arguments."""

import sys

from detector.bench.compare_domains import main

if __name__ == "__main__":
    sys.exit(main())
