"""KITTI evaluation of result files against label files:
the same command as ``detector-kitti-eval`` (:mod:`detector.commands.kitti_eval`); ``--help`` for the arguments."""

import sys

from detector.commands.kitti_eval import main

if __name__ == "__main__":
    sys.exit(main())
