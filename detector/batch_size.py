"""``data.batch_size=auto``: the largest training batch that fits the device's memory, from the estimate.

The peak memory of a training step is predicted from shapes (:func:`detector.memory.estimate`, with the active
tiles of the mask the model computes on for the first training batch); the largest batch whose prediction fits
the budget - ``data.memory_budget_mb``, or ``fraction`` of the device's free memory (CUDA: ``mem_get_info``; CPU:
``MemAvailable``) - is confirmed with one real step, whose measured peak
(CUDA: ``max_memory_allocated``; CPU: the allocator's events) is logged next to the prediction. If the real step
needs more than the budget (or runs out of CUDA memory) the batch is scaled down by the measured excess and
confirmed again. A CPU process that runs out of memory is killed, not warned: hence the margin.
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


def probe_shares(model: BevDetector, make_dm: Callable[[int], KittiDataModule], frames: int = 4) -> list[float] | None:
    """The active-tile share per stage of the mask the model computes on in a training step, on the first training
    batch of ``frames`` frames (None: the dense model). The model decides it (:meth:`BevDetector.computation_mask`:
    a data-side mask, or the mask net's with its training schedule - at the first step the warm-up's union with the
    boxes); its weights and statistics are left as they were."""
    from detector.memory import stage_shares

    if not model.use_data_mask:
        return None
    frames = max(1, min(frames, len(make_dm(1).dataset("train"))))  # a batch the split holds (drop_last)
    batch = next(iter(make_dm(frames).train_dataloader()))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    was = model.training
    try:
        with torch.no_grad():
            mask, _ = model.train().computation_mask(batch, model.voxelize(batch), step=0)
    finally:
        model.load_state_dict(state)
        model.train(was)
    return None if mask is None else stage_shares(model, mask.float())


def find_batch_size(
    make_dm: Callable[[int], KittiDataModule],
    model: BevDetector,
    max_batch: int = 64,
    fraction: float = 0.6,
    budget_mb: float | None = None,
    trials: list[dict] | None = None,
) -> int:
    """The batch size to train with; ``make_dm(b)`` builds the data module for batch size ``b``. ``budget_mb``
    (``data.memory_budget_mb``): the budget itself, on any device; None: ``fraction`` of the free memory.
    ``trials``: if given, each confirmed batch is appended to it (batch, predicted and measured bytes, budget)."""
    from detector.memory import MB, estimate, largest_fitting

    state = {k: v.clone() for k, v in model.state_dict().items()}  # BN statistics change in the trial step
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n_train = len(make_dm(1).dataset("train"))
    if budget_mb is not None:
        budget, source = float(budget_mb) * MB, f"data.memory_budget_mb={float(budget_mb):g}"
    else:
        try:
            budget = fraction * (torch.cuda.mem_get_info()[0] if device.type == "cuda" else _mem_available())
        except OSError as e:
            log.warning("batch_size=auto: cannot read the free memory on this system (%s); using 1", e)
            return 1
        source = f"{fraction:.0%} of the free memory"
    shares = probe_shares(model, make_dm)
    model.to(device)
    try:
        b = max(1, min(largest_fitting(model, shares, budget, max_batch), n_train))
        for _ in range(4):
            predicted = estimate(model, b, shares, train=True).peak
            measured = _measured_step(make_dm, model, device, b)
            print(f"data.batch_size=auto: batch {b}: predicted {predicted / MB:.0f} MB, measured "
                  f"{'out of memory' if measured is None else f'{measured / MB:.0f} MB'} "
                  f"(budget {budget / MB:.0f} MB: {source})")
            if trials is not None:
                trials.append({"batch": b, "predicted": predicted, "measured": measured, "budget": budget,
                               "shares": shares})
            if measured is not None and measured <= budget or b == 1:
                break
            b = max(1, int(b * budget / measured) if measured is not None else b // 2)
    finally:
        model.load_state_dict(state)
        model.to("cpu")
    return b


def _measured_step(make_dm, model, device, b: int) -> int | None:
    """Peak bytes of one real training step at batch ``b`` (None: CUDA out of memory)."""
    from detector.memory import measure_peak, tensor_bytes

    dm = make_dm(b)
    dm.num_workers = 0
    gc.collect()
    # the optimizer's state (Adam: two tensors like each parameter) is held at every step: counted, not run
    params = tensor_bytes(model.parameters())
    base = 3 * params + tensor_bytes(model.buffers())
    try:
        return base + measure_peak(lambda: _step(model, dm, device), device)
    except torch.cuda.OutOfMemoryError:
        return None
    finally:
        model.zero_grad(set_to_none=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
