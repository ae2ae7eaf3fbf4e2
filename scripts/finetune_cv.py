"""Fine-tuning a simulator-trained checkpoint on a few labeled real frames, measured by cross-validation:
the logic is :mod:`detector.bench.finetune_cv`; ``--help`` for the arguments."""

import sys

from detector.bench.finetune_cv import main
from detector.errors import run_cleanly

if __name__ == "__main__":
    sys.exit(run_cleanly(main))
