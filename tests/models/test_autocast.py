"""The detector under bfloat16 autocast (what ``trainer=gpu``'s ``bf16-mixed`` runs), on the CPU: on lists of
the active blocks and on a GPU's padded lists, it runs (the maps keep their dtype, the tiles come out of the
convolutions in bfloat16) and stays within bfloat16's precision of its float32 self - forward, and a training
step's loss and gradients, judged against what bfloat16 costs the ordinary dense network (torch's own convolutions
and batch norm under the same autocast)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import gpu_lists
from tests.models.test_capacity_path import _mask, _model
from tests.models.test_detector import _batch

# bfloat16 keeps 8 significant bits (a rounding error of up to 2^-9 relative per op); a dozen layers accumulate a
# few of them: the forward's maps within 2^-6 of their largest value
FORWARD_TOL = 2.0**-6


def _batch_with_mask():
    batch = _batch()
    batch.mask = _mask("patch")
    return batch


@pytest.mark.parametrize("path", ["counts", "buckets"])
def test_inference_under_bf16_autocast_stays_within_bf16_precision(path):
    batch = _batch_with_mask()
    model = _model(16, 16).eval()
    with torch.no_grad(), gpu_lists(path == "buckets"):
        want = model(batch)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = model(batch)
    for a, b in ((got.heatmap, want.heatmap), (got.regression, want.regression)):
        assert a.dtype == torch.bfloat16
        err = float((a.float() - b).abs().max())
        assert err <= FORWARD_TOL * float(b.abs().max()), err


def _step(path: str, autocast: bool, dense: bool = False) -> tuple[float, torch.Tensor]:
    """A training step's loss and every parameter's gradient, concatenated."""
    batch = _batch_with_mask()
    model = _model(16, 16).train()
    model.use_data_mask = not dense
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), gpu_lists(path == "buckets"):
        out = model(batch)
        loss, _ = model.loss(out, batch)
        loss.backward()
    return float(loss.detach()), torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])


def test_training_step_under_bf16_autocast_stays_within_what_bf16_costs_the_dense_network():
    """Loss within 1e-3 relative; the gradient's error (norm of the difference over the float32 gradient's norm) no
    more than 1.5 times the dense network's own under the same autocast, and pointing the same way (cosine > 0.9).
    bfloat16's per-parameter errors are large for the small, cancelling sums of batch-norm gradients - the dense
    network's reach 0.6 of their own size here - so the gradient is judged as a whole."""
    _, d32 = _step("counts", False, dense=True)
    _, d16 = _step("counts", True, dense=True)
    dense_err = float((d16 - d32).norm() / d32.norm())
    for path in ("counts", "buckets"):
        l32, g32 = _step(path, False)
        l16, g16 = _step(path, True)
        assert abs(l16 - l32) <= 1e-3 * abs(l32), (path, l16, l32)
        err = float((g16 - g32).norm() / g32.norm())
        assert err <= 1.5 * dense_err, (path, err, dense_err)
        assert float(torch.nn.functional.cosine_similarity(g16, g32, 0)) > 0.9, path
