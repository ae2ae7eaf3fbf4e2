"""Which errors dominate an evaluation (missed, found but loose, duplicate, background, ...), by distance band:
the same command as ``detector-analyze-errors`` (:mod:`detector.commands.analyze_errors`); ``--help`` for the
arguments."""

import sys

from detector.commands.analyze_errors import main

if __name__ == "__main__":
    sys.exit(main())
