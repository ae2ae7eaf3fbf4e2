"""``model.checkpoint_stages``: a checkpointed stage recomputes its forward in the backward and keeps nothing else.

The rule: checkpointing trades compute for memory and changes no number - the same loss, the same gradients of
every parameter and of the input (float64, to rounding), the same running statistics after the step (the
recomputation must not count the batch a second time) - while what the step keeps for the backward shrinks.
"""

from __future__ import annotations

import pytest
import torch

from detector.errors import ConfigError
from detector.nn.resnet import SparseResNet

STAGES = ["stem", "stage1", "stage2"]


def _net(checkpoint_stages, block_size) -> SparseResNet:
    torch.manual_seed(0)
    net = SparseResNet(3, stem_channels=8, stage_units=(2, 2), stage_channels=(8, 16), stage_strides=(2, 2),
                       bottleneck=False, block_size=block_size, checkpoint_stages=checkpoint_stages)
    return net.double().train()


def _step(net: SparseResNet, sparse: bool):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 32, 32, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(2, 1, 32, 32, dtype=torch.float64)
    mask[0, :, 3:14, 5:20] = 1
    mask[1, :, 20:30, 2:9] = 1
    feats = net(x, mask if sparse else None)
    loss = sum((f * torch.linspace(-1, 1, f.numel(), dtype=f.dtype).view_as(f)).sum() for f in feats)
    loss.backward()
    stats = {k: v.clone() for k, v in net.state_dict().items() if "running" in k or "num_batches" in k}
    return loss.detach(), x.grad, {n: p.grad for n, p in net.named_parameters()}, stats


@pytest.mark.parametrize("block_size", [8, "dense"])
@pytest.mark.parametrize("sparse", [True, False], ids=["masked", "no-mask"])
def test_checkpointed_stages_give_the_same_step(block_size, sparse):
    want = _step(_net([], block_size), sparse)
    got = _step(_net(STAGES, block_size), sparse)
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], want[1], rtol=1e-9, atol=1e-12)
    assert got[2].keys() == want[2].keys()
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-9, atol=1e-12, msg=name)
    for name in want[3]:
        torch.testing.assert_close(got[3][name], want[3][name], rtol=1e-12, atol=1e-12, msg=name)


def _saved_bytes(net: SparseResNet) -> int:
    seen: dict[int, int] = {}
    params = {p.untyped_storage().data_ptr() for p in net.parameters()}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    mask = torch.ones(2, 1, 32, 32, dtype=torch.float64)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        feats = net(x, mask)
    sum(f.sum() for f in feats).backward()
    return sum(seen.values())


def test_checkpointed_stages_keep_less():
    assert _saved_bytes(_net(["stem", "stage1"], 8)) < 0.5 * _saved_bytes(_net([], 8))


def test_an_unknown_stage_is_a_config_error():
    with pytest.raises(ConfigError, match="model.checkpoint_stages"):
        _net(["stage9"], 8)


def test_checkpointed_stages_are_refused_with_a_captured_training_step(tmp_path, tiny_root):
    from detector.build import build_grid, build_model
    from tests.test_train import _cfg

    cfg = _cfg(tmp_path, tiny_root, "model.checkpoint_stages=[stem]", "model.capture_train=true")
    with pytest.raises(ConfigError, match="model.checkpoint_stages needs model.capture_train=false"):
        build_model(cfg.model, cfg.mask, build_grid(cfg.bev))
    cfg = _cfg(tmp_path, tiny_root, "model.checkpoint_stages=[stem,stage1]")  # the user's override builds
    assert build_model(cfg.model, cfg.mask, build_grid(cfg.bev)).backbone.checkpoint_stages == {"stem", "stage1"}


def test_training_with_checkpointed_stages_runs_as_a_user_runs_it(tmp_path, tiny_root):
    """scripts/train.py model.checkpoint_stages=[stem,stage1] with the default mask (the mask net, its schedule)."""
    from detector.tasks import train
    from tests.test_train import _cfg

    result = train(_cfg(tmp_path, tiny_root, "model.checkpoint_stages=[stem,stage1]", "trainer.max_steps=2",
                        "evaluate_after=false", "logger=none", "trainer.limit_val_batches=0"))
    assert result["best_ckpt"] is not None
