"""Captured inference (detector.nn.graphs): on the CPU the bookkeeping (eager, no capture); on a GPU (-m gpu) a
graph's replay equals the eager forward, per bucket, for the sparse path and the dense baseline."""

from __future__ import annotations

import pytest
import torch

from detector.nn import capacity as cp
from detector.nn.graphs import CapturedBackbone, DenseRunner
from detector.nn.resnet import SparseResNet


def _net(device="cpu", dtype=torch.float32):
    torch.manual_seed(0)
    net = SparseResNet(4, stem_channels=8, stage_units=(2, 2), stage_channels=(16, 24), stage_strides=(2, 2),
                       block_size=4)
    return net.eval().to(device=device, dtype=dtype)


def _inputs(device="cpu", dtype=torch.float32, seed=0, p=0.985, shape=(2, 4, 37, 29)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    mask = (torch.rand(shape[0], 1, *shape[2:], generator=g) > p).float()
    return x.to(device, dtype), mask.to(device, dtype)


def test_captured_backbone_equals_exact_on_cpu():
    net = _net()
    run = CapturedBackbone(net)
    for seed in (0, 1):
        x, mask = _inputs(seed=seed)
        with torch.no_grad():
            want = net(x, mask)
        got = run(x, mask)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert 1 <= len(run.graphs) <= 2  # one entry per (shape, modes, buckets)
    dense = DenseRunner(net, mode="eager")
    x, _ = _inputs()
    with torch.no_grad():
        want = net(x)
    for a, b in zip(dense(x), want, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replay_equals_eager(dtype):
    dev = torch.device("cuda")
    net = _net(dev, dtype)
    run = CapturedBackbone(net)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=2e-3, atol=2e-3)  # tf32 dots
    for seed in (0, 1, 2):  # the second batch of a bucket replays the graph captured by the first
        x, mask = _inputs(dev, dtype, seed)
        with torch.no_grad():
            modes, caps = cp.plan_capacities(net, x, mask)
            eager, _, _ = cp.forward_capacity(net, x, mask, modes, caps)
            eager = [t.clone() for t in eager]
            exact = net(x, mask, modes=modes)
        got = [t.clone() for t in run(x, mask, modes, caps)]
        for a, b, c in zip(got, eager, exact, strict=True):
            torch.testing.assert_close(a, b, **tol)
            torch.testing.assert_close(a, c, **tol)
    # a graph captured for too small a bucket: the overflow flag is read and the batch reruns (no block lost)
    x, mask = _inputs(dev, dtype, 3, p=0.9)
    with torch.no_grad():
        modes, caps = cp.plan_capacities(net, x, mask)
        exact = net(x, mask, modes=modes)
    got = run(x, mask, modes, [(1, 1) for _ in caps])
    for a, c in zip(got, exact, strict=True):
        torch.testing.assert_close(a, c, **tol)
    dense = DenseRunner(net, mode="graph")
    with torch.no_grad():
        want = net(x)
    for a, b in zip(dense(x), want, strict=True):
        torch.testing.assert_close(a, b, **tol)

