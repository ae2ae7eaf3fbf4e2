"""The neck's top-down sum: ``lat`` plus the coarser level upsampled (nearest), without making the upsampled map."""

import pytest
import torch
import torch.nn.functional as F

from detector.models.detector import add_upsampled


@pytest.mark.parametrize("layout", ["nchw", "channels_last", "mixed"])
@pytest.mark.parametrize("sizes", [((8, 6), (4, 3)), ((9, 6), (5, 3)), ((8, 6), (8, 6))])
def test_add_upsampled_is_interpolate_and_add(layout, sizes):
    (H, W), (h, w) = sizes
    g = torch.Generator().manual_seed(H * W + h)
    lat = torch.randn(2, 5, H, W, generator=g, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 5, h, w, generator=g, dtype=torch.float64, requires_grad=True)
    a, b = lat, x
    if layout != "nchw":
        a = lat.contiguous(memory_format=torch.channels_last)
    if layout == "channels_last":
        b = x.contiguous(memory_format=torch.channels_last)
    want = lat + F.interpolate(x, size=(H, W), mode="nearest")
    got = add_upsampled(a, b)
    assert torch.equal(got, want)
    if layout == "channels_last" and H == 2 * h:
        assert got.is_contiguous(memory_format=torch.channels_last)
    up = torch.randn(2, 5, H, W, generator=g, dtype=torch.float64)
    for t, tw in zip(torch.autograd.grad(got, (lat, x), up), torch.autograd.grad(want, (lat, x), up), strict=True):
        torch.testing.assert_close(t, tw, rtol=0, atol=1e-12)
