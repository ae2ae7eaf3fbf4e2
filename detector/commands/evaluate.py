"""``detector-evaluate ckpt_path=PATH [data.root=DIR]`` (or ``python scripts/evaluate.py ...``): evaluate a
checkpoint on a KITTI-format root.

Prints the KITTI table, writes metrics.json and KITTI result files in the run's output directory.
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
