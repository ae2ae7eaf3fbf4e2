"""The op tests' determinism guard (``deterministic``); their table of cases is tests/ops/cases.py."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch


def _run_deterministically(run: Callable[[], object], threads: Sequence[int | None] | None = None,
                           seed: int = 0) -> tuple[torch.Tensor, ...]:
    current = torch.get_num_threads()
    counts = (current, current, 1, max(2, current)) if threads is None else \
        tuple(current if n is None else n for n in threads)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    results = []
    try:
        for n in counts:
            torch.set_num_threads(n)
            torch.manual_seed(seed)
            out = run()
            results.append(tuple(out) if isinstance(out, (tuple, list)) else (out,))
    finally:
        torch.use_deterministic_algorithms(was)
        torch.set_num_threads(current)
    first = results[0]
    for i, again in enumerate(results[1:], 1):
        assert len(again) == len(first)
        for j, (a, b) in enumerate(zip(first, again, strict=True)):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), \
                f"output {j} of run {i} ({counts[i]} threads) differs from the first run's ({counts[0]} threads)"
    return first


@pytest.fixture
def deterministic() -> Callable[..., tuple[torch.Tensor, ...]]:
    """``deterministic(run, threads=None)``: calls ``run()`` - which runs the ops forward and backward and returns
    their outputs and gradients - once per CPU thread count of ``threads`` (None in it: the current count; by
    default the current count twice, then 1, then at least 2), each time from the same seed and under
    ``torch.use_deterministic_algorithms(True)``, and asserts every call's tensors bit-identical to the first
    call's. Returns the first call's tensors; the thread count and the flag are restored."""
    return _run_deterministically
