"""Build and load the CPU emulation of the sbnet CUDA kernels (kernels/emulate/cuda_bodies.cpp).

``load()`` compiles it once with :func:`torch.utils.cpp_extension.load` (``-O2``, no OpenMP: the
emulation is serial on purpose) into ``build/sbnet_cuda_emulation/torch<version>/`` (ninja rebuilds
only what changed) and returns ``torch.ops.sbnet_emu``, whose ops have the schemas of
``kernels/schemas.h`` and run the CUDA files' host code and element bodies on CPU tensors.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import torch

from tests.paths import REPO

KERNELS = REPO / "kernels"
SOURCE = KERNELS / "emulate" / "cuda_bodies.cpp"

_lock = threading.Lock()
_loaded = False


def build_dir() -> Path:
    return REPO / "build" / "sbnet_cuda_emulation" / f"torch{torch.__version__}"


def load(verbose: bool = False):
    """Build (if needed) and load the emulation library; returns ``torch.ops.sbnet_emu``. Raises on failure."""
    global _loaded
    with _lock:
        if not _loaded:
            from torch.utils.cpp_extension import load as cpp_load

            if shutil.which("ninja") is None:  # a venv that is not activated: its pip ninja is off PATH
                import ninja

                os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
            out = build_dir()
            out.mkdir(parents=True, exist_ok=True)
            cpp_load(name="sbnet_cuda_emulation", sources=[str(SOURCE)], extra_include_paths=[str(KERNELS)],
                     extra_cflags=["-O2"], build_directory=str(out), is_python_module=False, verbose=verbose)
            _loaded = True
    return torch.ops.sbnet_emu
