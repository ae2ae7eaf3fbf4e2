"""``detector-train [hydra overrides]`` (or ``python scripts/train.py ...``): train the BEV detector, then
evaluate its best checkpoint (see the README's cookbook)."""

from __future__ import annotations

import logging
import sys
import warnings

import hydra
from omegaconf import DictConfig

from detector.commands.overrides import check_overrides
from detector.errors import run_cleanly
from detector.resources import config_dir

# Lightning's warnings about Lightning itself or about how this project is built, which no user can act on: a
# deprecation inside its own code, and the batch transfer the module defines on purpose (Batch.to).
_NOT_ACTIONABLE = (
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning, r"lightning\.pytorch\.utilities\._pytree"),
    (r"You have overridden `transfer_batch_to_device` in `LightningModule` but have passed in a "
     r"`LightningDataModule`", Warning, r"lightning\.pytorch\.trainer\.connectors\.data_connector"),
)


class _NoAdvert(logging.Filter):
    """Drops Lightning's advertisements ("💡 Tip: ... try installing [litlogger] ...")."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip:")


def quiet_console() -> None:
    """Each of Lightning's lines once, no advertisement, none of its warnings that no user can act on.

    ``import lightning`` gives its package loggers a console handler of their own, and Hydra's job logging (root:
    the console and the run folder's ``<task>.log``) gets the same records by propagation: every line twice. Where
    Hydra's handlers are there, Lightning's are removed and its records go to them (console and log file); with
    Hydra's logging off, Lightning's own handlers print them once."""
    import lightning  # noqa: F401  (adds its handlers)

    if logging.getLogger().handlers:
        for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
            logger = logging.getLogger(name)
            for handler in list(logger.handlers):
                logger.removeHandler(handler)
            logger.propagate = True
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_NoAdvert())
    for message, category, module in _NOT_ACTIONABLE:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


@hydra.main(config_path=str(config_dir()), config_name="train", version_base="1.3")
def _run(cfg: DictConfig) -> float | None:
    from detector.tasks import train

    quiet_console()
    result = run_cleanly(train, cfg)
    metrics = result.get("metrics") or {}
    print(f"wall time: {result['wall_s']:.0f} s; best checkpoint: {result['best_ckpt']}")
    # the value Hydra's sweepers optimize in multiruns
    return metrics.get("Car", {}).get("bev", {}).get("R40", {}).get("moderate")


def main() -> None:
    check_overrides("train", sys.argv[1:])
    _run()
