"""Run a checkpoint on point-cloud files (.bin, .npy, .pcd, .ply) and write the boxes it finds:
the same command as ``detector-predict`` (:mod:`detector.commands.predict`); ``--help`` for the arguments."""

import sys

from detector.commands.predict import main

if __name__ == "__main__":
    sys.exit(main())
