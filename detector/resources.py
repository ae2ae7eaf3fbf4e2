"""Where the project's non-Python folders are: the source tree's, or the copies a wheel installs.

``kernels/`` (the C++/CUDA sources the ops JIT-build) and ``configs/`` (the Hydra configs) live at the
repository root. A wheel maps them into the package at build time as ``detector/_kernels`` and
``detector/_configs`` (``pyproject.toml``: ``[tool.setuptools.package-dir]``), so an installed package
finds them without the source tree. Imports nothing of ours.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

_SOURCE_ROOT = Path(__file__).resolve().parents[1]


def project_dir(name: str) -> Path:
    """The folder ``name`` (``kernels`` or ``configs``): the source tree's when this package runs from a
    checkout (editable install, tests), else the copy installed inside the package as ``detector/_<name>``."""
    source = _SOURCE_ROOT / name
    if (_SOURCE_ROOT / "pyproject.toml").is_file() and source.is_dir():
        return source
    installed = Path(str(importlib.resources.files("detector") / f"_{name}"))
    if not installed.is_dir():
        raise FileNotFoundError(f"{name}/ not found: neither {source} (source tree) nor {installed} (installed wheel)")
    return installed


def config_dir() -> Path:
    """The Hydra config folder (``train.yaml``, ``eval.yaml`` and the groups)."""
    return project_dir("configs")


def cache_dir() -> Path:
    """The user's cache folder for what the package derives and keeps between runs (the plan's cost model, the
    GT-sampling database outside a config's ``paths.cache_dir``): ``$DETECTOR_CACHE_DIR``, default
    ``~/.cache/detector``."""
    import os

    return Path(os.environ.get("DETECTOR_CACHE_DIR", Path.home() / ".cache" / "detector"))


def outputs_dir() -> Path:
    """Where the benchmarks write their runs: ``$PROJECT_ROOT/outputs`` (the configs' ``paths.log_dir``) where
    ``PROJECT_ROOT`` is set, else the checkout's ``outputs/``."""
    import os

    return Path(os.environ.get("PROJECT_ROOT", _SOURCE_ROOT)) / "outputs"
