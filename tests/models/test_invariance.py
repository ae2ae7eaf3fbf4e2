"""The mask defines the detector's function: the same weights and mask give the same outputs whatever executes them -
every tile size, dense stages, ``auto``'s plan, lists of the active blocks or a GPU's padded ones, and the batch a
frame comes in - in
inference and in a training step (loss, gradients, running statistics). The tiles only decide the time.

Float64 so that the only differences are summation order (1e-9); the float32 case is checked at 1e-4."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.conftest import gpu_lists
from tests.models.test_capacity_path import _mask, _model
from tests.models.test_detector import _batch

# every way to execute the sparse network: a tile per stage (backbone, then neck and head), dense, or the plan
SETTINGS = [(4, 4), (8, 8), (16, 16), (32, 32), (8, 32), ("dense", "dense"), (16, "dense"), ("auto", "auto")]
PATHS = ["counts", "buckets"]  # a CPU's block lists (exactly the active blocks), a GPU's (a bucket's rows)


def _run(block, head_block, path, batch, dtype=torch.float64):
    model = _model(block, head_block).to(dtype)
    with torch.no_grad(), gpu_lists(path == "buckets"):
        bev = model.voxelize(batch).to(dtype)
        out = model(batch, bev=bev)
    return out.heatmap, out.regression


@pytest.mark.parametrize("kind", ["patch", "all", "none"])
def test_every_execution_gives_the_same_outputs(kind):
    batch = _batch()
    batch.mask = _mask(kind)
    want = _run(8, 8, "counts", batch)
    for block, head_block in SETTINGS:
        for path in PATHS:
            got = _run(block, head_block, path, batch)
            for a, b, name in zip(got, want, ("heatmap", "regression"), strict=True):
                torch.testing.assert_close(a, b, atol=1e-9, rtol=0, msg=f"{name}: {block}/{head_block} {path}")


def test_float32_agrees_to_1e4():
    batch = _batch()
    batch.mask = _mask("patch")
    want = _run(8, 8, "exact", batch, torch.float32)
    for block, head_block in SETTINGS:
        for path in PATHS:
            for a, b in zip(_run(block, head_block, path, batch, torch.float32), want, strict=True):
                torch.testing.assert_close(a, b, atol=1e-4, rtol=0, msg=f"{block}/{head_block} {path}")


def test_a_frame_gives_the_same_outputs_alone_and_in_a_batch():
    """Inference: a frame's outputs do not depend on the frames beside it (the plan may tile the batch differently)."""
    batch = _batch()
    batch.mask = _mask("patch")
    both = _run("auto", "auto", "exact", batch)
    single = _batch(n=1)
    single.mask = batch.mask[:1]
    for path in PATHS:
        for block in (8, 32, "auto"):
            alone = _run(block, block, path, single)
            for a, b in zip(alone, both, strict=True):
                torch.testing.assert_close(a[0], b[0], atol=1e-9, rtol=0, msg=f"{block} {path}")


@pytest.mark.parametrize("path", PATHS)
def test_a_training_step_is_the_same_whatever_the_tiles(path):
    """Training mode: loss, every gradient and the running statistics after one step do not depend on the tiles
    (batch statistics are the mask's pixels', whatever tiles hold them)."""
    batch = _batch()
    batch.mask = _mask("patch")
    results = []
    for block, head_block in [(8, 8), (32, 16), ("dense", "dense"), (16, "dense")]:
        model = _model(block, head_block).double().train()
        bev = model.voxelize(batch).double()
        with gpu_lists(path == "buckets"):
            out = model(batch, bev=bev)
            loss, _ = model.loss(out, batch)
            loss.backward()
        results.append((block, head_block, loss.detach(), copy.deepcopy({n: p.grad for n, p in
                                                                          model.named_parameters()}),
                        copy.deepcopy(dict(model.named_buffers()))))
    _, _, loss0, grads0, bufs0 = results[0]
    for block, head_block, loss, grads, bufs in results[1:]:
        where = f"{block}/{head_block} {path}"
        torch.testing.assert_close(loss, loss0, atol=1e-9, rtol=0, msg=f"loss {where}")
        for name, g in grads.items():
            g0 = grads0[name]
            if g is None or g0 is None:
                assert g is None and g0 is None, f"{name} {where}"
                continue
            torch.testing.assert_close(g, g0, atol=1e-9, rtol=0, msg=f"{name} {where}")
        for name, b in bufs.items():
            torch.testing.assert_close(b, bufs0[name], atol=1e-9, rtol=0, msg=f"{name} {where}")
