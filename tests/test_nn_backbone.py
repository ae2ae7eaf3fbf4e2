"""SparseResNet: dense twin equality, mask wiring across stages, block_size auto/dense, empty masks."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F

from detector.nn.autotune import DENSE, BlockSizeTuner
from detector.nn.resnet import SparseResNet

ATOL = 1e-9
N, CIN, H, W = 2, 4, 21, 18


def make_net(seed=0, **kw) -> SparseResNet:
    torch.manual_seed(seed)
    args = dict(
        stem_channels=6, stage_units=(1, 2), stage_channels=(8, 12), stage_strides=(2, 2), block_size=4
    )
    args.update(kw)
    net = SparseResNet(CIN, **args).double()
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    return net


def test_feature_shapes_and_attributes():
    net = make_net().eval()
    feats = net(torch.randn(N, CIN, H, W, dtype=torch.float64))
    assert [tuple(f.shape) for f in feats] == [(N, 8, 11, 9), (N, 12, 6, 5)]
    assert net.out_channels == (8, 12) and net.strides == (2, 4)


def test_pixor_defaults():
    net = SparseResNet(36)
    assert [len(s.units) for s in net.stages] == [1, 3, 6, 6, 3]
    assert net.out_channels == (96, 192, 256, 384) and net.strides == (2, 4, 8, 16)
    assert net.stages[1].units[0].convs[1].out_channels == 24  # bottleneck width channels / 4


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_all_ones_mask_equals_dense(train):
    net = make_net().train(train)
    twin = copy.deepcopy(net)
    x = torch.randn(N, CIN, H, W, dtype=torch.float64, requires_grad=True)
    xd = x.detach().clone().requires_grad_(True)
    fs = net(x, torch.ones(N, 1, H, W))
    fd = twin(xd)
    for a, b in zip(fs, fd, strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    loss_s = sum((f * torch.linspace(-1, 1, f.numel(), dtype=f.dtype).view_as(f)).sum() for f in fs)
    loss_d = sum((f * torch.linspace(-1, 1, f.numel(), dtype=f.dtype).view_as(f)).sum() for f in fd)
    loss_s.backward()
    loss_d.backward()
    torch.testing.assert_close(x.grad, xd.grad, atol=ATOL, rtol=0)
    for (n, p), pd in zip(net.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, pd.grad, atol=ATOL, rtol=0, msg=n)
    for (n, b), bd in zip(net.named_buffers(), twin.buffers(), strict=True):
        torch.testing.assert_close(b, bd, atol=ATOL, rtol=0, msg=n)


def test_mask_wiring_matches_unit_by_unit_composition():
    """Stem and stride-2 units see the mask at their input resolution; later units the max-pooled one."""
    net = make_net().eval()
    x = torch.randn(N, CIN, H, W, dtype=torch.float64)
    mask = (torch.rand(N, 1, H, W) > 0.93).double()
    feats = net(x, mask)
    stem, s1, s2 = net.stages
    # the net runs channels-last (it converts its input); the composition runs the same layout
    y = stem.units[0](x.contiguous(memory_format=torch.channels_last), mask=mask)
    y = s1.units[0](y, mask=mask)
    m1 = F.max_pool2d(mask, 2, 2, ceil_mode=True)
    torch.testing.assert_close(feats[0], y, atol=0, rtol=0)
    y = s2.units[0](y, mask=m1)
    m2 = F.max_pool2d(m1, 2, 2, ceil_mode=True)
    y = s2.units[1](y, mask=m2)
    torch.testing.assert_close(feats[1], y, atol=0, rtol=0)


def test_block_size_dense_stage_equals_dense():
    net = make_net(block_size=[DENSE, DENSE, DENSE]).eval()
    x = torch.randn(N, CIN, H, W, dtype=torch.float64)
    mask = (torch.rand(N, 1, H, W) > 0.9).double()
    for a, b in zip(net(x, mask), net(x), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


class FakeTimer:
    """Runs each candidate once (so it must work) and reports preset times, cycling over candidates."""

    def __init__(self, times):
        self.times = itertools.cycle(times)
        self.calls = 0

    def __call__(self, run, reps):
        run()
        self.calls += 1
        return next(self.times)


@pytest.mark.parametrize("times, expected", [((3.0, 1.0, 2.0, 5.0), 16), ((3.0, 2.0, 4.0, 1.0), DENSE)])
def test_auto_block_size_choice_cache_and_no_side_effects(times, expected):
    timer = FakeTimer(times)
    tuner = BlockSizeTuner(candidates=(8, 16, 32, DENSE), reps=1, timer=timer)
    net = make_net(block_size="auto", tuner=tuner).train()
    twin = copy.deepcopy(net)
    x = torch.randn(N, CIN, H, W, dtype=torch.float64)
    ones = torch.ones(N, 1, H, W)
    fs = net(x, ones)
    assert timer.calls == 3 * 4  # stem + 2 stages, 4 candidates each
    assert [r.choice for r in tuner.records.values()] == [expected] * 3
    for a, b in zip(fs, twin(x), strict=True):  # any choice equals dense on an all-ones mask
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    for (n, b), bd in zip(net.named_buffers(), twin.buffers(), strict=True):  # timing left BN alone
        torch.testing.assert_close(b, bd, atol=ATOL, rtol=0, msg=n)
    net(x, ones)
    assert timer.calls == 12  # cached per shape and density bucket
    net(x, (torch.rand(N, 1, H, W) > 0.5).double())  # another density bucket: tuned again
    assert timer.calls == 24


def test_real_timer_picks_a_candidate():
    tuner = BlockSizeTuner(candidates=(4, DENSE), reps=1)
    net = make_net(block_size="auto", tuner=tuner).eval()
    net(torch.randn(N, CIN, H, W, dtype=torch.float64), torch.ones(N, 1, H, W))
    assert len(tuner.records) == 3
    for rec in tuner.records.values():
        assert rec.choice in (4, DENSE) and set(rec.times_ms) == {4, DENSE}
        assert all(t > 0 for t in rec.times_ms.values())


def test_empty_mask_gives_zero_features():
    net = make_net().train()
    before = copy.deepcopy(net.state_dict())
    x = torch.randn(N, CIN, H, W, dtype=torch.float64, requires_grad=True)
    feats = net(x, torch.zeros(N, 1, H, W))
    assert all(torch.count_nonzero(f) == 0 for f in feats)
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_bad_inputs():
    net = make_net()
    x = torch.randn(N, CIN, H, W, dtype=torch.float64)
    with pytest.raises(ValueError, match="mask must be"):
        net(x, torch.ones(N, 1, H, W - 1))
    with pytest.raises(ValueError, match="block_size needs 3 entries"):
        make_net(block_size=[4, 4])
    with pytest.raises(ValueError, match="block_size entries"):
        make_net(block_size="big")
    with pytest.raises(ValueError, match="x must be a"):
        net(torch.randn(CIN, H, W))
