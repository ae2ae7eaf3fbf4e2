"""The sparse backbone on block lists (detector.nn.capacity): the masked dense network's values (every stage on whole
maps, each unit's mask applied), no data-dependent host call inside a stage on a GPU's lists, one graph under
torch.compile(fullgraph=True), overflow rerun."""

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


def _masked_dense(net, x, mask):
    """The reference: every stage dense (whole maps, each unit's mask applied to its output), no block list."""
    return net(x, mask, modes=["dense"] * len(net.stages))


def _inputs(p=0.985, seed=0, n=2, h=37, w=29):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, h, w, generator=g), (torch.rand(n, 1, h, w, generator=g) > p).float()


@pytest.mark.parametrize("preact,bottleneck", [(False, True), (True, True), (False, False)])
@pytest.mark.parametrize("p", [0.985, 1.0, 0.0])  # some blocks, none (K = 0), all
def test_equals_the_masked_dense_network(preact, bottleneck, p):
    net = _net(preact, bottleneck)
    x, mask = _inputs(p)
    with torch.no_grad():
        want = _masked_dense(net, x, mask)
        modes, caps = cp.plan_capacities(net, x, mask)
        feats, overflow, _ = cp.forward_capacity(net, x, mask, modes, caps)
    assert not bool(overflow)
    for a, b in zip(feats, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_padded_capacity_equals_the_masked_dense_network():
    """Every bucket above the count (more padding rows) gives the same output."""
    net = _net()
    x, mask = _inputs()
    with torch.no_grad():
        want = _masked_dense(net, x, mask)
        modes, caps = cp.plan_capacities(net, x, mask)
        big = [(c[0] * 2, c[1] * 2 + 8) for c in caps]
        feats, overflow, _ = cp.forward_capacity(net, x, mask, modes, big)
    assert not bool(overflow)
    for a, b in zip(feats, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_lists_hold_the_counts_off_cuda_and_buckets_on_it():
    """Off CUDA (nothing captured, nothing replayed) a list has exactly the stage's active blocks as rows - no
    padding row computed and thrown away; on CUDA the smallest bucket that holds them (captured graphs replay)."""
    from detector.nn.plan import list_rows, settle
    from detector.ops.capacity import capacity_buckets, uses_buckets

    assert not uses_buckets("cpu") and uses_buckets("cuda") and uses_buckets(torch.device("cuda", 1))
    net = _net()
    x, mask = _inputs(p=0.97)
    with torch.no_grad():
        modes, caps = cp.plan_capacities(net, x, mask)
        _, overflow, counts = cp.forward_capacity(net, x, mask, modes, caps)
    assert not bool(overflow)
    sparse = [(cap, cnt) for cap, cnt in zip(caps, counts, strict=True) if cap is not None]
    assert sparse and any(int(c[0]) not in capacity_buckets(10**6) for _, c in sparse)  # the case can fail
    for cap, cnt in sparse:
        assert cap[0] == max(int(cnt[0]), 1) and (len(cnt) == 1 or cap[1] == max(int(cnt[1]), 1))
    inputs = settle(net.plan_inputs(tuple(x.shape), mask, list(modes)))
    for inp, mode, cnt in zip(inputs, modes, counts, strict=True):
        if mode == "dense":
            continue
        k1 = int(cnt[0])
        total = x.shape[0] * inp.units[0].geometry(*inp.shape[1:], int(mode)).block.num_blocks
        want = next(b for b in capacity_buckets(total) if b >= k1)
        assert list_rows(inp, int(mode), k1, int(cnt[1]) if len(cnt) > 1 else 0, buckets=True)[0] == want


class _Calls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def test_no_host_call_inside_the_stages(cuda_lists):
    net = _net()
    x, mask = _inputs()
    with torch.no_grad():
        modes, caps = cp.plan_capacities(net, x, mask)  # the batch's one read
        with _Calls() as calls:
            cp.forward_capacity(net, x, mask, modes, caps)
    assert calls.seen and not [f for f in calls.seen if f.startswith(SYNCS)]


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
        want = _masked_dense(net, x, mask)
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


def _train_pair(preact=False, bottleneck=True, dtype=torch.float64):
    """Two copies of a network in training mode: one for the masked dense reference, one for the lists."""
    import copy

    a = _net(preact, bottleneck).to(dtype).train()
    return a, copy.deepcopy(a)


def _step(forward, x, seed=1):
    """Features of ``forward(x)``, and the gradients of a fixed random projection of them (x's first)."""
    x = x.clone().requires_grad_(True)
    feats = forward(x)
    g = torch.Generator().manual_seed(seed)
    loss = sum((f * torch.randn(f.shape, generator=g, dtype=f.dtype)).sum() for f in feats)
    if loss.requires_grad:  # no active block anywhere: the features do not depend on x
        loss.backward()
    return [f.detach() for f in feats], torch.zeros_like(x) if x.grad is None else x.grad


def _assert_same_training(exact, cap, got, want):
    for a, b in zip(got[0], want[0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(got[1], want[1], rtol=1e-9, atol=1e-9)
    for (name, pa), pb in zip(cap.named_parameters(), exact.parameters(), strict=True):
        ga = torch.zeros_like(pa) if pa.grad is None else pa.grad  # no active block: None on the lists
        gb = torch.zeros_like(pb) if pb.grad is None else pb.grad
        torch.testing.assert_close(ga, gb, rtol=1e-9, atol=1e-9, msg=name)
    for (name, ba), bb in zip(cap.named_buffers(), exact.buffers(), strict=True):
        torch.testing.assert_close(ba, bb, rtol=1e-9, atol=1e-9, msg=name)


@pytest.mark.parametrize("rows", ["counts", "padded"])  # the CPU's lists (every row active), a GPU's (padding rows)
@pytest.mark.parametrize("preact,bottleneck", [(False, True), (True, True), (False, False), (True, False)])
@pytest.mark.parametrize("p", [0.985, 1.0, 0.0])  # some blocks, none (K = 0), all
def test_training_equals_the_masked_dense_network(preact, bottleneck, p, rows):
    """Training mode (batch statistics of the active tiles): the features, every gradient and the running
    statistics equal the masked dense network's, on lists of the counts and on lists padded past them."""
    exact, cap = _train_pair(preact, bottleneck)
    x, mask = _inputs(p)
    x = x.double()
    want = _step(lambda a: _masked_dense(exact, a, mask), x)
    modes, caps = cp.plan_capacities(cap, x, mask)
    if rows == "padded":
        caps = [None if c is None else (c[0] + 5, c[1] + 3) for c in caps]
    got = _step(lambda a: cp.forward_capacity(cap, a, mask, modes, caps)[0], x)
    _assert_same_training(exact, cap, got, want)


def test_training_makes_no_host_call(cuda_lists):
    """Forward and backward of a training step on a GPU's lists: no data-dependent host call (the plan's read is
    before)."""
    _, net = _train_pair(dtype=torch.float32)
    x, mask = _inputs()
    modes, caps = cp.plan_capacities(net, x, mask)
    with _Calls() as calls:
        _step(lambda a: cp.forward_capacity(net, a, mask, modes, caps)[0], x)
    assert calls.seen and not [f for f in calls.seen if f.startswith(SYNCS)]


@pytest.mark.slow  # ~11 s; make test compiles the inference forward (test_compiles_fullgraph)
def test_training_compiles_fullgraph(cuda_lists):
    """The training forward is one graph (aot_eager: the backward traced too); same values and gradients."""
    exact, net = _train_pair(dtype=torch.float32)
    x, mask = _inputs()
    modes, caps = cp.plan_capacities(net, x, mask)
    want = _step(lambda a: _masked_dense(exact, a, mask), x)
    torch._dynamo.reset()
    f = torch.compile(lambda a, m: cp.forward_capacity(net, a, m, modes, caps)[0], fullgraph=True,
                      backend="aot_eager")
    got = _step(lambda a: f(a, mask), x)
    for a, b in zip(got[0], want[0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-4)


def test_list_batch_norm_counts_only_the_weighted_pixels():
    """By hand: 2 rows of 1 channel, 2x2 pixels; the weights count 3 pixels of row 0 and none of row 1 (a padding
    row holding NaN): mean and biased variance of those 3 values; y = (z - mean) / sqrt(var + eps) everywhere."""
    from detector.nn.norm import list_batch_norm

    bn = torch.nn.BatchNorm2d(1, eps=0.0, affine=False)
    z = torch.tensor([[[[1.0, 2.0], [3.0, 10.0]]], [[[float("nan")] * 2] * 2]])
    w = torch.tensor([[[[1, 1], [1, 0]]], [[[0, 0], [0, 0]]]], dtype=torch.bool)
    y, m = list_batch_norm(bn, z, w)
    assert float(m.count) == 3
    torch.testing.assert_close(m.mean, torch.tensor([2.0]))
    torch.testing.assert_close(m.var, torch.tensor([2.0 / 3.0]))
    torch.testing.assert_close(y[0, 0], (z[0, 0] - 2.0) / (2.0 / 3.0) ** 0.5)


def test_empty_list_leaves_running_statistics():
    """No active block in training: the running statistics and their batch counter stay as they were (no pixel, no
    statistics)."""
    _, net = _train_pair(dtype=torch.float32)
    x, mask = _inputs(p=1.0)
    before = {k: v.clone() for k, v in net.named_buffers() if "stages.1" in k or "stages.2" in k}
    modes, caps = cp.plan_capacities(net, x, mask)
    cp.forward_capacity(net, x, mask, modes, caps)
    after = dict(net.named_buffers())
    for k, v in before.items():
        torch.testing.assert_close(after[k], v, msg=k)


@pytest.mark.parametrize("preact", [False, True])
def test_triton_kernels_in_the_backbone(preact, monkeypatch):
    """The whole backbone with the fused Triton kernels (interpreted on the CPU): the masked dense network's values."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    net = _net(preact)
    x, mask = _inputs(n=1, h=21, w=19)
    with torch.no_grad():
        want = _masked_dense(net, x, mask)
        modes, caps = cp.plan_capacities(net, x, mask)
        monkeypatch.setenv("DETECTOR_FUSED", "triton")
        feats, overflow, _ = cp.forward_capacity(net, x, mask, modes, caps)
    assert not bool(overflow)
    for a, b in zip(feats, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # ~20 s each interpreted; make test checks the pieces: the fused backward against the composition
@pytest.mark.parametrize("preact", [False, True])  # (tests/ops/test_fused.py), training on the composition (above)
def test_triton_kernels_in_training(preact, monkeypatch):
    """A training step with the fused Triton kernels (interpreted on the CPU; their backward by the composition):
    the masked dense network's features, gradients and running statistics."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    exact, cap = _train_pair(preact)
    x, mask = _inputs(n=1, h=21, w=19, p=0.95)
    x = x.double()
    want = _step(lambda a: _masked_dense(exact, a, mask), x)
    modes, caps = cp.plan_capacities(cap, x, mask)
    padded = [None if c is None else (c[0] + 2, c[1] + 2) for c in caps]
    monkeypatch.setenv("DETECTOR_FUSED", "triton")
    got = _step(lambda a: cp.forward_capacity(cap, a, mask, modes, padded)[0], x)
    _assert_same_training(exact, cap, got, want)
