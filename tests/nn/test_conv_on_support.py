"""conv_on_support: a dense convolution of a map that is zero outside a mask, computed where the mask reaches.

The rule it must keep is the dense convolution's: ``F.conv2d(x, w, b, padding=k // 2)`` at every pixel, for any
``x`` that is zero outside ``support`` - the pixels the kernel reaches from the support get the convolution, the
rest only the bias. Hand-made supports: a block in a corner (the kernel's reach past the map's edge), two separated
blobs in different frames, one pixel, an empty support (all bias), the whole map; 1x1 and 3x3 kernels; NCHW and
channels-last maps; tiles that do and do not divide the map. Gradients are the dense convolution's too (float64).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from detector.nn.chain import conv_on_support

H, W = 23, 19


def _support(kind: str) -> torch.Tensor:
    m = torch.zeros(2, 1, H, W, dtype=torch.float64)
    if kind == "corner":
        m[0, :, :5, :4] = 1
    elif kind == "blobs":
        m[0, :, 8:12, 10:19] = 1
        m[1, :, 17:23, 2:5] = 1
    elif kind == "pixel":
        m[1, :, 11, 9] = 1
    elif kind == "all":
        m[:] = 1
    return m


@pytest.mark.parametrize("kind", ["corner", "blobs", "pixel", "empty", "all"])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("tile", [4, 7, 16])
def test_equals_the_dense_convolution(kind, k, layout, tile):
    g = torch.Generator().manual_seed(0)
    m = _support(kind)
    x = (torch.randn(2, 6, H, W, generator=g, dtype=torch.float64) * m).contiguous(memory_format=layout)
    w = torch.randn(5, 6, k, k, generator=g, dtype=torch.float64)
    b = torch.randn(5, generator=g, dtype=torch.float64)
    got = conv_on_support(x, w, b, m, tile)
    torch.testing.assert_close(got, F.conv2d(x, w, b, padding=k // 2), rtol=1e-12, atol=1e-12)
    if kind == "empty":  # nothing reached: the bias everywhere
        assert torch.equal(got, b.view(1, -1, 1, 1).expand_as(got))


def test_gradients_are_the_dense_convolutions():
    g = torch.Generator().manual_seed(1)
    m = _support("blobs")
    args = [torch.randn(2, 6, H, W, generator=g, dtype=torch.float64) * m,
            torch.randn(5, 6, 3, 3, generator=g, dtype=torch.float64), torch.randn(5, generator=g, dtype=torch.float64)]
    up = torch.randn(2, 5, H, W, generator=g, dtype=torch.float64)

    def grads(fn):
        leaves = [a.detach().clone().requires_grad_() for a in args]
        return torch.autograd.grad((fn(*leaves) * up).sum(), leaves)

    want = grads(lambda x, w, b: F.conv2d(x, w, b, padding=1))
    got = grads(lambda x, w, b: conv_on_support(x, w, b, m, 8))
    # x's gradient only where x can be nonzero (elsewhere x is zero by the contract, its gradient unused)
    torch.testing.assert_close(got[0] * m, want[0] * m, rtol=1e-12, atol=1e-12)
    for a, c in zip(got[1:], want[1:], strict=True):
        torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-12)


def test_an_even_kernel_is_refused():
    with pytest.raises(ValueError, match="odd size"):
        conv_on_support(torch.zeros(1, 2, 8, 8), torch.zeros(3, 2, 2, 2), torch.zeros(3), torch.ones(1, 1, 8, 8))
