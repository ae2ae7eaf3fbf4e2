"""Train the BEV detector: ``python scripts/train.py [hydra overrides]`` (see README for examples)."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from detector.errors import run_cleanly  # noqa: E402


@hydra.main(config_path="../configs", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    from detector.tasks import train

    result = run_cleanly(train, cfg)
    metrics = result.get("metrics") or {}
    print(f"wall time: {result['wall_s']:.0f} s; best checkpoint: {result['best_ckpt']}")
    # the value Hydra's sweepers optimize in multiruns
    return metrics.get("Car", {}).get("bev", {}).get("R40", {}).get("moderate")


if __name__ == "__main__":
    main()
