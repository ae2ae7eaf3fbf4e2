"""Compile check of kernels/cuda/*.cu with a CUDA build of torch (no GPU needed; slow; not in CI).

Uses the python of ``.venv-cuda`` (created by ``make kernels-cuda``) and nvcc from ``CUDA_HOME``;
skips where either is missing. The build is cached in build/, so a rerun compiles only what changed.
"""

import os
import subprocess
from pathlib import Path

import pytest

from tests.paths import REPO

CUDA_HOME = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
CUDA_PYTHON = REPO / ".venv-cuda" / "bin" / "python"


@pytest.mark.slow
@pytest.mark.skipif(not (CUDA_HOME / "bin" / "nvcc").exists(), reason=f"no nvcc under {CUDA_HOME}")
@pytest.mark.skipif(not CUDA_PYTHON.exists(), reason="no .venv-cuda: run make kernels-cuda")
def test_cuda_sources_compile():
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0")
    env = dict(os.environ, CUDA_HOME=str(CUDA_HOME), TORCH_CUDA_ARCH_LIST=arch)
    code = "from detector.ops import _library; print(_library.build(with_cuda=True))"
    res = subprocess.run([str(CUDA_PYTHON), "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=1800)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    library = Path(res.stdout.strip().splitlines()[-1])
    assert library.name == "sbnet_kernels_cuda.so" and library.exists()
