"""Output paths checked before the work starts, and run folders claimed once.

A command that writes a file or folder checks here first that it can: a path that cannot be written then costs
one line naming the key, not a traceback after the whole job ran. This module imports only the error types.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from detector.errors import ConfigError


def _reason(e: OSError) -> str:
    return e.strerror or type(e).__name__


def _probe(folder: Path) -> None:
    """Create and remove one temporary file in ``folder`` (permissions, read-only mounts and full quotas show)."""
    fd, tmp = tempfile.mkstemp(prefix=".write-check.", dir=folder)
    os.close(fd)
    os.unlink(tmp)


def writable_dir(path: str | Path, key: str) -> Path:
    """``path`` as a folder this process can write into, created (with its parents) when missing.

    Raises :class:`ConfigError` naming ``key`` when a file occupies it or one of its parents, or it cannot be
    created or written."""
    path = Path(path).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        _probe(path)
    except FileExistsError:
        raise ConfigError(f"{key}={path}: a file is in the way (an output folder is needed there); "
                          "choose another path") from None
    except OSError as e:
        raise ConfigError(f"{key}={path}: cannot write there ({_reason(e)}); choose a writable folder") from None
    return path


def writable_file(path: str | Path, key: str) -> Path:
    """``path`` as a file this process can write: not a folder, its folder created when missing and writable.
    Nothing is written at ``path`` itself. Raises :class:`ConfigError` naming ``key``."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise ConfigError(f"{key}={path}: is a folder; give a file name")
    writable_dir(path.parent if str(path.parent) else Path("."), key)
    if path.exists() and not os.access(path, os.W_OK):
        raise ConfigError(f"{key}={path}: the file exists and is not writable; choose another path")
    return path


def claim_dir(path: str | Path) -> bool:
    """Take ``path`` as this process's own folder: True when this call created it, or found it empty and marked it
    first (``.claimed``, created exclusively, so two processes racing for one empty folder cannot both win); False
    when it holds anything else. OSErrors (no permission, a file in the way) propagate."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir()
    except FileExistsError:
        if not path.is_dir():
            raise
        if any(p.name != ".claimed" for p in path.iterdir()):
            return False
    try:
        os.close(os.open(path / ".claimed", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return False
    return True
