"""Inference ms/frame of the exported detector: eager, torch.compile, .pt2, onnxruntime:
the logic is :mod:`detector.bench.export`; ``--help`` for the arguments."""

import sys

from detector.bench.export import main

if __name__ == "__main__":
    sys.exit(main())
