"""One readable line for the errors a user can cause (bad data, bad config, bad checkpoint)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from hydra.errors import HydraException, InstantiationException

from detector.callbacks import CheckpointError
from detector.data.kitti import KittiFormatError


def _root_cause(e: BaseException) -> BaseException:
    while e.__cause__ is not None:
        e = e.__cause__
    return e


def run_cleanly(fn: Callable[..., Any], *args, **kwargs) -> Any:
    """Call ``fn``; on a user error print ``error: <message>`` and exit with status 1 (no traceback;
    ``HYDRA_FULL_ERROR=1`` shows it)."""
    try:
        return fn(*args, **kwargs)
    except (KittiFormatError, CheckpointError, ValueError, FileNotFoundError, HydraException) as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        cause = _root_cause(e)
        msg = str(cause) if not isinstance(e, InstantiationException) or cause is not e else str(e)
        print(f"error: {msg}", file=sys.stderr)
        sys.exit(1)
