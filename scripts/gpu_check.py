"""Prepared GPU check (``make gpu-check``): the logic is :mod:`detector.bench.gpu_check`; ``--help`` for the arguments.

It runs under the GPU machine's own ``python3``, where the package is not installed and may not import (importing
``detector`` loads torch and the kernels): so the module, which needs only the standard library, is loaded by its
path, not through the package.
"""

import importlib.util
import sys
from pathlib import Path

if __name__ == "__main__":
    path = Path(__file__).resolve().parents[1] / "detector" / "bench" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.exit(module.main())
