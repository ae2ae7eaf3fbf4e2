"""Every config group option, and every combination the README's cookbook names, builds the objects its YAML
describes; a checkpoint's config saved in the layout before ``_target_`` builds the model it trained."""

from __future__ import annotations

import copy
import itertools
import re

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate
from omegaconf import OmegaConf

from detector.build import build_grid, build_model, current_layout, load_detector
from detector.errors import ConfigError
from detector.geometry.voxelize import BevGrid
from detector.models.detector import BevDetector
from detector.models.mask_net import MaskNet
from detector.models.mask_schedule import MaskSchedule
from detector.models.targets import BoxCoder
from detector.nn.plan import Planner
from detector.nn.resnet import SparseResNet
from detector.tasks import validate_config
from tests.test_train import CONFIGS, _cfg, _options


def _composed(*overrides: str):
    """The train config as a user gets it (no test overrides): nothing below reads the data or writes outputs."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        return compose("train", overrides=["paths.output_dir=/tmp/unused_output", *overrides])


def _built(*overrides: str, tiny: bool = True):
    """Config, grid and detector (``tiny``: with tests/test_train.py's small network and grid, quicker to build)."""
    cfg = _cfg("/tmp/unused_output", "unused", *overrides) if tiny else _composed(*overrides)
    grid = build_grid(cfg.bev)
    return cfg, grid, build_model(cfg.model, cfg.mask, grid)


# --- the cookbook: model x mask x bev, and every experiment ------------------------------------------------
@pytest.mark.parametrize(("model", "mask", "bev"),
                         list(itertools.product(_options("model"), _options("mask"), _options("bev"))))
def test_model_mask_bev_combinations_build_what_the_yaml_says(model, mask, bev):
    cfg, grid, det = _built(f"model={model}", f"mask={mask}", f"bev={bev}")
    validate_config(cfg)
    assert isinstance(grid, BevGrid) and det.grid == grid
    assert isinstance(det, BevDetector) and isinstance(det.backbone, SparseResNet)
    assert isinstance(det.coder, BoxCoder) and isinstance(det.backbone.planner, Planner)
    assert det.coder.classes == tuple(cfg.model.classes)
    assert det.backbone.stages[0].units[0].convs[0].in_channels == grid.C
    assert det.head_block_size == cfg.model.head_block_size and det.mask_dilation_m == cfg.model.mask_dilation_m
    assert det.backbone.block_sizes == [cfg.model.block_size] * len(det.backbone.block_sizes)
    assert det.out_grid == grid.downsampled(cfg.model.out_stride)
    sparse = model == "sparse"
    assert det.use_data_mask == sparse == cfg.model.sparse
    if sparse and mask == "predicted":  # the mask net and its schedule, as configs/mask/predicted.yaml states them
        assert isinstance(det.mask_net, MaskNet) and isinstance(det.mask_schedule, MaskSchedule)
        assert det.mask_net.threshold == cfg.mask.net.threshold and det.mask_net.downsample == cfg.mask.net.downsample
        assert det.mask_schedule == instantiate(cfg.mask.schedule)
        assert det.mask_schedule.train_source == cfg.mask.schedule.train_source
        assert det.mask_schedule.warmup_steps == cfg.mask.schedule.warmup_steps
    else:  # a data-side mask (or none), or a dense model: no mask net
        assert det.mask_net is None and det.mask_schedule is None
    assert "grid=" in repr(det) and "classes=" in repr(det)


def test_the_defaults_are_the_yamls():
    """``model=sparse mask=predicted`` (the default run) holds the YAML's values, not values written in code."""
    model_yaml = OmegaConf.load(CONFIGS / "model" / "sparse.yaml")
    mask_yaml = OmegaConf.load(CONFIGS / "mask" / "predicted.yaml")
    _, _, det = _built("model=sparse", "mask=predicted", tiny=False)
    assert det.head_block_size == model_yaml.head_block_size == "auto"  # (tasks.py once said 16)
    assert det.mask_schedule.train_source == mask_yaml.schedule.train_source == "predicted"  # (once union)
    assert det.mask_schedule.warmup_steps == mask_yaml.schedule.warmup_steps
    assert det.mask_dilation_m == model_yaml.mask_dilation_m
    assert det.neck.out_channels == model_yaml.neck_channels
    assert "mask_schedule=MaskSchedule(train_source='predicted'" in repr(det)


def test_dense_states_its_tiles():
    _, _, det = _built("model=dense", tiny=False)
    assert det.backbone.block_sizes == ["dense"] * len(det.backbone.block_sizes) and det.head_block_size == "dense"
    assert not det.use_data_mask and det.mask_net is None


@pytest.mark.parametrize("experiment", _options("experiment"))
def test_experiments_build(experiment):
    cfg, grid, det = _built(f"experiment={experiment}", tiny=False)
    validate_config(cfg)
    assert det.coder.classes == tuple(cfg.model.classes) and isinstance(det.backbone, SparseResNet)
    if experiment == "multiclass":
        assert det.coder.classes == ("Car", "Pedestrian", "Cyclist") and det.coder.num_classes == 3
    if experiment == "kitti_full":
        assert (grid.H, grid.W, grid.C) == (800, 704, 36) and isinstance(det.mask_net, MaskNet)
        assert det.neck.out_channels == cfg.model.neck_channels == 128


@pytest.mark.parametrize("group", ["bev", "mask"])
def test_every_option_of_the_detectors_groups_instantiates_alone(group):
    for option in _options(group):
        node = _cfg("/tmp/unused_output", "unused", f"{group}={option}")[group]
        if group == "bev":
            assert isinstance(instantiate(node), BevGrid)
        else:
            assert set(node) == {"provider", "net", "schedule"}
            for part, kind in (("provider", object), ("schedule", MaskSchedule)):
                if node[part] is not None:
                    assert isinstance(instantiate(node[part]), kind)
            if node.net is not None:
                assert isinstance(instantiate(node.net, in_channels=11), MaskNet) and node.schedule is not None


@pytest.mark.parametrize(("key", "bad", "message"), [
    ("train_source", "both", "mask.schedule.train_source must be gt, predicted or union, got 'both'"),
    ("warmup_steps", -1, "mask.schedule.warmup_steps must be an integer >= 0, got -1"),
    ("warmup_steps", 1.5, "mask.schedule.warmup_steps must be an integer >= 0, got 1.5"),
    ("train_threshold_steps", True, "mask.schedule.train_threshold_steps must be an integer >= 0, got True"),
    ("train_threshold", 1.0, "mask.schedule.train_threshold must be null or a number in (0, 1), got 1.0"),
    ("union_dilation_m", -0.5, "mask.schedule.union_dilation_m must be null or a number >= 0, got -0.5"),
])
def test_mask_schedule_checks_name_the_key(key, bad, message):
    good = dict(train_source="predicted", warmup_steps=0, train_threshold=None, train_threshold_steps=0,
                union_dilation_m=None)
    with pytest.raises(ConfigError) as e:
        MaskSchedule(**{**good, key: bad})
    assert str(e.value) == message
    cfg = _cfg("/tmp/unused_output", "unused", f"mask.schedule.{key}={bad}")
    with pytest.raises(ConfigError, match="^" + re.escape(message.split(" got")[0])):  # build_model: the same one line
        build_model(cfg.model, cfg.mask, build_grid(cfg.bev))


# --- checkpoints written before the model config carried _target_s -----------------------------------------
# The bev, model and mask of a checkpoint's ``hyper_parameters.config`` as train() saved them before this layout
# (resolved; the tiny overrides of tests/test_train.py's TINY).
OLD_SPARSE = {
    "bev": {"_target_": "detector.geometry.voxelize.BevGrid", "x_range": [0, 25.6], "y_range": [-12.8, 12.8],
            "z_range": [-2.5, 1.0], "resolution": 0.2, "z_resolution": 0.5},
    "model": {
        "sparse": True, "classes": ["Car"], "block_size": 16, "head_block_size": 16,
        "plan": {"_target_": "detector.nn.plan.Planner", "candidates": [4, 8, 16, 32], "cost": None, "cost_file": None},
        "backbone": {"_target_": "detector.nn.resnet.SparseResNet", "stem_channels": 8, "stage_units": [1, 1, 1, 1],
                     "stage_channels": [8, 8, 16, 16], "stage_strides": [2, 2, 2, 2], "bottleneck": False,
                     "preact": False, "tol": 0.5, "memory_budget_mb": 1024},
        "coder": {"_target_": "detector.models.targets.BoxCoder", "pos_scale": 0.6, "ignore_scale": 1.3},
        "neck_channels": 8, "head_channels": 8, "out_stride": 4, "mask_dilation_m": 1.0,
        "score_threshold": 0.1, "nms_iou": 0.1, "max_detections": 100,
    },
    "mask": {
        "provider": None,
        "net": {"_target_": "detector.models.mask_net.MaskNet", "downsample": 4, "channels": 16, "num_convs": 7,
                "threshold": 0.45, "dilation": 0},
        "train_source": "predicted", "union_dilation_m": None, "warmup_steps": 240, "train_threshold": None,
        "train_threshold_steps": 0,
    },
}


def _old(**changes) -> dict:
    old = copy.deepcopy(OLD_SPARSE)
    for path, value in changes.items():
        group, key = path.split("__")
        if value is _DROP:
            del old[group][key]
        else:
            old[group][key] = value
    return old


_DROP = object()


def _shapes(det: BevDetector) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in det.state_dict().items()}


@pytest.mark.parametrize(("changes", "overrides"), [
    ({}, ["model=sparse", "mask=predicted"]),
    ({"model__sparse": False}, ["model=dense", "mask=predicted"]),
    ({"mask__net": None, "mask__provider": {"_target_": "detector.data.masks.RoadMapMask", "dilation_m": 2.0}},
     ["model=sparse", "mask=road_map"]),
])
def test_an_old_layout_config_builds_the_same_model(changes, overrides):
    old = _old(**changes)
    for key in ("train_source", "union_dilation_m", "warmup_steps", "train_threshold", "train_threshold_steps"):
        if old["mask"]["net"] is None:
            del old["mask"][key]
    cfg = OmegaConf.create(current_layout(old))
    grid = build_grid(cfg.bev)
    det = build_model(cfg.model, cfg.mask, grid)
    new_cfg = _cfg("/tmp/unused_output", "unused", *overrides)
    new = build_model(new_cfg.model, new_cfg.mask, build_grid(new_cfg.bev))
    assert _shapes(det) == _shapes(new)
    assert det.use_data_mask == new.use_data_mask and det.head_block_size == 16
    assert (det.mask_net is None) == (new.mask_net is None)
    sparse = old["model"]["sparse"]
    assert det.backbone.block_sizes == [16 if sparse else "dense"] * len(det.backbone.block_sizes)
    if det.mask_net is not None:  # the schedule it trained with
        assert det.mask_schedule == MaskSchedule(train_source="predicted", warmup_steps=240, train_threshold=None,
                                                 train_threshold_steps=0, union_dilation_m=None)
    assert current_layout(OmegaConf.to_container(cfg)) == OmegaConf.to_container(cfg)  # today's layout: as it is


def test_an_old_config_gets_the_defaults_old_code_took():
    """Keys an old saved config did not hold: what build_model then wrote in code (head_block_size 16, the union
    schedule without phases), not today's YAML values."""
    old = _old(model__head_block_size=_DROP, mask__train_source=_DROP, mask__warmup_steps=_DROP,
               mask__train_threshold=_DROP, mask__train_threshold_steps=_DROP, mask__union_dilation_m=_DROP)
    cfg = OmegaConf.create(current_layout(old))
    det = build_model(cfg.model, cfg.mask, build_grid(cfg.bev))
    assert det.head_block_size == 16
    assert det.mask_schedule == MaskSchedule(train_source="union", warmup_steps=0, train_threshold=None,
                                             train_threshold_steps=0, union_dilation_m=None)
    moved = _old()
    moved["bev"]["_target_"] = "detector.data.voxelize.BevGrid"  # a class that moved since
    assert current_layout(moved)["bev"]["_target_"] == "detector.geometry.voxelize.BevGrid"


def test_load_detector_loads_an_old_layout_checkpoint(tmp_path):
    """A checkpoint whose saved config has the old layout loads with its weights."""
    cfg = OmegaConf.create(current_layout(OLD_SPARSE))
    torch.manual_seed(0)
    trained = build_model(cfg.model, cfg.mask, build_grid(cfg.bev))
    ckpt = tmp_path / "old.ckpt"
    torch.save({"state_dict": {f"model.{k}": v for k, v in trained.state_dict().items()},
                "hyper_parameters": {"config": copy.deepcopy(OLD_SPARSE)}}, ckpt)
    model, loaded_cfg = load_detector(ckpt)
    assert loaded_cfg.model._target_.endswith("BevDetector") and loaded_cfg.mask.schedule.warmup_steps == 240
    for k, v in trained.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    none, _ = load_detector(ckpt, mask_override="none")
    assert none.mask_net is None and none.use_data_mask
