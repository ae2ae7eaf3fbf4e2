"""One checkpoint on both sparse paths, training step and inference, taking turns: the logic is
:mod:`detector.bench.paths`; ``--help`` for the arguments."""

import sys

from detector.bench.paths import main

if __name__ == "__main__":
    sys.exit(main())
