"""Training plumbing: exact RNG resume and atomic, weights-only checkpoints."""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from detector.errors import CheckpointError


class RngStateCallback(L.Callback):
    """Saves the Python, NumPy and torch (CPU and CUDA) RNG states in every checkpoint and restores them
    on resume, so that a resumed run draws the same random numbers as an uninterrupted one. States are
    stored as tensors and lists (loadable with ``weights_only=True``)."""

    def state_dict(self) -> dict[str, Any]:
        np_state = np.random.get_state()
        py_state = random.getstate()
        state = {
            "torch": torch.get_rng_state(),
            "numpy": {
                "key": np_state[0],
                "pos": int(np_state[2]),
                "gauss": [int(np_state[3]), float(np_state[4])],
                "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            },
            "python": {"version": py_state[0], "state": list(py_state[1]), "gauss": py_state[2]},
        }
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        n = state["numpy"]
        np.random.set_state((n["key"], n["keys"].numpy().astype(np.uint32), n["pos"], n["gauss"][0], n["gauss"][1]))
        p = state["python"]
        random.setstate((p["version"], tuple(p["state"]), p["gauss"]))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes a checkpoint to a temporary file in the target folder, fsyncs it and renames it into place,
    so a kill at any moment leaves either the old or the new checkpoint, never a torn one. Loads with
    ``torch.load(weights_only=True)``: a checkpoint holding pickled objects is refused."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def load_checkpoint(
        self, path, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        return load_checkpoint(path, map_location)


def load_checkpoint(path, map_location: Any = "cpu") -> dict[str, Any]:
    """``torch.load(path, weights_only=True)`` with readable errors."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: checkpoint not found")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # torch raises UnpicklingError / RuntimeError with long texts
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{path}: refused to load: not a plain weights checkpoint (weights_only=True): {first}"
        ) from None
