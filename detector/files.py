"""Writing output files whole or not at all: a reader (or a run stopped half way) never sees half a file."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path in ``path``'s folder, with its suffix (writers that pick the format by the extension
    still work), to write to; moved onto ``path`` when the block succeeds, removed when it raises."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}{path.suffix}")
    try:
        yield tmp
        if not tmp.is_file():
            raise OSError(f"{path}: nothing was written")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)
