"""Validate a KITTI-format root and print a summary:
the same command as ``detector-inspect-dataset`` (:mod:`detector.commands.inspect_dataset`);
``--help`` for the arguments."""

import sys

from detector.commands.inspect_dataset import main

if __name__ == "__main__":
    sys.exit(main())
