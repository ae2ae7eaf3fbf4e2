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



def test_cache_captures_a_key_at_its_after_th_use():
    """GraphCache(after=2): a key's first use runs the call as it is, its second captures it, later ones replay the
    capture; keys are counted apart; clear() forgets the counts too."""
    from detector.nn.graphs import GraphCache

    captured = []

    def capturer(fn, *inputs):  # noqa: ANN001, ANN202
        captured.append(inputs)
        return lambda *a: ("graph", fn(*a))

    cache = GraphCache(capturer=capturer, after=2)
    fn = lambda a: a + 1  # noqa: E731
    one = torch.ones(1)
    assert cache.get("a", fn, one) is fn and not captured and len(cache) == 0
    assert cache.get("b", fn, one) is fn
    assert cache.get("a", fn, one)(one)[0] == "graph" and len(captured) == 1 and len(cache) == 1
    assert cache.get("a", fn, one)(one)[0] == "graph" and len(captured) == 1  # replayed, not captured again
    cache.clear()
    assert cache.get("b", fn, one) is fn  # its earlier use was forgotten


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_training_step_equals_eager():
    """model.capture_train on the GPU: the steps on one (shape, plan, buckets) - eager, captured at its second use,
    then replayed - give the eager twin's loss, gradients, running statistics and (after SGD) weights."""
    import copy

    from tests.models.test_capacity_path import _mask, _model
    from tests.models.test_detector import _batch

    dev = torch.device("cuda")
    eager = _model(8, 16).to(dev).train()
    graphed = copy.deepcopy(eager)
    graphed.capture_train = True
    opts = [torch.optim.SGD(m.parameters(), lr=1e-2) for m in (eager, graphed)]
    batch = _batch(2).to(dev)
    batch.mask = _mask("patch").to(dev)
    tol = dict(rtol=2e-3, atol=2e-3)  # tf32 dots
    for _ in range(4):
        losses = []
        for m, opt in zip((eager, graphed), opts, strict=True):
            opt.zero_grad(set_to_none=True)
            loss, _ = m.loss(m(batch), batch)
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], **tol)
        for (name, a), b in zip(graphed.named_parameters(), eager.parameters(), strict=True):
            if b.grad is not None:
                torch.testing.assert_close(a.grad, b.grad, **tol, msg=name)
        for opt in opts:
            opt.step()
        for (name, a), b in zip(graphed.named_buffers(), eager.buffers(), strict=True):
            torch.testing.assert_close(a, b, **tol, msg=name)
    assert len(graphed.train_graphs) == 1


def _counting_capturer(captured: list):  # noqa: ANN202
    def capturer(fn, *inputs):  # noqa: ANN001, ANN202
        captured.append(inputs)
        n = len(captured)  # the capture's number, which its replays return
        return lambda *a: ("graph", n, fn(*a))

    return capturer


def test_cache_drops_the_least_recently_used_graph():
    """max_graphs: a capture beyond it drops the graph used longest ago (a replay counts as a use, a first use below
    ``after`` does not); a dropped key is counted from zero again and captured anew at its ``after``-th use."""
    from detector.nn.graphs import GraphCache

    captured: list = []
    cache = GraphCache(max_graphs=2, capturer=_counting_capturer(captured), after=2)
    fn = lambda a: a  # noqa: E731
    one = torch.ones(1)
    for key in ("a", "a", "b", "b"):
        cache.get(key, fn, one)
    assert list(cache.graphs) == ["a", "b"] and len(captured) == 2
    assert cache.get("a", fn, one)(one)[1] == 1  # replayed: "a" is now the most recent
    assert cache.get("c", fn, one) is fn and len(cache) == 2  # a first use captures nothing, drops nothing
    assert cache.get("c", fn, one)(one)[1] == 3
    assert list(cache.graphs) == ["a", "c"]  # "b", the least recently used, dropped
    assert cache.get("b", fn, one) is fn  # counted from zero: its earlier uses were forgotten with its graph
    assert cache.get("b", fn, one)(one)[1] == 4 and list(cache.graphs) == ["c", "b"]
    assert cache.uses == {}  # a captured key's count is not kept


def test_cache_copies_start_empty_with_the_same_settings():
    """A deep copy or an unpickled copy of a cache (of a model that holds one) has no graphs and no counts (they
    belong to the tensors they were captured on) but the original's size, capturer and threshold."""
    import copy
    import pickle

    from detector.nn.capture import capture_training
    from detector.nn.graphs import GraphCache

    cache = GraphCache(max_graphs=3, capturer=capture_training, after=2)
    cache.get("a", lambda a: a, torch.ones(1))
    assert cache.uses == {"a": 1}
    for twin in (copy.deepcopy(cache), pickle.loads(pickle.dumps(cache))):
        assert len(twin) == 0 and twin.uses == {}
        assert (twin.max_graphs, twin.capturer, twin.after) == (3, capture_training, 2)


def test_detector_keeps_no_graph_off_cuda():
    """Off CUDA the detector runs its network eagerly (nothing to capture or replay): no entry is kept, whatever the
    batches; ``.to()`` empties both caches."""
    from tests.models.test_capacity_path import _mask, _model
    from tests.models.test_detector import _batch

    model = _model(8, 16)
    batch = _batch(2)
    batch.mask = _mask("patch")
    with torch.no_grad():
        for _ in range(3):
            model(batch)
    assert len(model.graphs) == 0 and model.graphs.uses == {}
    model.train()
    model.capture_train = True
    model.train_graphs.get(("k",), lambda a: a, torch.zeros(1))  # (what a CUDA step would hold)
    model.to(torch.float64)
    assert len(model.graphs) == 0 and len(model.train_graphs) == 0 and model.train_graphs.uses == {}
