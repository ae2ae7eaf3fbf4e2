"""The machine a measurement ran on, as the benchmarks and the cost model's cache record it."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name: /proc/cpuinfo's first ``model name``, else what ``platform`` knows, else "unknown"."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


# The allocator settings the Makefile exports (docs/speed.md, CPU settings, says why): a benchmark records them.
ALLOCATOR_VARS = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "THP_MEM_ALLOC_ENABLE")


def allocator_env() -> dict[str, str | None]:
    """This process's allocator settings (:data:`ALLOCATOR_VARS`; None where unset)."""
    return {k: os.environ.get(k) for k in ALLOCATOR_VARS}
