"""What the sparse path derives once per mask or per layer and then reuses (the binary mask, its strided copies,
a batch norm folded into its convolution): the values of the library's own ops, and never a stale one after the
tensor it was made from changed."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from detector.nn.geometry import binary_mask, mask_at_stride, pool_max
from detector.nn.norm import fold


@pytest.mark.parametrize("ceil_mode", [True, False])
@pytest.mark.parametrize("r", [2, 3, 4])
@pytest.mark.parametrize("hw", [(16, 12), (17, 13), (5, 7)])
@pytest.mark.parametrize("channels_last", [False, True])
def test_pool_max_is_max_pool2d(ceil_mode, r, hw, channels_last):
    g = torch.Generator().manual_seed(hash((ceil_mode, r, hw, channels_last)) % 2**31)
    x = torch.randn(2, 5, *hw, generator=g) - 0.5  # negative values too: the padding must never win
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    if not ceil_mode and min(hw) < r:
        pytest.skip("no whole window")
    want = F.max_pool2d(x, r, r, ceil_mode=ceil_mode)
    got = pool_max(x, r, ceil_mode=ceil_mode)
    assert got.shape == want.shape
    assert torch.equal(got, want)


def test_pool_max_of_a_one_channel_mask_and_identity():
    m = (torch.rand(1, 1, 33, 31) > 0.9).float()
    assert torch.equal(pool_max(m, 2), F.max_pool2d(m, 2, 2, ceil_mode=True))
    assert pool_max(m, 1) is m


def test_binary_mask_made_once_and_passed_through():
    m = torch.tensor([[[[0.2, 0.7], [0.5, 0.9]]]])
    b = binary_mask(m, 0.5)
    assert b.tolist() == [[[[0.0, 1.0], [0.0, 1.0]]]]  # 1 where it exceeds tol (0.5 itself is not)
    assert binary_mask(m, 0.5) is b  # the same mask: made once
    assert binary_mask(b, 0.5) is b and binary_mask(b, 0.3) is b  # already binary: as it is
    assert binary_mask(m, 0.3) is not b and binary_mask(m, 0.3).tolist() == [[[[0.0, 1.0], [1.0, 1.0]]]]


def test_derived_masks_follow_an_in_place_change():
    m = torch.zeros(1, 1, 8, 8)
    m[0, 0, 1, 1] = 1.0
    b, s = binary_mask(m, 0.5), mask_at_stride(m, 4)
    assert mask_at_stride(m, 4) is s and s.sum() == 1
    m[0, 0, 6, 6] = 1.0  # the caller changes its mask: nothing derived before may be reused
    assert mask_at_stride(m, 4).tolist() == [[[[1.0, 0.0], [0.0, 1.0]]]]
    assert binary_mask(m, 0.5).sum() == 2
    assert b.sum() == 1  # what was handed out before is not touched
    b2 = binary_mask(m, 0.5)
    b2[0, 0, 0, 0] = 1.0  # a binary mask changed in place is no longer known to be binary-as-derived
    b2[0, 0, 0, 1] = 0.7
    assert binary_mask(b2, 0.5)[0, 0, 0, 1] == 1.0 and binary_mask(b2, 0.5) is not b2


def test_nothing_remembered_for_a_mask_with_a_gradient():
    m = torch.rand(1, 1, 4, 4, requires_grad=True)
    assert binary_mask(m, 0.5) is not binary_mask(m, 0.5)
    assert mask_at_stride(m, 2) is not mask_at_stride(m, 2)


def _layer():
    torch.manual_seed(0)
    conv, bn = nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4)
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        bn.weight.uniform_(0.5, 2)
        bn.bias.uniform_(-1, 1)
    return conv, bn.eval()


def test_fold_is_the_layer_and_follows_its_changes():
    conv, bn = _layer()
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        w, b = fold(conv.weight, bn)
        torch.testing.assert_close(F.conv2d(x, w, b), bn(conv(x)), rtol=1e-5, atol=1e-5)
        assert fold(conv.weight, bn)[0] is w  # inference: folded once
        conv.weight.mul_(2)  # an optimizer step, a loaded checkpoint: in place
        w2, b2 = fold(conv.weight, bn)
        torch.testing.assert_close(F.conv2d(x, w2, b2), bn(conv(x)), rtol=1e-5, atol=1e-5)
        bn.running_var.mul_(3)
        w3, b3 = fold(conv.weight, bn)
        torch.testing.assert_close(F.conv2d(x, w3, b3), bn(conv(x)), rtol=1e-5, atol=1e-5)


def test_fold_with_autograd_is_differentiable_and_fresh():
    conv, bn = _layer()
    w, b = fold(conv.weight, bn)
    assert w.requires_grad and fold(conv.weight, bn)[0] is not w
    w.sum().backward()
    assert conv.weight.grad is not None and bn.weight.grad is not None


def test_a_derived_mask_changed_in_place_is_made_anew():
    m = torch.zeros(1, 1, 4, 4)
    m[0, 0, 0, 0] = 1.0
    s = mask_at_stride(m, 2)
    s.zero_()  # a caller writes into what it was handed
    assert mask_at_stride(m, 2).sum() == 1


def test_under_inference_mode_as_lightning_validates():
    """Tensors made under ``torch.inference_mode`` (Lightning's validation and prediction) track no version counter:
    nothing is remembered for them, and the values are the same."""
    conv, bn = _layer()
    x = torch.randn(1, 3, 6, 6)
    with torch.inference_mode():
        m = torch.zeros(1, 1, 8, 8)
        m[0, 0, 5, 2] = 0.9
        b = binary_mask(m, 0.5)
        assert b.sum() == 1 and mask_at_stride(b, 4).tolist() == [[[[0.0, 0.0], [1.0, 0.0]]]]
        m[0, 0, 0, 0] = 1.0  # in place, unseen by any version counter: made anew, so seen
        assert binary_mask(m, 0.5).sum() == 2 and mask_at_stride(m, 8).item() == 1.0
        w, t = fold(conv.weight, bn)
        torch.testing.assert_close(F.conv2d(x, w, t), bn(conv(x)), rtol=1e-5, atol=1e-5)
