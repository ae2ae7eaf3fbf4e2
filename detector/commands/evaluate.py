"""``detector-evaluate ckpt_path=PATH [data.root=DIR] [split=NAME]`` (or ``python scripts/evaluate.py ...``):
evaluate a checkpoint on a KITTI-format or LiDAR-only root.

The data settings are the ones the checkpoint trained with (its root, layout, classes and their minimum IoUs, its val
split), except where the command line sets them (:func:`detector.tasks.checkpoint_data`). Prints which split of which
root it scores, the table, and a warning when those frames are also in the split the checkpoint trained on; writes
metrics.json and the result files in the run's output directory.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from detector.commands.overrides import check_overrides
from detector.errors import run_cleanly
from detector.resources import config_dir


@hydra.main(config_path=str(config_dir()), config_name="eval", version_base="1.3")
def _run(cfg: DictConfig) -> None:
    from detector.tasks import evaluate

    run_cleanly(evaluate, cfg)


def main() -> None:
    check_overrides("eval", sys.argv[1:])
    _run()
