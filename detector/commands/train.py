"""``detector-train [hydra overrides]`` (or ``python scripts/train.py ...``): train the BEV detector, then
evaluate its best checkpoint (see the README's cookbook)."""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from detector.commands.overrides import check_overrides
from detector.errors import run_cleanly
from detector.resources import config_dir


@hydra.main(config_path=str(config_dir()), config_name="train", version_base="1.3")
def _run(cfg: DictConfig) -> float | None:
    from detector.tasks import train

    result = run_cleanly(train, cfg)
    metrics = result.get("metrics") or {}
    print(f"wall time: {result['wall_s']:.0f} s; best checkpoint: {result['best_ckpt']}")
    # the value Hydra's sweepers optimize in multiruns
    return metrics.get("Car", {}).get("bev", {}).get("R40", {}).get("moderate")


def main() -> None:
    check_overrides("train", sys.argv[1:])
    _run()
