"""SparseResNet: dense twin equality, mask wiring across stages, block_size auto (the plan)/dense, empty masks."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from detector.nn.cost import CostModel
from detector.nn.plan import DENSE, Planner
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


def test_block_size_dense_stages_compute_the_masked_function():
    """Stages run dense apply the same mask as stages run sparse: every mix of dense and tiles gives the same
    features (and not the unmasked network's)."""
    x = torch.randn(N, CIN, H, W, dtype=torch.float64)
    mask = (torch.rand(N, 1, H, W) > 0.9).double()
    want = make_net(block_size=4).eval()(x, mask)
    for sizes in ([DENSE, DENSE, DENSE], [DENSE, 4, DENSE], [8, DENSE, 2]):
        for a, b in zip(make_net(block_size=sizes).eval()(x, mask), want, strict=True):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=0, msg=str(sizes))
    unmasked = make_net(block_size=[DENSE, DENSE, DENSE]).eval()(x)
    assert not torch.allclose(unmasked[-1], want[-1])


def _cost(unit_s: float) -> CostModel:
    """Every per-element constant 1 ns, blocks as fast as maps; ``unit_s`` fixed seconds per sparse unit."""
    return CostModel(dense_mac=1e-9, block_mac=((4, 1e-9), (8, 1e-9)), move=1e-9, pass_=1e-9, dense_unit=0.0,
                     sparse_unit=unit_s, dense_unit_train=0.0, sparse_unit_train=unit_s)


@pytest.mark.parametrize("unit_s, sparse", [(0.0, True), (1.0, False)], ids=["free-units", "costly-units"])
def test_auto_block_size_follows_the_plan_and_leaves_no_trace(unit_s, sparse):
    """Without fixed costs a sparse tile beats dense on a sparse mask; at 1 s per sparse unit dense wins
    everywhere. Either way the output on active tiles is the dense twin's, and planning touches no BN."""
    planner = Planner(candidates=(4, 8), cost=_cost(unit_s))
    net = make_net(block_size="auto", planner=planner).train()
    twin = copy.deepcopy(net)
    x = torch.randn(N, CIN, H, W, dtype=torch.float64)
    mask = torch.zeros(N, 1, H, W, dtype=torch.float64)
    mask[:, :, 2:5, 3:6] = 1
    net.eval()(x, mask)
    choices = planner.last.choices
    assert len(choices) == 3
    # stage2's map is 6 x 5: one block with its halo (8 x 8 at tile 4) is larger than the whole map, dense is cheaper
    assert all(c in (4, 8) for c in choices[:2]) and choices[2] == DENSE if sparse else all(c == DENSE for c in choices)
    fs = net.train()(x, torch.ones(N, 1, H, W))
    for a, b in zip(fs, twin(x), strict=True):  # any choice equals dense on an all-ones mask
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    for (n, b), bd in zip(net.named_buffers(), twin.buffers(), strict=True):  # the same BN updates, no more
        torch.testing.assert_close(b, bd, atol=ATOL, rtol=0, msg=n)


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
