"""Pick a stage's block size (or dense) from a short timing sweep, cached per input shape and sparsity.

The sparse backbone must never be slower than the dense one; which block size is fastest, and whether
sparse wins at all, depends on the map size, channels and how much of the map is active. At first use
of an (input shape, dtype, mask-density bucket) the tuner times each candidate - a few forward runs,
best of ``reps`` - and keeps the fastest. The density bucket is the fraction of mask pixels above the
threshold, rounded to ``bucket`` (default 5 %).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["DENSE", "BlockSizeTuner", "TuneRecord", "mask_density_bucket"]

DENSE = "dense"  # the choice that runs a stage dense


def mask_density_bucket(mask: torch.Tensor, tol: float, bucket: float) -> int:
    """Index of the density bucket of ``mask``: round(fraction of pixels > tol / bucket)."""
    frac = float((mask > tol).float().mean()) if mask.numel() else 0.0
    return int(round(frac / bucket))


@dataclass
class TuneRecord:
    """One tuning decision: the choice and the measured milliseconds of every candidate."""

    choice: int | str
    times_ms: dict[int | str, float] = field(default_factory=dict)


def _best_time_ms(run: Callable[[], object], reps: int) -> float:
    run()  # warm-up: first-touch allocations, oneDNN primitive creation
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


class BlockSizeTuner:
    """Chooses among ``candidates`` (block sizes and/or :data:`DENSE`) by timing, caching per key.

    ``timer(run, reps) -> ms`` measures one candidate (injectable for tests); the default runs
    ``run`` once to warm up and returns the best of ``reps`` wall-clock runs.
    """

    def __init__(
        self,
        candidates: Sequence[int | str] = (8, 16, 32, DENSE),
        reps: int = 2,
        bucket: float = 0.05,
        timer: Callable[[Callable[[], object], int], float] = _best_time_ms,
    ) -> None:
        if not candidates:
            raise ValueError("BlockSizeTuner: candidates must not be empty")
        for c in candidates:
            if not (c == DENSE or (isinstance(c, int) and not isinstance(c, bool) and c >= 1)):
                raise ValueError(f"BlockSizeTuner: candidates must be ints >= 1 or {DENSE!r}, got {c!r}")
        if reps < 1 or not 0 < bucket <= 1:
            raise ValueError(f"BlockSizeTuner: reps must be >= 1 and 0 < bucket <= 1, got {reps}, {bucket}")
        self.candidates = tuple(candidates)
        self.reps = reps
        self.bucket = bucket
        self.timer = timer
        self.records: dict[Hashable, TuneRecord] = {}

    def choose(self, key: Hashable, runs: dict[int | str, Callable[[], object]]) -> int | str:
        """The cached choice for ``key``, or the fastest of ``runs`` (candidate -> forward callable)."""
        rec = self.records.get(key)
        if rec is None:
            with torch.no_grad():
                times = {c: self.timer(run, self.reps) for c, run in runs.items()}
            rec = TuneRecord(choice=min(times, key=times.__getitem__), times_ms=times)
            self.records[key] = rec
        return rec.choice
