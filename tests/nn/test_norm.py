"""region_batch_norm: batch norm of gathered blocks with the moments of their tile regions' in-map pixels.

The rule (detector/nn/norm.py): the mean and biased variance are taken over the tile-region pixels that lie in
the map, each counted once; the normalization ``(z - mean) / sqrt(var + eps) * weight + bias`` is applied to
every pixel of every block, halo included. The expectations below are built from that rule by hand (the region
pixels picked out by explicit loops), and the gradient is checked against finite differences of the forward.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from detector.nn.geometry import Level, LevelMasks
from detector.nn.norm import region_batch_norm

K, C, E = 3, 2, 5  # blocks, channels, block side
OFFSET, REGION = (1, 1), (3, 3)
LEVEL = Level(extent=(E, E), offset=OFFSET, region=REGION, map_size=(99, 99))


def _region_pixels(in_map: set[tuple[int, int, int]] | None) -> list[tuple[int, int, int]]:
    """(block, row, column) of the region pixels counted by the rule, in (block, row, column) order."""
    out = []
    for k in range(K):
        for r in range(REGION[0]):
            for c in range(REGION[1]):
                if in_map is None or (k, r, c) in in_map:
                    out.append((k, r, c))
    return out


def _masks(in_map: set[tuple[int, int, int]] | None) -> LevelMasks:
    pixels = _region_pixels(in_map)
    if in_map is None:
        return LevelMasks(outside=None, region=None, count=len(pixels))
    index = torch.tensor([k * REGION[0] * REGION[1] + r * REGION[1] + c for k, r, c in pixels])
    return LevelMasks(outside=None, region=index, count=len(pixels))


# block 2's region hangs over the map's right edge: its last region column is not in the map
IN_MAP_PARTIAL = {(k, r, c) for k in range(K) for r in range(3) for c in range(3) if not (k == 2 and c == 2)}


def _expected(z: torch.Tensor, weight, bias, eps: float, in_map) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    vals = torch.stack([z[k, :, OFFSET[0] + r, OFFSET[1] + c] for k, r, c in _region_pixels(in_map)])  # [n, C]
    mean = vals.mean(0)
    var = ((vals - mean) ** 2).mean(0)
    y = (z - mean.view(1, C, 1, 1)) / torch.sqrt(var.view(1, C, 1, 1) + eps)
    if weight is not None:
        y = y * weight.view(1, C, 1, 1) + bias.view(1, C, 1, 1)
    return y, mean, var


def _bn(affine: bool) -> nn.BatchNorm2d:
    bn = nn.BatchNorm2d(C, affine=affine, eps=1e-3).double()
    if affine:
        with torch.no_grad():
            bn.weight.copy_(torch.tensor([0.7, 1.9]))
            bn.bias.copy_(torch.tensor([-0.3, 0.4]))
    return bn


@pytest.mark.parametrize("in_map", [None, IN_MAP_PARTIAL], ids=["all-in-map", "partly-outside"])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_region_batch_norm_follows_the_rule(in_map, affine, channels_last):
    torch.manual_seed(0)
    z = torch.randn(K, C, E, E, dtype=torch.float64) * 3 + 1
    if channels_last:
        z = z.contiguous(memory_format=torch.channels_last)
    before = z.clone()
    bn = _bn(affine)
    y, m = region_batch_norm(bn, z, LEVEL, _masks(in_map))
    y_exp, mean_exp, var_exp = _expected(z, bn.weight, bn.bias, bn.eps, in_map)
    torch.testing.assert_close(y, y_exp)
    torch.testing.assert_close(m.mean, mean_exp)
    torch.testing.assert_close(m.var, var_exp)
    assert m.count == len(_region_pixels(in_map))
    assert torch.equal(z, before)  # the input is left as it was
    assert not m.mean.requires_grad and not m.var.requires_grad  # the moments feed the running statistics only


@pytest.mark.parametrize("in_map", [None, IN_MAP_PARTIAL], ids=["all-in-map", "partly-outside"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_region_batch_norm_gradient_matches_finite_differences(in_map, channels_last):
    torch.manual_seed(1)
    z = torch.randn(K, C, E, E, dtype=torch.float64)
    if channels_last:
        z = z.contiguous(memory_format=torch.channels_last)
    z.requires_grad_()
    bn = _bn(True)
    masks = _masks(in_map)
    w = bn.weight.detach().clone().requires_grad_()
    b = bn.bias.detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda z_, w_, b_: _apply(bn, z_, w_, b_, masks), (z, w, b))


def _apply(bn: nn.BatchNorm2d, z, w, b, masks):
    """region_batch_norm with the weight and bias as plain differentiable inputs (for gradcheck)."""
    probe = nn.BatchNorm2d(C, eps=bn.eps).double()
    del probe.weight, probe.bias
    probe.weight, probe.bias = w, b
    return region_batch_norm(probe, z, LEVEL, masks)[0]


def test_region_batch_norm_gradient_equals_batch_norm_when_the_region_is_the_map():
    """One block whose tile region is the whole map, no halo: nn.BatchNorm2d's gradients exactly."""
    torch.manual_seed(2)
    z = torch.randn(2, C, 4, 4, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, C, 4, 4, dtype=torch.float64)
    bn = _bn(True)
    level = Level(extent=(4, 4), offset=(0, 0), region=(4, 4), map_size=(4, 4))
    y, _ = region_batch_norm(bn, z, level, LevelMasks(None, None, 2 * 16))
    grads = torch.autograd.grad(y, (z, bn.weight, bn.bias), g)
    ref = nn.BatchNorm2d(C, eps=bn.eps).double()
    ref.load_state_dict(bn.state_dict())
    y_ref = ref(z)
    grads_ref = torch.autograd.grad(y_ref, (z, ref.weight, ref.bias), g)
    torch.testing.assert_close(y, y_ref)
    for a, b in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("shape", [(41_617, 24), (23_001, 48), (8_000, 24), (9_800, 64)])
def test_channel_sums_are_the_column_sums(shape):
    """The per-channel sums BN takes (folded side by side for long, narrow matrices on the CPU; the last, partial
    fold summed on its own) equal the column sums, to float32 rounding of a 40k-term sum."""
    from detector.nn.norm import _channel_sums

    rows = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) + 3.0
    want = rows.double().sum(0)
    got = _channel_sums(rows)
    assert got.shape == (shape[1],) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-2)
    assert torch.equal(_channel_sums(rows), got)  # deterministic
