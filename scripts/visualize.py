"""Render a frame with its ground truth and predictions:
the same command as ``detector-visualize`` (:mod:`detector.commands.visualize`); ``--help`` for the arguments."""

import sys

from detector.commands.visualize import main

if __name__ == "__main__":
    sys.exit(main())
