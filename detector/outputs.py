"""Outputs: paths checked before the work starts, run folders claimed once, files written whole or not at all.

A command that writes a file or folder checks here first that it can: a path that cannot be written then costs
one line naming the key, not a traceback after the whole job ran. A file is written to a temporary name beside it
and moved into place, so a reader (or a run stopped half way) never sees half a file. This module imports only the
error types.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
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
    writable_dir(path.parent, key)
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


@contextmanager
def atomic_path(path: str | Path, durable: bool = False, keep_suffix: bool = True) -> Iterator[Path]:
    """A temporary, hidden path in ``path``'s folder to write to; moved onto ``path`` when the block succeeds,
    removed when it raises. ``keep_suffix``: the temporary name ends in ``path``'s suffix (writers that pick the
    format by the extension still work), else in ``.tmp`` (a ``*.ckpt`` listing never sees a half-written one).
    ``durable``: the file and the folder's entry are flushed to the disk too (it survives a power cut as old or
    new)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"
                         + (path.suffix if keep_suffix else ""))
    try:
        yield tmp
        if not tmp.is_file():  # a writer that reports failure by writing nothing (open3d's)
            raise OSError(f"{path}: nothing was written")
        if durable:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if durable:
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: str | Path, text: str) -> None:
    """``path.write_text(text)``, whole or not at all."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)
