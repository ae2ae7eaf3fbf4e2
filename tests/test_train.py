"""The training application: configs, fast_dev_run, resume, evaluation, checkpoints, bad config."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate
from omegaconf import OmegaConf

from detector.build import build_grid, build_model
from detector.callbacks import load_checkpoint
from detector.errors import CheckpointError, ConfigError
from detector.tasks import build_datamodule, evaluate_checkpoint, train, validate_config
from tests.paths import CONFIGS, REPO

TINY = [
    "bev.x_range=[0,25.6]", "bev.y_range=[-12.8,12.8]", "bev.z_resolution=0.5",
    "model.backbone.stem_channels=8", "model.backbone.stage_units=[1,1,1,1]",
    "model.backbone.stage_channels=[8,8,16,16]", "model.neck_channels=8", "model.head_channels=8",
    "data.batch_size=2", "data.eval_batch_size=2", "data.num_workers=0", "data.augment=null",
    "trainer.max_epochs=1", "trainer.accelerator=cpu", "callbacks.progress_bar=null",
    # fixed tiles: the tests do not depend on this machine's measured cost model (block_size=auto's plan)
    "model.block_size=16", "model.head_block_size=16",
]


def _cfg(out: Path, root: Path, *overrides: str, name: str = "train"):
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        return compose(name, overrides=[f"paths.output_dir={out}", f"data.root={root}", *TINY, *overrides]
                       if name == "train" else [f"paths.output_dir={out}", f"data.root={root}", *overrides])


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


# --- every option of every group composes and instantiates ------------------------------------------
@pytest.mark.parametrize("option", _options("bev"))
def test_bev_options(tmp_path, tiny_root, option):
    cfg = _cfg(tmp_path, tiny_root, f"bev={option}")
    grid = build_grid(cfg.bev)
    assert grid.H % 32 == 0 and grid.W % 32 == 0


@pytest.mark.parametrize("model", _options("model"))
@pytest.mark.parametrize("mask", _options("mask"))
def test_model_and_mask_options(tmp_path, tiny_root, model, mask):
    cfg = _cfg(tmp_path, tiny_root, f"model={model}", f"mask={mask}")
    grid = build_grid(cfg.bev)
    det = build_model(cfg.model, cfg.mask, grid)
    dm = build_datamodule(cfg.data, cfg.mask, grid, bool(cfg.model.sparse))
    batch = next(iter(dm.val_dataloader()))
    det.eval()
    with torch.no_grad():
        out = det(batch)
    assert out.heatmap.shape[-2:] == (grid.H // 4, grid.W // 4)
    dense = model == "dense" or mask == "none"
    assert (out.mask is None) == dense


@pytest.mark.parametrize("data", _options("data"))
def test_data_options(tmp_path, tiny_root, data):
    root = tiny_root
    if data == "lidar":  # a LiDAR-only root: the same frames converted
        from detector.data.convert import convert_kitti_to_lidar

        root = tmp_path / "lidar"
        convert_kitti_to_lidar(tiny_root, root)
    cfg = _cfg(tmp_path, root, f"data={data}", "data.augment=null")
    dm = build_datamodule(cfg.data, cfg.mask, build_grid(cfg.bev), True)
    dm.setup("fit")
    n_train, n_val = len(dm.dataset("train")), len(dm.dataset("val"))
    assert n_train > 0 and n_val > 0 and n_train + n_val == 6


def test_augmentation_config_instantiates(tmp_path, tiny_root):
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        cfg = compose("train", overrides=[f"paths.output_dir={tmp_path}", f"data.root={tiny_root}"])
    aug = instantiate(cfg.data.augment)
    dm = build_datamodule(cfg.data, cfg.mask, build_grid(cfg.bev), True)
    frame = dm.dataset("val")[0]  # not augmented: the val split has no transform
    import numpy as np

    out = aug(frame, np.random.default_rng(0))
    n = len(frame.gt_boxes)
    assert len(out.gt_boxes) > n, "GT sampling pasted nothing"
    inside = out.gt_boxes[n:].points_in_boxes(out.points, margin=1e-3).sum(0)
    assert (inside >= cfg.data.augment.ops[0].min_points).all(), inside  # each pasted object with its points


@pytest.mark.parametrize("group", ["trainer", "logger", "callbacks"])
def test_trainer_logger_callback_options(tmp_path, tiny_root, group):
    for option in _options(group):
        extra = ["trainer.accelerator=cpu"] if group == "trainer" and not torch.cuda.is_available() else []
        if group == "trainer" and option == "ddp":
            extra += ["trainer.devices=2"]
        if group == "trainer" and option == "gpu" and not torch.cuda.is_available():
            extra += ["trainer.precision=32-true"]
        cfg = _cfg(tmp_path, tiny_root, f"{group}={option}", *extra)
        if group == "trainer":
            import lightning as L

            assert isinstance(instantiate(cfg.trainer, logger=False), L.Trainer)
        elif group == "logger":
            if cfg.logger and "_target_" in cfg.logger:
                instantiate(cfg.logger)
        else:
            for c in cfg.callbacks.values():
                if c is not None:
                    instantiate(c)


@pytest.mark.parametrize("group", ["experiment", "debug"])
def test_experiment_and_debug_options(tmp_path, tiny_root, group):
    for option in _options(group):
        cfg = _cfg(tmp_path, tiny_root, f"{group}={option}")
        grid = build_grid(cfg.bev)
        build_model(cfg.model, cfg.mask, grid)
        OmegaConf.to_container(cfg, resolve=True)


# --- running ------------------------------------------------------------------------------------------
def test_fast_dev_run_train_then_evaluate(tmp_path, tiny_root):
    cfg = _cfg(tmp_path / "run", tiny_root, "debug=fdr", "logger=none")
    result = train(cfg)
    assert result["metrics"] is None  # debug=fdr skips the evaluation after training
    cfg = _cfg(tmp_path / "run2", tiny_root, "trainer.max_steps=2", "callbacks.model_checkpoint.monitor=null",
               "evaluate_after=false")
    result = train(cfg)
    ckpt = Path(result["best_ckpt"])
    assert ckpt.is_file()
    assert list((tmp_path / "run2" / "tensorboard").glob("events.out.tfevents.*"))
    data_cfg = cfg.data.copy()
    metrics = evaluate_checkpoint(ckpt, data_cfg, tmp_path / "eval", split="val")
    assert set(metrics["Car"]) >= {"2d", "bev", "3d", "aos"}
    assert (tmp_path / "eval" / "metrics.json").is_file()
    val_ids = (tiny_root / "ImageSets" / "val.txt").read_text().split()
    assert sorted(p.name for p in (tmp_path / "eval" / "data").iterdir()) == [f"{i}.txt" for i in val_ids]
    # the same weights run dense
    metrics_dense = evaluate_checkpoint(ckpt, data_cfg, tmp_path / "eval_dense", split="val", mask_override="none")
    assert "Car" in metrics_dense


def test_road_map_run_trains_with_augmentation(tmp_path, tiny_root):
    """mask=road_map with data=sim's augmentation on a tiny set: augmented frames reach the loader with their
    transformed road maps, the road-map computation mask is made from those (it covers every drivable cell of the
    transformed map), and training steps run."""
    from detector.data.masks import RoadMapMask, resample_road_map

    overrides = [f"paths.output_dir={tmp_path}", f"data.root={tiny_root}",
                 *[o for o in TINY if o != "data.augment=null"], "trainer.max_steps=2", "mask=road_map",
                 "callbacks.model_checkpoint.monitor=null", "evaluate_after=false", "logger=none"]
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    assert cfg.mask.provider._target_.endswith("RoadMapMask") and cfg.data.augment is not None
    grid = build_grid(cfg.bev)
    dm = build_datamodule(cfg.data, cfg.mask, grid, sparse=True)
    assert isinstance(dm.mask_provider, RoadMapMask)
    batch = next(iter(dm.train_dataloader()))
    assert batch.mask is not None and batch.mask.shape == (2, 1, grid.H, grid.W)
    for k, f in enumerate(batch.frames):
        assert f.road_map is not None and f.road_map.to_raster is not None  # flipped/rotated/scaled with the scene
        drivable = resample_road_map(f.road_map, grid)
        assert drivable.any() and (batch.mask[k, 0][drivable] == 1).all()
    assert 0.0 < batch.mask.mean() < 1.0
    result = train(cfg)
    ckpt = load_checkpoint(result["best_ckpt"])
    assert ckpt["global_step"] == 2


def test_readme_default_run_trains_the_mask_net_on_its_own_prediction(tmp_path, tiny_root):
    """The README's main run (the default config: data=sim with its augmentation, mask=predicted, the sparse model)
    on a tiny set. Rule (configs/mask/predicted.yaml): in training the computation mask is the mask net's own
    prediction - cells of probability > threshold, dilated by ``dilation`` cells of its grid, each cell covering
    ``downsample`` x ``downsample`` BEV cells - with ``train_source=union`` it also holds every cell of the Car
    boxes dilated by ``model.mask_dilation_m``. The checkpoint holds the trained mask net."""
    from detector.models.mask_net import MaskNet

    overrides = [f"paths.output_dir={tmp_path}", f"data.root={tiny_root}",
                 *[o for o in TINY if o != "data.augment=null"], "trainer.max_steps=2",
                 "callbacks.model_checkpoint.monitor=null", "evaluate_after=false", "logger=none"]
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
        union_cfg = compose("train", overrides=[*overrides, "mask.schedule.train_source=union"])
    assert cfg.mask.net._target_.endswith("MaskNet") and cfg.data.augment
    assert cfg.mask.schedule.train_source == "predicted"
    grid = build_grid(cfg.bev)
    batch = next(iter(build_datamodule(cfg.data, cfg.mask, grid, sparse=True).train_dataloader()))
    assert batch.mask is None  # no data-side mask: the network's
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.mask, grid).train()
    union = build_model(union_cfg.model, union_cfg.mask, grid).train()
    assert isinstance(model.mask_net, MaskNet)
    with torch.no_grad():  # an untrained net predicts nothing (bias -2): a bias that puts 3 % of its cells over 0.5
        net = model.mask_net
        net.net[-1].bias.zero_()
        logits = net(model.voxelize(batch))
        net.net[-1].bias.fill_(-float(torch.quantile(logits.flatten(), 0.97)))  # over 0.5, so over the threshold
    union.load_state_dict(model.state_dict())
    out, out_union = model(batch), union(batch)
    d, t = cfg.mask.net.downsample, cfg.mask.net.threshold
    coarse = torch.sigmoid(out.mask_logits) > t

    def rule(r: int) -> torch.Tensor:  # every cell within r cells (a square: a max over the (2r+1)^2 window)
        grown = coarse.clone()
        for dy in range(-r, r + 1):
            for dx in range(-r, r + 1):
                shifted = torch.zeros_like(coarse)
                ys = slice(max(dy, 0), coarse.shape[2] + min(dy, 0))
                xs = slice(max(dx, 0), coarse.shape[3] + min(dx, 0))
                yd = slice(max(-dy, 0), coarse.shape[2] + min(-dy, 0))
                xd = slice(max(-dx, 0), coarse.shape[3] + min(-dx, 0))
                shifted[:, :, yd, xd] = coarse[:, :, ys, xs]
                grown |= shifted
        return grown.repeat_interleave(d, 2).repeat_interleave(d, 3).float()

    expected = rule(cfg.mask.net.dilation)
    model.mask_net.dilation = cfg.mask.net.dilation + 1  # the rule at one cell more than configured, too
    with torch.no_grad():
        assert torch.equal(model(batch).mask, rule(cfg.mask.net.dilation + 1))
    model.mask_net.dilation = cfg.mask.net.dilation
    assert 0.0 < expected.mean() < 1.0 and torch.equal(out.mask, expected)
    objects = model.object_mask(batch, downsample=1) > 0
    assert objects.any() and not bool((out.mask[objects] == 1).all())  # the boxes are not added in
    assert torch.equal(out_union.mask, torch.maximum(expected, objects.float()))
    # Rule (configs/mask/predicted.yaml): the first warmup_steps optimizer steps (global steps 0 .. warmup_steps - 1)
    # train on the union whatever train_source says; from then on the prediction alone; evaluation never adds boxes
    w = cfg.mask.schedule.warmup_steps
    assert w > 0
    with torch.no_grad():
        assert torch.equal(model(batch, step=0).mask, out_union.mask)
        assert torch.equal(model(batch, step=w - 1).mask, out_union.mask)
        assert torch.equal(model(batch, step=w).mask, expected)
        model.eval()  # evaluation: the step does not matter
        assert torch.equal(model(batch, step=0).mask, model(batch).mask)
        model.train()
    result = train(cfg)
    ckpt = load_checkpoint(result["best_ckpt"])
    assert ckpt["global_step"] == 2 and any(k.startswith("model.mask_net.") for k in ckpt["state_dict"])


def test_block_lists_train_what_the_masked_dense_network_trains(tmp_path, tiny_root):
    """The default run on a tiny set: Lightning's steps on the block lists reach the weights and running statistics
    of the same run with every stage dense - whole maps, each unit's mask applied - (same seed, same batches; the
    lists' batch norm equals the mask pixels' statistics, up to float32 rounding)."""
    states = {}
    for path in ("lists", "dense"):
        ways = ["model.block_size=dense", "model.head_block_size=dense"] if path == "dense" else []
        cfg = _cfg(tmp_path / path, tiny_root, "trainer.max_epochs=2", "trainer.max_steps=3",
                   "callbacks.model_checkpoint.monitor=null", "evaluate_after=false", "logger=none",
                   # plain SGD: a step moves each weight by lr x its gradient (Adam's normalization would blow the
                   # float32 rounding of a near-zero gradient up to a step of lr)
                   "optimizer._target_=torch.optim.SGD", "optimizer.weight_decay=0", *ways)
        result = train(cfg)
        ckpt = load_checkpoint(result["best_ckpt"])
        assert ckpt["global_step"] == 3
        states[path] = ckpt["state_dict"]
    assert states["dense"].keys() == states["lists"].keys()
    for k, v in states["dense"].items():
        torch.testing.assert_close(states["lists"][k], v, rtol=1e-4, atol=1e-5, msg=k)


def test_mask_train_threshold_phase_then_the_inference_threshold(tmp_path, tiny_root):
    """Rule (configs/mask/predicted.yaml): the first ``train_threshold_steps`` optimizer steps (global steps
    0 .. train_threshold_steps - 1) threshold the mask net's probabilities at ``train_threshold``; later steps and
    evaluation at ``net.threshold``. Built from the config the README's run uses, with the warm-up off."""
    cfg = _cfg(tmp_path, tiny_root, "mask.schedule.warmup_steps=0", "mask.net.threshold=0.4",
               "mask.schedule.train_threshold=0.6", "mask.schedule.train_threshold_steps=5", "mask.net.dilation=0")
    grid = build_grid(cfg.bev)
    batch = next(iter(build_datamodule(cfg.data, cfg.mask, grid, sparse=True).train_dataloader()))
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.mask, grid).train()
    net, d = model.mask_net, cfg.mask.net.downsample
    with torch.no_grad():  # spread the untrained net's probabilities over both thresholds
        net.net[-1].bias.zero_()
        logits = net(model.voxelize(batch))
        net.net[-1].bias.fill_(-float(torch.quantile(logits.flatten(), 0.5)))
        p = torch.sigmoid(net(model.voxelize(batch)))

        def rule(t: float) -> torch.Tensor:  # cells over t, each covering d x d BEV cells
            return (p > t).repeat_interleave(d, 2).repeat_interleave(d, 3).float()

        tight, loose = rule(0.6), rule(0.4)
        assert 0 < tight.sum() < loose.sum() < loose.numel()
        assert torch.equal(model(batch, step=0).mask, tight)
        assert torch.equal(model(batch, step=4).mask, tight)
        assert torch.equal(model(batch, step=5).mask, loose)
        assert torch.equal(model(batch).mask, loose)  # no step: past every phase
        model.eval()  # evaluation (batch norm's running statistics: new probabilities): the inference threshold
        net.net[-1].bias.zero_()
        logits = net(model.voxelize(batch))
        net.net[-1].weight.div_(float(logits.std()))  # logits of spread 1 around their median
        net.net[-1].bias.fill_(-float(torch.quantile(logits.flatten(), 0.5) / logits.std()))
        p = torch.sigmoid(net(model.voxelize(batch)))
        assert 0 < rule(0.6).sum() < rule(0.4).sum() < p.numel() * d * d
        assert torch.equal(model(batch, step=0).mask, rule(0.4))
    for key, bad in (("train_threshold", 1.5), ("train_threshold", "0.3"), ("train_threshold_steps", -1)):
        broken = OmegaConf.merge(cfg, {"mask": {"schedule": {key: bad}}})
        with pytest.raises(ConfigError, match=rf"^mask\.schedule\.{key} must be"):
            validate_config(broken)


def test_mask_union_dilation_sets_the_ground_truth_part_of_the_union(tmp_path, tiny_root):
    """Rule (configs/mask/predicted.yaml): with train_source=union the training mask is the prediction plus every cell
    of the Car boxes enlarged by ``union_dilation_m`` metres (null: ``model.mask_dilation_m``, the mask net's target);
    the mask net's target keeps ``model.mask_dilation_m``."""
    from detector.geometry.box_masks import boxes_mask
    from detector.models.mask_quality import class_boxes

    base = ["mask.schedule.warmup_steps=0", "mask.schedule.train_source=union", "model.mask_dilation_m=1.0"]
    cfg0 = _cfg(tmp_path, tiny_root, *base, "mask.schedule.union_dilation_m=0")
    cfg_null = _cfg(tmp_path, tiny_root, *base)
    grid = build_grid(cfg0.bev)
    batch = next(iter(build_datamodule(cfg0.data, cfg0.mask, grid, sparse=True).train_dataloader()))
    torch.manual_seed(0)
    model0 = build_model(cfg0.model, cfg0.mask, grid).train()
    model_null = build_model(cfg_null.model, cfg_null.mask, grid).train()
    model_null.load_state_dict(model0.state_dict())
    cars = class_boxes(batch.gt_boxes, batch.gt_names, ["Car"])
    assert sum(len(b) for b in cars) > 0
    with torch.no_grad():
        pred = model0.mask_net.computation_mask(model0.mask_net(model0.voxelize(batch)), (grid.H, grid.W))
        out0, out_null = model0(batch, step=0), model_null(batch, step=0)
    assert torch.equal(out0.mask, torch.maximum(pred, boxes_mask(cars, grid, 0.0)))
    assert torch.equal(out_null.mask, torch.maximum(pred, boxes_mask(cars, grid, 1.0)))
    assert out0.mask.sum() < out_null.mask.sum()
    d = cfg0.mask.net.downsample  # the mask net's target: model.mask_dilation_m either way
    assert torch.equal(model0.object_mask(batch, d), boxes_mask(cars, grid, 1.0, downsample=d))
    broken = OmegaConf.merge(cfg0, {"mask": {"schedule": {"union_dilation_m": -1}}})
    with pytest.raises(ConfigError, match=r"^mask\.schedule\.union_dilation_m must be"):
        validate_config(broken)


class StopAtStep(L.Callback):
    """Stops training after ``step`` optimizer steps (a clean interruption of a longer schedule)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def _final_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(ckpt)["state_dict"]


def test_resume_continues_exactly(tmp_path, tiny_root):
    """4 steps straight == 2 steps, stop, resume from the step-2 checkpoint, 2 more steps; the mask's warm-up and
    its training-threshold phase end after step 3, in the resumed part (the step they count is restored with the
    checkpoint)."""
    common = ["trainer.max_steps=4", "mask.schedule.warmup_steps=3", "mask.schedule.train_threshold=0.6",
              "mask.schedule.train_threshold_steps=3", "trainer.max_epochs=-1",
              "callbacks.model_checkpoint.monitor=null",
              "callbacks.model_checkpoint.every_n_train_steps=2", "callbacks.model_checkpoint.save_top_k=-1",
              "evaluate_after=false", "logger=none", "trainer.limit_val_batches=0", "data.batch_size=1"]
    straight = train(_cfg(tmp_path / "a", tiny_root, *common))
    stop = ["+callbacks.stop._target_=tests.test_train.StopAtStep", "+callbacks.stop.step=2"]
    first = train(_cfg(tmp_path / "b", tiny_root, *common, *stop))
    mid = sorted((tmp_path / "b" / "checkpoints").glob("*step000002.ckpt"))
    assert mid, list((tmp_path / "b" / "checkpoints").iterdir())
    resumed = train(_cfg(tmp_path / "c", tiny_root, *common, f"ckpt_path={mid[0]}"))
    a = _final_weights(Path(straight["best_ckpt"]))
    c = _final_weights(Path(resumed["best_ckpt"]))
    assert first["best_ckpt"] is not None
    for k in a:
        torch.testing.assert_close(c[k], a[k], rtol=0, atol=0, msg=k)


def test_weights_only_refuses_pickled_objects(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    bad = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "payload": Evil()}, bad)
    with pytest.raises(CheckpointError, match="refused to load"):
        load_checkpoint(bad)
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint(tmp_path / "missing.ckpt")


def _run_script(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(
    "override, message",
    [
        ("model=nonexistent", "Could not find 'model/nonexistent'"),
        ("foo=1", "Could not override 'foo'"),
        ("data.batch_size=-2", "data.batch_size must be a positive integer or 'auto', got -2"),
        ("bev.x_range=[0,0.05]", "zero cells"),
        ("bev.resolution=0", "resolution must be positive"),
        ("trainer.max_epochs=abc", "trainer.max_epochs='abc': expected int or null"),
        ("mask.schedule.warmup_steps=-1", "mask.schedule.warmup_steps must be an integer >= 0, got -1"),
    ],
)
def test_bad_config_fails_at_start_with_one_line(tmp_path, tiny_root, override, message):
    r = _run_script("scripts/train.py", f"paths.output_dir={tmp_path}", f"data.root={tiny_root}", override)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr[-2000:]


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.batch_size=0", "data.batch_size must be a positive integer or 'auto', got 0"),
        ("data.batch_size=true", "data.batch_size must be a positive integer or 'auto', got True"),
        ("data.batch_size=many", "data.batch_size must be a positive integer or 'auto', got 'many'"),
        ("data.num_workers=-1", "data.num_workers must be an integer >= 0, got -1"),
        ("data.num_workers=two", "data.num_workers='two': expected int"),
        ("model.block_size=0", "model.block_size must be an int >= 1, auto, dense or a list, got 0"),
        ("model.block_size=huge", "model.block_size must be an int >= 1, auto, dense or a list, got 'huge'"),
        ("model.head_block_size=0", "model.head_block_size must be an int >= 1"),
        ("model.head_block_size=huge", "model.head_block_size must be an int >= 1"),
        ("optimizer.lr=0", "optimizer.lr must be a positive number, got 0"),
        ("optimizer.lr=fast", "optimizer.lr must be a positive number, got 'fast'"),
        ("model.classes=[]", "model.classes must name at least one class"),
        ("model.neck_channels=wide", "model.neck_channels='wide': expected int"),
        ("mask.schedule.warmup_steps=-1", "mask.schedule.warmup_steps must be an integer >= 0, got -1"),
        ("mask.schedule.train_source=both", "mask.schedule.train_source must be gt, predicted or union, got 'both'"),
        ("trainer.max_epochs=abc", "trainer.max_epochs='abc': expected int or null"),
        ("trainer.precision=7", "trainer.precision=7: expected 64 or 32 or 16"),
        ("trainer.gradient_clip_val=high", "trainer.gradient_clip_val='high': expected float or int or null"),
        ("bev.resolution=fine", "bev.resolution='fine': expected float"),
        ("model.backbone.stem_channels=wide", "model.backbone.stem_channels='wide': expected int"),
    ],
)
def test_validate_config_names_the_key(tmp_path, tiny_root, override, message):
    cfg = _cfg(tmp_path, tiny_root, override)
    with pytest.raises(ConfigError) as e:
        validate_config(cfg)
    assert str(e.value).startswith(message), str(e.value)


def test_validate_config_accepts_the_shipped_configs(tmp_path, tiny_root):
    for extra in ([], ["data.batch_size=auto"], ["model.block_size=auto"], ["model.block_size=[8,16,16,16]"],
                  ["model=dense"], ["experiment=kitti_full"], ["trainer.max_epochs=null", "trainer.max_steps=3"]):
        validate_config(_cfg(tmp_path, tiny_root, *extra))


def test_evaluate_script_refuses_a_pickled_checkpoint(tmp_path, tiny_root):
    bad = tmp_path / "evil.ckpt"
    torch.save({"x": object()}, bad)
    r = _run_script("scripts/evaluate.py", f"ckpt_path={bad}", f"data.root={tiny_root}", f"paths.output_dir={tmp_path}")
    assert r.returncode == 1 and "refused to load" in r.stderr and "Traceback" not in r.stderr


def test_killed_run_resumes_from_its_last_checkpoint(tmp_path, tiny_root):
    """SIGKILL mid-epoch, resume from last.ckpt: the final weights equal an uninterrupted run's, with the
    default augmentation (GT sampling, noise, flip, rotation, scaling) and a loader worker process."""
    with_augmentation = [o for o in TINY if o not in ("data.augment=null", "data.num_workers=0")]
    common = [f"data.root={tiny_root}", *with_augmentation, "data.num_workers=1",
              "trainer.max_steps=12", "trainer.max_epochs=-1",
              "callbacks.model_checkpoint.monitor=null", "callbacks.model_checkpoint.every_n_train_steps=1",
              "callbacks.last_checkpoint.every_n_train_steps=1",
              "evaluate_after=false", "logger=none", "trainer.limit_val_batches=0", "data.batch_size=1"]
    straight = _run_script("scripts/train.py", f"paths.output_dir={tmp_path / 'a'}", *common, timeout=900)
    assert straight.returncode == 0, straight.stderr[-3000:]
    out = tmp_path / "b"
    proc = subprocess.Popen([sys.executable, "scripts/train.py", f"paths.output_dir={out}", *common], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 600
    # a checkpoint file of step 7 exists only once step 6's saves, last.ckpt included, are done (the step file
    # is written before last.ckpt: waiting for step 6's file raced with last.ckpt, which could still say 5)
    while time.time() < deadline and not any(int(p.stem[-6:]) >= 7 for p in (out / "checkpoints").glob("*step0*.ckpt")):
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the run and its loader worker (a killed run's orphaned worker lingers)
    proc.wait()
    last = out / "checkpoints" / "last.ckpt"
    step = load_checkpoint(last)["global_step"]
    assert 6 <= step < 12, step
    resumed = _run_script("scripts/train.py", f"paths.output_dir={tmp_path / 'c'}", *common, f"ckpt_path={last}",
                          timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a = _final_weights(tmp_path / "a" / "checkpoints" / "last.ckpt")
    c = _final_weights(tmp_path / "c" / "checkpoints" / "last.ckpt")
    for k in a:
        torch.testing.assert_close(c[k], a[k], rtol=0, atol=0, msg=k)


def test_ddp_two_processes_on_cpu(tmp_path, tiny_root):
    r = _run_script("scripts/train.py", f"paths.output_dir={tmp_path}", f"data.root={tiny_root}", *TINY,
                    "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.max_epochs=1",
                    "trainer.sync_batchnorm=false",  # torch's SyncBatchNorm is GPU-only (tests/nn/test_ddp.py)
                    "trainer.check_val_every_n_epoch=1", "model.score_threshold=0.0",
                    "evaluate_after=false", timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    last = tmp_path / "checkpoints" / "last.ckpt"
    states = load_checkpoint(last)["callbacks"]
    score = next(v["best_model_score"] for k, v in states.items() if k.startswith("BestCheckpoint"))
    assert score is not None  # the monitored validation AP was computed
    # It came from both processes' records, gathered, so it equals one process evaluating the same weights
    # on the whole val split with the same decode settings. (After one epoch the tiny model may score 0
    # here; tests/eval/test_records.py checks the gathered records give the one-process AP on real counts.)
    metrics = evaluate_checkpoint(last, _cfg(tmp_path, tiny_root).data, tmp_path / "eval", split="val")
    assert float(score) == metrics["Car"]["bev"]["R40"]["moderate"]

