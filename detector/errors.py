"""The errors a user can cause (bad data, bad config, bad checkpoint), and the one line that reports them.

This module imports nothing of ours: every layer may raise these types.
"""

from __future__ import annotations

import os
import re
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
    """A checkpoint (or an exported program) is missing, damaged, or is not a plain weights checkpoint."""


# The project's own error types: what a user can cause (bad data, bad config, bad checkpoint), reported in one line.
PROJECT_ERRORS = (ConfigError, KittiFormatError, CheckpointError)
# For ``except`` clauses; :func:`is_user_error` also tells which of Hydra's instantiation failures are the user's.
USER_ERRORS = (*PROJECT_ERRORS, HydraException)


def root_cause(e: BaseException) -> BaseException:
    """The innermost exception of a ``raise ... from ...`` chain."""
    while e.__cause__ is not None:
        e = e.__cause__
    return e


def is_user_error(e: BaseException) -> bool:
    """True for what a user caused, reported in one line: the project's own errors, Hydra's (a bad override, a
    missing config), and Hydra failing to instantiate a config node because of a project error or because the node's
    keys do not fit the target's signature (a missing or unknown argument). Anything else - a bare ``ValueError``
    from deep inside a library included - is a bug and keeps its traceback."""
    if isinstance(e, PROJECT_ERRORS):
        return True
    if isinstance(e, InstantiationException):
        cause = e.__cause__
        signature = (isinstance(cause, TypeError) and cause.__traceback__ is not None
                     and cause.__traceback__.tb_next is None)  # raised by the call itself, not inside the target
        return signature or isinstance(root_cause(e), PROJECT_ERRORS)
    return isinstance(e, HydraException)


def one_line(e: BaseException) -> str:
    """``error: <message>`` for a user error, on one line: the root cause's message (prefixed with the config node
    Hydra was instantiating, where it says); for Hydra's own errors (a bad override, a missing config, a node whose
    keys do not fit its target) every message of the chain, without Hydra's search path."""
    root = root_cause(e)
    if isinstance(e, HydraException) and not isinstance(root, PROJECT_ERRORS):
        parts, cur = [], e
        while cur is not None:
            text = " ".join(str(cur).split("Config search path:")[0].split())
            if text and text not in parts and not any(text in p for p in parts):
                parts.append(text)
            cur = cur.__cause__
        return "error: " + ": ".join(parts)
    text = " ".join(str(root).split())
    key = re.search(r"full_key: (\S+)", str(e)) if isinstance(e, InstantiationException) else None
    return "error: " + (f"{key.group(1)}: {text}" if key and not text.startswith(key.group(1)) else text)


def run_cleanly(fn: Callable[..., Any], *args, **kwargs) -> Any:
    """Call ``fn``; on a user error (:func:`is_user_error`) print :func:`one_line` to stderr and exit with status 1
    (no traceback; ``HYDRA_FULL_ERROR=1`` shows it). Any other exception propagates with its traceback."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        if not is_user_error(e) or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(one_line(e), file=sys.stderr)
        sys.exit(1)
