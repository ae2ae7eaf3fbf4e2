"""The sparse backbone on block lists of a bounded capacity (detector.nn.capacity): the exact path's values, no
data-dependent host call inside a stage, one graph under torch.compile(fullgraph=True), overflow rerun."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from detector.nn import capacity as cp
from detector.nn.resnet import SparseResNet

SYNCS = ("aten.nonzero", "aten.item", "aten._local_scalar_dense")


def _net(preact=False, bottleneck=True, seed=0):
    torch.manual_seed(seed)
    net = SparseResNet(4, stem_channels=8, stage_units=(2, 2), stage_channels=(16, 24), stage_strides=(2, 2),
                       block_size=4, preact=preact, bottleneck=bottleneck)
    for m in net.modules():  # non-trivial running statistics: the folding is checked
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.3, 0.3)
    return net.eval()


def _inputs(p=0.985, seed=0, n=2, h=37, w=29):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, h, w, generator=g), (torch.rand(n, 1, h, w, generator=g) > p).float()


@pytest.mark.parametrize("preact,bottleneck", [(False, True), (True, True), (False, False)])
@pytest.mark.parametrize("p", [0.985, 1.0, 0.0])  # some blocks, none (K = 0), all
def test_equals_exact_path(preact, bottleneck, p):
    net = _net(preact, bottleneck)
    x, mask = _inputs(p)
    with torch.no_grad():
        want = net(x, mask)
        modes, caps = cp.plan_capacities(net, x, mask)
        feats, overflow, _ = cp.forward_capacity(net, x, mask, modes, caps)
    assert not bool(overflow)
    for a, b in zip(feats, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_padded_capacity_equals_exact():
    """Every bucket above the count (more padding rows) gives the same output."""
    net = _net()
    x, mask = _inputs()
    with torch.no_grad():
        want = net(x, mask)
        modes, caps = cp.plan_capacities(net, x, mask)
        big = [(c[0] * 2, c[1] * 2 + 8) for c in caps]
        feats, overflow, _ = cp.forward_capacity(net, x, mask, modes, big)
    assert not bool(overflow)
    for a, b in zip(feats, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


class _Calls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def test_no_host_call_inside_the_stages():
    net = _net()
    x, mask = _inputs()
    with torch.no_grad():
        modes, caps = cp.plan_capacities(net, x, mask)  # the batch's one read
        with _Calls() as calls:
            cp.forward_capacity(net, x, mask, modes, caps)
        with _Calls() as exact:  # the check sees the exact path's syncs
            net(x, mask, modes=modes)
    assert calls.seen and not [f for f in calls.seen if f.startswith(SYNCS)]
    assert [f for f in exact.seen if f.startswith(SYNCS)]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiles_fullgraph(backend):
    net = _net()
    x, mask = _inputs()
    torch._dynamo.reset()
    with torch.no_grad():
        modes, caps = cp.plan_capacities(net, x, mask)
        want, _, _ = cp.forward_capacity(net, x, mask, modes, caps)
        f = torch.compile(lambda a, m: cp.forward_capacity(net, a, m, modes, caps), fullgraph=True, backend=backend)
        got, overflow, _ = f(x, mask)
    assert not bool(overflow)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def test_overflow_reruns_and_loses_no_block(caplog):
    net = _net()
    x, mask = _inputs(p=0.97)
    with torch.no_grad():
        want = net(x, mask)
        modes, caps = cp.plan_capacities(net, x, mask)
        assert all(c[0] > 2 for c in caps)
        small = [(2, 2) for _ in caps]  # fewer rows than active blocks at every stage
        _, overflow, _ = cp.forward_capacity(net, x, mask, modes, small)
        assert bool(overflow)
        with caplog.at_level(logging.WARNING, logger="detector.nn.capacity"):
            got = cp.run_checked(net, x, mask, modes, small)
    assert "capacity overflow" in caplog.text
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_training_mode_is_refused():
    net = _net().train()
    x, mask = _inputs()
    with pytest.raises(ValueError, match="inference"):
        cp.forward_capacity(net, x, mask, [4, 4, 4], [(8, 0), (8, 8), (8, 8)])


@pytest.mark.parametrize("preact", [False, True])
def test_triton_kernels_in_the_backbone(preact, monkeypatch):
    """The whole backbone with the fused Triton kernels (interpreted on the CPU): the exact path's values."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    net = _net(preact)
    x, mask = _inputs(n=1, h=21, w=19)
    with torch.no_grad():
        want = net(x, mask)
        modes, caps = cp.plan_capacities(net, x, mask)
        monkeypatch.setenv("DETECTOR_FUSED", "triton")
        feats, overflow, _ = cp.forward_capacity(net, x, mask, modes, caps)
    assert not bool(overflow)
    for a, b in zip(feats, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
