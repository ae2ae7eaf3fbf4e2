"""Generate a KITTI-format dataset with the simulator:
the same command as ``detector-make-dataset`` (:mod:`detector.commands.make_dataset`); ``--help`` for the arguments."""

import sys

from detector.commands.make_dataset import main

if __name__ == "__main__":
    sys.exit(main())
