"""The errors a user can cause (bad data, bad config, bad checkpoint), and the one line that reports them.

This module imports nothing of ours: every layer may raise these types.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hydra.errors import HydraException, InstantiationException


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key."""


class KittiFormatError(ValueError):
    """A KITTI-format file is missing or invalid. The message names the file (and line)."""

    def __init__(self, path: str | Path, message: str, line: int | None = None):
        self.path = str(path)
        self.line = line
        where = f"{path}:{line}" if line is not None else f"{path}"
        super().__init__(f"{where}: {message}")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, or is not a plain weights checkpoint."""


# What a user can cause: reported in one line. Anything else is a bug and keeps its traceback.
USER_ERRORS = (ConfigError, KittiFormatError, CheckpointError, ValueError, FileNotFoundError, HydraException)


def root_cause(e: BaseException) -> BaseException:
    """The innermost exception of a ``raise ... from ...`` chain."""
    while e.__cause__ is not None:
        e = e.__cause__
    return e


def one_line(e: BaseException) -> str:
    """``error: <message>`` for a user error, on one line: the root cause's message; for Hydra's own errors
    (a bad override, a missing config) every message of the chain, without Hydra's search path."""
    if isinstance(e, HydraException) and not isinstance(e, InstantiationException):
        parts, cur = [], e
        while cur is not None:
            text = " ".join(str(cur).split("Config search path:")[0].split())
            if text and text not in parts:
                parts.append(text)
            cur = cur.__cause__
        return "error: " + ": ".join(parts)
    return "error: " + " ".join(str(root_cause(e)).split())


def run_cleanly(fn: Callable[..., Any], *args, **kwargs) -> Any:
    """Call ``fn``; on a user error print :func:`one_line` to stderr and exit with status 1 (no traceback;
    ``HYDRA_FULL_ERROR=1`` shows it)."""
    try:
        return fn(*args, **kwargs)
    except USER_ERRORS as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(one_line(e), file=sys.stderr)
        sys.exit(1)
