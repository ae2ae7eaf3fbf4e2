"""Evaluate a checkpoint on a KITTI-format root: ``python scripts/evaluate.py ckpt_path=PATH [data.root=DIR]``.

Prints the KITTI table, writes metrics.json and KITTI result files in the run's output directory.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from detector.errors import run_cleanly  # noqa: E402


@hydra.main(config_path="../configs", config_name="eval", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from detector.tasks import evaluate

    run_cleanly(evaluate, cfg)


if __name__ == "__main__":
    main()
