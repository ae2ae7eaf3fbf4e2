"""Training plumbing: exact RNG resume, ``last.ckpt`` at every checkpoint event, atomic weights-only checkpoints,
a run started from a checkpoint's weights (``init_from``)."""

from __future__ import annotations

import pickle
import random
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_warn

from detector.errors import CheckpointError, ConfigError
from detector.outputs import atomic_path


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


class LastCheckpoint(ModelCheckpoint):
    """``<dirpath>/last.ckpt``: the latest training state, written at every checkpoint event - each epoch end and
    validation, every ``every_n_train_steps`` steps when set, the end of training and an exception - whatever the
    monitored metric did. A crash (SIGKILL included) therefore loses at most the steps since the last
    of these. The best checkpoint by validation AP is another :class:`ModelCheckpoint` (``save_last=False``), listed
    before this one so that the ``last.ckpt`` of a validation holds that callback's updated best.

    (Lightning's ``ModelCheckpoint(save_last=True, monitor=...)`` writes ``last.ckpt`` only when it writes a top-k
    checkpoint, i.e. when the metric improved: a plateaued run's ``last.ckpt`` stays at its best epoch.)

    Args:
        dirpath: the run's checkpoint folder.
        every_n_train_steps: also write every N optimizer steps, mid-epoch (None: at validation / epoch end only).
        save_on_exception: write when training stops on an exception (Ctrl-C included).
    """

    def __init__(self, dirpath: str | Path, every_n_train_steps: int | None = None, save_on_exception: bool = True):
        super().__init__(dirpath=dirpath, filename=self.CHECKPOINT_NAME_LAST, monitor=None, save_top_k=1,
                         save_last=False, every_n_train_steps=every_n_train_steps,
                         save_on_exception=save_on_exception, auto_insert_metric_name=False,
                         enable_version_counter=False)

    @property
    def path(self) -> str:
        """The file written last ("" before the first)."""
        return self.best_model_path

    def _save_latest(self, trainer: L.Trainer) -> None:
        if not self._should_skip_saving_checkpoint(trainer):  # not yet saved at this step, fitting, no sanity check
            self._save_topk_checkpoint(trainer, self._monitor_candidates(trainer))

    # At a validation, the best-by-AP callback saves (and updates the state last.ckpt holds) at validation end or,
    # when each epoch ends in one, at the epoch end that follows: last.ckpt is written at the same hook, after it.
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._should_save_on_train_epoch_end(trainer):
            self._save_latest(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._save_latest(trainer)  # every epoch, validated or not (check_val_every_n_epoch > 1)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._save_latest(trainer)  # training stopped between two events (max_steps mid-epoch)


class BestCheckpoint(ModelCheckpoint):
    """Lightning's :class:`ModelCheckpoint` whose ``monitor="auto"`` is the metric validation logs for the dataset
    and classes of the run (:meth:`detector.module.DetectorModule.monitor_key`): the BEV AP R40 of the first scored
    class, ``..._moderate`` on a KITTI root and ``..._overall`` on a LiDAR-only one (no difficulty levels there).
    Where validation scores no class it monitors nothing (one warning): ``last.ckpt`` stays the run's state. Any other
    ``monitor`` is Lightning's (a key validation logs, or None)."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.monitor == "auto":
            self.monitor = self._auto_monitor(trainer, pl_module)
            if self.monitor is None:
                self.save_top_k = 0
        super().setup(trainer, pl_module, stage)

    @staticmethod
    def _auto_monitor(trainer: L.Trainer, pl_module: L.LightningModule) -> str | None:
        dm = getattr(trainer, "datamodule", None)
        lidar = dm is not None and dm.dataset("val").root.layout == "lidar"
        key = pl_module.monitor_key(lidar, getattr(dm, "min_overlap", None))
        if key is None:
            rank_zero_warn(f"callbacks.model_checkpoint.monitor=auto: validation scores none of the model's classes "
                           f"{pl_module.classes} (give each a minimum IoU in data.classes): no best checkpoint by AP, "
                           "last.ckpt only")
        return key


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes a checkpoint to a temporary file in the target folder, fsyncs it and renames it into place,
    so a kill at any moment leaves either the old or the new checkpoint, never a torn one. Loads with
    ``torch.load(weights_only=True)``: a checkpoint holding pickled objects is refused."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path, durable=True, keep_suffix=False) as tmp:
            torch.save(checkpoint, tmp)

    def load_checkpoint(
        self, path, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        return load_checkpoint(path, map_location)


def load_checkpoint(path, map_location: Any = "cpu") -> dict[str, Any]:
    """``torch.load(path, weights_only=True)`` with one readable line for what cannot be loaded: a missing file, a
    file that is not a torch checkpoint (empty, truncated, corrupt, another format) or one that holds pickled
    objects. torch's advice to retry with ``weights_only=False`` is not passed on: that runs the file's code."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: checkpoint not found")
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive
        raise CheckpointError(f"{path}: not a torch checkpoint ({path.stat().st_size} bytes: empty, truncated, "
                              "corrupt or another format)")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        what = f" ({found.group(1)})" if found else ""
        raise CheckpointError(f"{path}: refused to load: it holds pickled Python objects{what}, and checkpoints are "
                              "loaded as plain tensors and containers only (weights_only=True)") from None
    except Exception as e:  # a damaged archive: torch raises RuntimeError with long texts
        first = str(e).strip().split(". ")[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: refused to load: the checkpoint is damaged ({first})") from None


@dataclass
class InitFrom:
    """What :func:`init_from_checkpoint` did: the model's tensors it loaded from the checkpoint (``loaded``), those
    that kept their fresh initialisation because the checkpoint has no tensor of that name (``missing``) or one of
    another shape (``reshaped``: name, checkpoint's shape, model's shape), and the checkpoint's tensors the model
    has no place for (``unused``)."""

    path: str
    loaded: list[str]
    missing: list[str]
    reshaped: list[tuple[str, tuple[int, ...], tuple[int, ...]]]
    unused: list[str]

    @property
    def fresh(self) -> list[str]:
        """The model's tensors that kept their fresh initialisation."""
        return sorted([*self.missing, *(name for name, _, _ in self.reshaped)])

    def line(self, first: int = 4) -> str:
        """The one line a run prints: counts, and the first ``first`` names of each kind."""
        total = len(self.loaded) + len(self.fresh)
        parts = [f"init_from={self.path}: loaded {len(self.loaded)} of the model's {total} tensors (weights only: "
                 "a fresh optimizer, schedule and step)"]
        if self.reshaped:
            shown = ", ".join(f"{n} {list(a)}->{list(b)}" for n, a, b in self.reshaped[:first])
            parts.append(f"{len(self.reshaped)} of another shape kept fresh ({shown}"
                         + (", ..." if len(self.reshaped) > first else "") + ")")
        if self.missing:
            parts.append(f"{len(self.missing)} not in the checkpoint kept fresh ({', '.join(self.missing[:first])}"
                         + (", ..." if len(self.missing) > first else "") + ")")
        if self.unused:
            parts.append(f"{len(self.unused)} of the checkpoint unused ({', '.join(self.unused[:first])}"
                         + (", ..." if len(self.unused) > first else "") + ")")
        return "; ".join(parts)


def init_from_checkpoint(model: torch.nn.Module, path: str | Path, resume: str | Path | None = None) -> InitFrom:
    """Start ``model`` from the weights of the checkpoint at ``path`` (``init_from=``; loaded weights-only by
    :func:`load_checkpoint`): each tensor of its ``state_dict`` (``model.`` prefix) whose name and shape match one of
    the model's is copied in; the others (e.g. a head for other classes) keep their fresh initialisation. Nothing
    else of the checkpoint is used - not its optimizer, schedule, step or epoch (that is resuming, ``ckpt_path=``).

    One-line errors: a checkpoint that cannot be loaded (:class:`CheckpointError`), ``resume`` given too, or no
    tensor of the checkpoint fitting the model (:class:`ConfigError`)."""
    if resume:
        raise ConfigError(f"init_from={path} and ckpt_path={resume}: give one - init_from starts a new run from a "
                          "checkpoint's weights, ckpt_path resumes a run (its optimizer, schedule and step too)")
    try:
        ckpt = load_checkpoint(path)
    except CheckpointError as e:
        raise CheckpointError(f"init_from={e}") from None
    saved = ckpt.get("state_dict") if isinstance(ckpt, dict) else None
    if not isinstance(saved, dict):
        raise ConfigError(f"init_from={path}: not a training checkpoint (no state_dict; was it written by "
                          "scripts/train.py?)")
    state = {k.removeprefix("model."): v for k, v in saved.items() if k.startswith("model.")}
    own = model.state_dict()
    loaded = [k for k in own if k in state and tuple(state[k].shape) == tuple(own[k].shape)]
    reshaped = [(k, tuple(state[k].shape), tuple(own[k].shape)) for k in own
                if k in state and tuple(state[k].shape) != tuple(own[k].shape)]
    missing = [k for k in own if k not in state]
    unused = [k for k in state if k not in own]
    if not loaded:
        raise ConfigError(f"init_from={path}: no tensor of the checkpoint fits this model (names and shapes differ "
                          f"everywhere: {len(reshaped)} of another shape, {len(missing)} absent): was it trained "
                          "with another bev, model or mask?")
    model.load_state_dict({k: state[k] for k in loaded}, strict=False)
    return InitFrom(str(path), loaded, missing, reshaped, unused)
