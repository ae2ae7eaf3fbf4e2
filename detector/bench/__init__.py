"""The benchmarks and the measuring tools behind ``scripts/`` (``make bench``, ``make gpu-check``).

One module per benchmark, each with ``main(argv=None)`` taking the ``key=value`` arguments its docstring lists;
``scripts/bench_<name>.py`` and the other scripts are thin wrappers of these ``main`` functions (scripts/README.md
indexes them, benchmarks/README.md the results they wrote). The top layer of the package: it may import anything
below it; nothing in the package imports it. ``gpu_check`` imports only the standard library (it runs under the
GPU machine's own ``python3``, before the package can be imported).
"""

__all__ = [
    "compare_domains", "data", "estimate_memory", "eval", "export", "finetune_cv", "gpu_check", "gpu_units", "loader",
    "mask", "memory", "model", "ops", "profile_gpu", "sim2real", "sparse", "tradeoff", "train", "voxelize",
]
