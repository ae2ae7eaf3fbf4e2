"""One checkpoint evaluated every way its sparse network can run (tiles, dense, the plan, the path): the logic is
:mod:`detector.bench.invariance`; ``--help`` for the arguments."""

import sys

from detector.bench.invariance import main

if __name__ == "__main__":
    sys.exit(main())
