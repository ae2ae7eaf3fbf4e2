"""The whole detector on block lists (BevDetector.capacity_forward): in inference and in a training step the masked
dense network's outputs (and gradients, running statistics), no data-dependent host call inside the network on a
GPU's lists, the plan it runs, overflow rerun (inference) or error (training)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from detector.models.detector import BevDetector, masks_at_strides
from detector.models.targets import BoxCoder
from detector.nn import capacity
from detector.nn.cost import CostModel
from detector.nn.plan import DENSE, Planner
from detector.nn.resnet import SparseResNet
from tests.models.test_detector import GRID, _batch
from tests.nn.test_capacity import SYNCS, _Calls

# a hand-set cost model (no calibration in the tests): sparse cheap per block, so 'auto' picks tiles on sparse masks
COST = CostModel(dense_mac=1e-9, block_mac=((8, 5e-10), (16, 5e-10), (32, 5e-10)), move=1e-10, pass_=1e-10,
                 dense_unit=1e-5, sparse_unit=2e-5, dense_unit_train=1e-5, sparse_unit_train=2e-5,
                 fused_mac=((8, 4e-10), (16, 4e-10), (32, 4e-10)), capacity_unit=3e-5, dense_unit_graph=1e-6)


def _model(block=8, head_block=16, preact=False) -> BevDetector:
    torch.manual_seed(0)
    backbone = SparseResNet(GRID.C, stem_channels=8, stage_units=(1, 2, 1), stage_channels=(8, 12, 16),
                            stage_strides=(2, 2, 2), bottleneck=False, block_size=block, preact=preact,
                            planner=Planner(cost=COST))
    model = BevDetector(GRID, backbone=backbone, coder=BoxCoder(["Car"]), neck_channels=8, head_channels=8,
                        out_stride=4, head_block_size=head_block, mask_dilation_m=2.0, sparse=True)
    for m in model.modules():  # running statistics away from (0, 1): the batch norm folding is exercised
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.3, 0.3)
            m.running_var.uniform_(0.5, 2.0)
            m.bias.data.uniform_(-0.2, 0.2)
    return model.eval()


def _dense_twin(model: BevDetector) -> BevDetector:
    """The same weights with every stage dense: whole maps, each unit's mask applied to its output (the reference:
    dense convolutions of the masked maps, no block list anywhere)."""
    twin = copy.deepcopy(model)
    twin.backbone.block_sizes = [DENSE] * len(twin.backbone.block_sizes)
    twin.head_block_size = DENSE
    return twin


def _mask(kind: str, n: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    if kind == "none":
        return torch.zeros(n, 1, GRID.H, GRID.W)
    if kind == "all":
        return torch.ones(n, 1, GRID.H, GRID.W)
    m = torch.zeros(n, 1, GRID.H, GRID.W)
    m[..., 16:60, 30:90] = 1.0  # a road-like patch
    m[0, 0, 100:104, 5:9] = 1.0  # and a speck in the first frame only
    return torch.maximum(m, (torch.rand(n, 1, GRID.H, GRID.W, generator=g) > 0.9995).float())


def _both(model: BevDetector, batch) -> tuple:
    """(the dense twin's, the model's) outputs."""
    with torch.no_grad():
        return _dense_twin(model)(batch), model(batch)


@pytest.mark.parametrize("block,head_block", [(8, 16), (16, 8), (["dense", 8, 16, 8], "dense"), ("auto", "auto")])
@pytest.mark.parametrize("kind", ["patch", "none", "all"])
def test_equals_the_masked_dense_network(block, head_block, kind):
    model = _model(block, head_block)
    batch = _batch(2)
    batch.mask = _mask(kind)
    want, got = _both(model, batch)
    torch.testing.assert_close(got.heatmap, want.heatmap, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.regression, want.regression, rtol=1e-4, atol=1e-4)


def test_equals_the_masked_dense_network_preactivation():
    model = _model(8, 8, preact=True)
    batch = _batch(1)
    batch.mask = _mask("patch", 1)
    want, got = _both(model, batch)
    torch.testing.assert_close(got.heatmap, want.heatmap, rtol=1e-4, atol=1e-4)


def test_no_host_call_inside_the_network(cuda_lists):
    """Backbone, neck and head on a GPU's lists (buckets): no nonzero / item / _local_scalar_dense once the plan is
    read."""
    model = _model("auto", "auto")
    batch = _batch(2)
    batch.mask = _mask("patch")
    with torch.no_grad():
        bev = model.voxelize(batch)
        lm = masks_at_strides(batch.mask, model.neck.strides)
        modes, caps, plan = model.capacity_plan(tuple(bev.shape), batch.mask, lm)  # the batch's one read
        assert plan is not None and any(m != "dense" for m in modes)
        with _Calls() as calls:
            model.capacity_maps(bev, batch.mask, lm, modes, caps)
    assert calls.seen and not [f for f in calls.seen if f.startswith(SYNCS)]


def test_the_forward_runs_the_plan_of_its_one_read():
    model = _model("auto", "auto")
    batch = _batch(2)
    batch.mask = _mask("patch")
    with torch.no_grad():
        out = model(batch)
    assert out.plan is not None
    with torch.no_grad():
        bev = model.voxelize(batch)
        lm = masks_at_strides(batch.mask, model.neck.strides)
        _, _, plan = model.capacity_plan(tuple(bev.shape), batch.mask, lm)
    assert out.plan.choices == plan.choices and any(c != DENSE for c in plan.choices)


def test_overflow_reruns_and_loses_no_block(monkeypatch, caplog):
    model = _model(8, 8)
    batch = _batch(2)
    batch.mask = _mask("patch")
    with torch.no_grad():
        want = _dense_twin(model)(batch)
    real = capacity.capacities
    calls = []

    def short(inputs, modes, smallest=8, buckets=True):  # the first plan's lists too short: every stage overflows
        caps = real(inputs, modes, smallest, buckets)
        calls.append(caps)
        return [None if c is None else (1, 1 if c[1] else 0) for c in caps] if len(calls) == 1 else caps

    monkeypatch.setattr(capacity, "capacities", short)
    with caplog.at_level(logging.WARNING, logger="detector.nn.capacity"), torch.no_grad():
        got = model(batch)
    assert "capacity overflow" in caplog.text and len(calls) == 2
    torch.testing.assert_close(got.heatmap, want.heatmap, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.regression, want.regression, rtol=1e-4, atol=1e-4)


def _train_step(model: BevDetector, batch, bev: torch.Tensor | None = None):
    """Loss and gradients of one training step (the model in training mode)."""
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(batch, bev=bev)
    loss, _ = model.loss(out, batch)
    loss.backward()
    return out, loss.detach()


@pytest.mark.parametrize("block,head_block", [(8, 16), (16, 8), (["dense", 8, 16, 8], "dense")])
@pytest.mark.parametrize("kind", ["patch", "none"])
def test_training_step_equals_the_masked_dense_network(block, head_block, kind):
    """A training step on block lists (batch norm with the lists' batch moments): the dense twin's outputs, loss,
    gradients of every parameter and running statistics."""
    cap_model = _model(block, head_block).double()
    exact_model = _dense_twin(cap_model)
    batch = _batch(2)
    batch.mask = _mask(kind)
    bev = exact_model.voxelize(batch).double()
    want, want_loss = _train_step(exact_model, batch, bev)
    got, got_loss = _train_step(cap_model, batch, bev)
    torch.testing.assert_close(got.heatmap, want.heatmap, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-9, atol=1e-9)
    for (name, a), b in zip(cap_model.named_parameters(), exact_model.parameters(), strict=True):
        ga = torch.zeros_like(a) if a.grad is None else a.grad  # no active block: no gradient on the lists
        gb = torch.zeros_like(b) if b.grad is None else b.grad
        torch.testing.assert_close(ga, gb, rtol=1e-8, atol=1e-9, msg=name)
    for (name, a), b in zip(cap_model.named_buffers(), exact_model.buffers(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=name)


def test_training_step_with_the_plan_and_no_host_call_inside(cuda_lists):
    """'auto' settings, a GPU's lists: one plan priced for a training step; the network's forward and backward make
    no data-dependent host call once it is read."""
    model = _model("auto", "auto").train()
    batch = _batch(2)
    batch.mask = _mask("patch")
    bev = model.voxelize(batch)
    lm = masks_at_strides(batch.mask, model.neck.strides)
    modes, caps, plan = model.capacity_plan(tuple(bev.shape), batch.mask, lm)
    assert plan is not None and any(m != "dense" for m in modes)
    with _Calls() as calls:
        heat, reg, _, _ = model.capacity_maps(bev, batch.mask, lm, modes, caps)
        (heat.square().mean() + reg.square().mean()).backward()
    assert calls.seen and not [f for f in calls.seen if f.startswith(SYNCS)]
    out = model(batch)
    assert out.plan is not None and list(out.plan.choices) == list(modes)


def test_training_overflow_stops_with_an_error(monkeypatch):
    """A training step whose lists would miss active blocks is not run on: its batch norm has already updated the
    running statistics, so it cannot rerun; it stops with a readable error (the lists come from this batch's own
    counts, so only a bug can get here)."""
    model = _model(8, 8).train()
    batch = _batch(2)
    batch.mask = _mask("patch")
    real = capacity.capacities
    monkeypatch.setattr(capacity, "capacities", lambda inputs, modes, smallest=8, buckets=True: [
        None if c is None else (1, 1 if c[1] else 0) for c in real(inputs, modes, smallest, buckets)])
    with pytest.raises(RuntimeError, match="no block may be dropped"):
        model(batch)


def test_graph_cache_belongs_to_its_model():
    model = _model(8, 8)
    model.graphs.get(("k",), lambda a: a, torch.zeros(1))
    assert len(model.graphs) == 1
    assert len(copy.deepcopy(model).graphs) == 0
    model.to(torch.float64)
    assert len(model.graphs) == 0  # moved tensors: graphs captured on the old ones are dropped


def test_compiles_fullgraph():
    """The whole network on the lists traces as one graph (no graph break: nothing for the host to read)."""
    model = _model(8, 16)
    batch = _batch(1)
    batch.mask = _mask("patch", 1)
    torch._dynamo.reset()
    with torch.no_grad():
        bev = model.voxelize(batch)
        lm = masks_at_strides(batch.mask, model.neck.strides)
        modes, caps, _ = model.capacity_plan(tuple(bev.shape), batch.mask, lm)
        want = model.capacity_maps(bev, batch.mask, lm, modes, caps)
        f = torch.compile(lambda b, m, *l: model.capacity_maps(b, m, l, modes, caps), fullgraph=True, backend="eager")
        got = f(bev, batch.mask, *lm)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    assert not bool(got[2])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replay_equals_the_masked_dense_network_on_the_gpu(dtype):
    """On CUDA: the captured network on block lists (the Triton kernels, a graph per shape, plan and buckets) gives
    the masked dense network's outputs, at its capture and at a replay on another batch of the same shapes; the
    dense network's graph gives the eager dense outputs."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = _model(8, 16).cuda().to(dtype)
    twin = _dense_twin(model)
    tol = dict(rtol=1e-3, atol=1e-3) if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2)
    for seed in (0, 1):
        batch = _batch(2, seed=seed).to(torch.device("cuda"))
        batch.mask = _mask("patch").cuda()
        with torch.no_grad():
            bev = model.voxelize(batch).to(dtype)
            exact = twin(batch, bev=bev)
            cap = model(batch, bev=bev)
            batch.mask = None
            model.use_data_mask = False
            dense_graph = model(batch, bev=bev)
            dense = model(batch, bev=bev)  # its replay
            with torch.autograd.set_grad_enabled(True):  # eager (under autograd nothing is captured)
                dense_eager = model(batch, bev=bev)
            model.use_data_mask = True
        torch.testing.assert_close(cap.heatmap.float(), exact.heatmap.float(), **tol)
        torch.testing.assert_close(cap.regression.float(), exact.regression.float(), **tol)
        torch.testing.assert_close(dense_graph.heatmap.float(), dense_eager.heatmap.float(), **tol)
        torch.testing.assert_close(dense.heatmap.float(), dense_eager.heatmap.float(), **tol)
    assert len(model.graphs) >= 2  # the sparse graph(s) and the dense one


def test_whole_check_keeps_the_kernels_only_if_the_network_matches_the_composition(monkeypatch):
    """whole_check: outputs equal with the kernels and with the composition (the path ``run`` takes under the
    check's forcing): the kernels stay on, asked once per device and dtype; outputs that differ, or a run that raises
    on the kernels, switch them off for that device and dtype with one warning."""
    from detector.ops import fused

    monkeypatch.setattr(fused, "_WHOLE", {})
    monkeypatch.setattr(fused, "_CHECKED", {})
    calls = []

    def run(offset: float):  # noqa: ANN202
        def f():  # noqa: ANN202
            calls.append(fused._FORCE)
            return (torch.ones(3) + (0.0 if fused._FORCE == "torch" else offset),)
        return f

    dev = torch.device("cpu")
    assert fused.whole_check(dev, torch.float32, run(0.0)) and calls == [None, "torch"]
    assert fused.whole_check(dev, torch.float32, run(5.0))  # remembered: not run again
    assert calls == [None, "torch"]
    with pytest.warns(RuntimeWarning, match="differs from the composition"):
        assert not fused.whole_check(dev, torch.float64, run(0.5))
    assert fused._CHECKED[("cpu", torch.float64)] is False

    def boom():  # noqa: ANN202
        raise RuntimeError("no kernel for this device")

    with pytest.warns(RuntimeWarning, match="RuntimeError: no kernel"):
        assert not fused.whole_check(dev, torch.bfloat16, boom)


@pytest.mark.slow  # ~45 s interpreted; make test checks whole_check's rule above
def test_the_network_runs_the_kernels_only_after_its_first_batch_matched_the_composition(monkeypatch):
    """On the kernels' path the first batch runs the whole network on the kernels and on the composition: equal, the
    kernels stay on; a kernel that gives other values (here: one that adds 1 where it writes a map) is switched off for
    that device and dtype with one warning, and the network's outputs are the composition's."""
    pytest.importorskip("triton")
    from detector.ops import fused, triton_blocks

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(fused, "_WHOLE", {})
    monkeypatch.setattr(fused, "_CHECKED", {})
    batch = _batch(n=1)
    batch.mask = _mask("patch", n=1)
    model = _model(16, 16)
    monkeypatch.setenv("DETECTOR_FUSED", "torch")
    with torch.no_grad():
        want = model(batch)
    monkeypatch.setenv("DETECTOR_FUSED", "triton")
    with torch.no_grad():
        model(batch)  # the real kernels: the check passes
    assert fused._WHOLE == {("cpu", torch.float32): True}
    real = triton_blocks.block_conv

    def wrong(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        out = real(*args, **kwargs)
        return out.add_(1.0) if kwargs.get("tile") is not None else out

    monkeypatch.setattr(triton_blocks, "block_conv", wrong)
    monkeypatch.setattr(fused, "_WHOLE", {})
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="differs from the composition"):
        got = model(batch)
    assert fused.fused_backend(torch.device("cpu")) == "torch"
    torch.testing.assert_close(got.heatmap, want.heatmap, atol=1e-5, rtol=0)
    torch.testing.assert_close(got.regression, want.regression, atol=1e-5, rtol=0)
