"""``data.batch_size=auto``: the largest training batch that fits the device's memory.

CUDA: real training steps at growing batch sizes until one runs out of memory, then a binary search
between the last fitting and the first failing size (the approach of Lightning's batch-size finder,
done here because our batches are not plain tensors). CPU: the process's peak resident memory is
measured for a step at batch 1 and batch 2 (Linux ``/proc``), and the per-frame cost extrapolated to
``fraction`` of the memory available; a CPU process that runs out of memory is killed, not warned.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from detector.data.datamodule import KittiDataModule
from detector.models.detector import BevDetector

log = logging.getLogger(__name__)


def _step(model: BevDetector, dm: KittiDataModule, device: torch.device) -> None:
    batch = next(iter(dm.train_dataloader())).to(device)
    model.train()
    out = model(batch)
    loss, _ = model.loss(out, batch)
    loss.backward()
    model.zero_grad(set_to_none=True)


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise OSError("MemAvailable not in /proc/meminfo")


def _peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise OSError("VmHWM not in /proc/self/status")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def find_batch_size(
    make_dm: Callable[[int], KittiDataModule],
    model: BevDetector,
    max_batch: int = 64,
    fraction: float = 0.6,
) -> int:
    """The batch size to train with; ``make_dm(b)`` builds the data module for batch size ``b``."""
    state = {k: v.clone() for k, v in model.state_dict().items()}  # BN statistics change in trial steps
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    try:
        if device.type == "cuda":
            best = _search_cuda(make_dm, model, device, max_batch)
        else:
            best = _estimate_cpu(make_dm, model, device, max_batch, fraction)
    finally:
        model.load_state_dict(state)
        model.to("cpu")
    n_train = len(make_dm(1).dataset("train"))
    return max(1, min(best, max_batch, n_train))


def _fits(make_dm, model, device, b: int) -> bool:
    try:
        dm = make_dm(b)
        dm.num_workers = 0
        _step(model, dm, device)
        return True
    except torch.cuda.OutOfMemoryError:
        return False
    finally:
        model.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()


def _search_cuda(make_dm, model, device, max_batch: int) -> int:
    lo, hi = 0, None
    b = 1
    while b <= max_batch:
        if _fits(make_dm, model, device, b):
            lo, b = b, b * 2
        else:
            hi = b
            break
    if hi is None:
        return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _fits(make_dm, model, device, mid):
            lo = mid
        else:
            hi = mid
    return max(lo, 1)


def _estimate_cpu(make_dm, model, device, max_batch: int, fraction: float) -> int:
    try:
        peaks = []
        for b in (1, 2):
            dm = make_dm(b)
            dm.num_workers = 0
            gc.collect()
            _reset_peak()
            _step(model, dm, device)
            peaks.append(_peak_rss())
        per_frame = max(peaks[1] - peaks[0], 1)
        budget = _mem_available() * fraction
    except OSError as e:
        log.warning("batch_size=auto: cannot measure memory on this system (%s); using 1", e)
        return 1
    b = int(budget // per_frame)
    log.info("batch_size=auto: %.0f MB per frame, %.0f MB budget -> %d", per_frame / 2**20, budget / 2**20, b)
    return max(1, min(b, max_batch))
