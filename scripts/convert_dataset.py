"""Write a LiDAR-only dataset from a KITTI-format root: the same command as ``detector-convert-dataset``
(:mod:`detector.commands.convert_dataset`); ``--help`` for the arguments."""

import sys

from detector.commands.convert_dataset import main

if __name__ == "__main__":
    sys.exit(main())
