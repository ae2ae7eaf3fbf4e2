"""Where the sparse detector's time goes on a GPU:
the logic is :mod:`detector.bench.profile_gpu`; ``--help`` for the arguments."""

import sys

from detector.bench.profile_gpu import main

if __name__ == "__main__":
    sys.exit(main())
