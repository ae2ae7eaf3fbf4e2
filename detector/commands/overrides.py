"""A bad Hydra override reported in one line, before Hydra runs (Hydra's own report takes several)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import OmegaConf

from detector.errors import one_line
from detector.resources import config_dir


def check_overrides(config_name: str, argv: Sequence[str]) -> None:
    """Compose ``config_name`` with the command line's overrides once; on a Hydra error (unknown key or
    option, bad syntax, an ambiguous value) or a mandatory value left out (``???``, e.g. ``ckpt_path``), print
    one line and exit with status 1.
    A command line with Hydra's flags (``--multirun``, ``--cfg`` ...) goes to Hydra unchecked;
    ``HYDRA_FULL_ERROR=1`` leaves every error to Hydra."""
    if any(a.startswith("-") for a in argv) or os.environ.get("HYDRA_FULL_ERROR") == "1":
        return
    try:
        with initialize_config_dir(str(config_dir()), version_base="1.3"):
            cfg = compose(config_name, overrides=list(argv), return_hydra_config=True)
    except HydraException as e:
        print(one_line(e), file=sys.stderr)
        sys.exit(1)
    missing = _missing(OmegaConf.to_container(cfg, resolve=False), "")
    if missing:
        print(f"error: {', '.join(missing)} must be given (e.g. {missing[0]}=...)", file=sys.stderr)
        sys.exit(1)


def _missing(node: Any, prefix: str) -> list[str]:
    """Keys whose value is still ``???`` (Hydra's own ``hydra`` node left out: it is filled at run time)."""
    if isinstance(node, dict):
        return [k for key, v in node.items() if not (prefix == "" and key == "hydra")
                for k in _missing(v, f"{prefix}{key}.")]
    return [prefix.rstrip(".")] if node == "???" else []
