"""One folder per run: the Hydra callback that claims ``hydra.run.dir`` (``hydra.sweep.dir`` in a multirun) before
Hydra writes ``.hydra/`` or the log into it.

A folder named by the start time (the default, ``outputs/<task>/<date_time>``) is versioned when another run already
has it (``<date_time>_1``, ``_2``, ... : two runs started in the same second get two folders). A folder the user named
(``hydra.run.dir=DIR``) is refused in one line when it holds anything: a second run there would mix its config, log
and checkpoints with the first one's. The processes Lightning starts for DDP reuse their launcher's folder.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, read_write

from detector.errors import ConfigError, one_line
from detector.outputs import claim_dir

_MAX_VERSIONS = 1000


def _claim(cfg: DictConfig, key: str) -> None:
    node, leaf = key.rsplit(".", 1)
    parent = OmegaConf.select(cfg, node)
    timed = "${now:" in str(OmegaConf.to_container(parent, resolve=False)[leaf])
    path = str(OmegaConf.select(cfg, key))
    try:
        for version in range(_MAX_VERSIONS if timed else 1):
            candidate = path if version == 0 else f"{path}_{version}"
            if claim_dir(candidate):
                break
        else:
            if timed:
                raise ConfigError(f"{key}={path}: {_MAX_VERSIONS} runs already started in this second")
            raise ConfigError(f"{key}={path}: the folder already holds a run (or other files): one folder per run; "
                              "choose a new folder (to continue that run, resume from its "
                              "checkpoints/last.ckpt with ckpt_path=... in a new folder)")
    except OSError as e:
        what = "a file is in the way" if isinstance(e, (FileExistsError, NotADirectoryError)) else e.strerror
        raise ConfigError(f"{key}={path}: cannot create the run folder ({what}); choose a writable folder") from None
    if candidate != path:
        with read_write(parent):
            parent[leaf] = candidate


class ClaimRunDir(Callback):
    """Claims the run's folder before Hydra uses it (see the module docstring); a failure is one line, status 1."""

    def _guarded(self, cfg: DictConfig, key: str) -> None:
        if os.environ.get("LOCAL_RANK", "0") != "0":  # a DDP worker: its launcher claimed the folder
            return
        try:
            _claim(cfg, key)
        except ConfigError as e:
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            print(one_line(e), file=sys.stderr)
            raise SystemExit(1) from None

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._guarded(config, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._guarded(config, "hydra.sweep.dir")
