"""Export a checkpoint's inference network (torch.export .pt2 or ONNX):
the same command as ``detector-export`` (:mod:`detector.commands.export`); ``--help`` for the arguments."""

import sys

from detector.commands.export import main

if __name__ == "__main__":
    sys.exit(main())
