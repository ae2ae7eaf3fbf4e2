"""A detector from its config or a checkpoint: the model parts a run builds (grid, model, decode settings) and a
checkpoint's model rebuilt as it trained (:func:`load_detector`) - what training, evaluation and predict share."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict

from detector.callbacks import load_checkpoint
from detector.errors import ConfigError, is_user_error, root_cause
from detector.geometry.voxelize import BevGrid
from detector.models.detector import BevDetector
from detector.nn.plan import check_setting
from detector.resources import config_dir

log = logging.getLogger(__name__)


def build_grid(bev_cfg: DictConfig) -> BevGrid:
    try:
        return instantiate(bev_cfg)
    except Exception as e:
        if not is_user_error(e):
            raise
        raise ConfigError(f"bev: {root_cause(e)}") from None


# Keys of the model config that are not the detector's arguments: its parts take classes, block_size, plan and
# checkpoint_stages by interpolation (configs/model/sparse.yaml); decode_kwargs takes the decoding settings.
_NOT_DETECTOR_ARGS = ("classes", "block_size", "plan", "checkpoint_stages", "score_threshold", "nms_iou",
                      "max_detections")


def build_model(model_cfg: DictConfig, mask_cfg: DictConfig | None, grid: BevGrid) -> BevDetector:
    """The detector ``model_cfg`` describes (its ``_target_``, :class:`BevDetector`, and its parts'), on ``grid``
    (the backbone's input channels are the grid's), with ``mask_cfg``'s mask net and schedule where the model is
    sparse: a dense one computes every cell, its mask parts are not built. An invalid schedule is one
    :class:`ConfigError` naming its key."""
    mask_net = schedule = None
    if model_cfg.sparse and mask_cfg is not None and mask_cfg.net is not None:
        if mask_cfg.schedule is None:
            raise ConfigError("mask.schedule must say how training uses the mask net's mask (mask.net is set), "
                              "got null")
        mask_net = instantiate(mask_cfg.net, in_channels=grid.C)
        schedule = instantiate_checked(mask_cfg.schedule)
    node = {k: v for k, v in OmegaConf.to_container(model_cfg, resolve=True).items() if k not in _NOT_DETECTOR_ARGS}
    detector = instantiate(node, _partial_=True, backbone={"in_channels": grid.C})
    return detector(grid, mask_net=mask_net, mask_schedule=schedule)


def instantiate_checked(node: DictConfig) -> Any:
    """``instantiate(node)``, raising the :class:`ConfigError` a target's own checks raised as it is (Hydra wraps
    it), so that its message, which names the key, is the whole error."""
    try:
        return instantiate(node)
    except Exception as e:
        if isinstance(root_cause(e), ConfigError):
            raise root_cause(e) from None
        raise


def decode_kwargs(model_cfg: DictConfig) -> dict[str, Any]:
    return {"score_threshold": model_cfg.score_threshold, "nms_iou": model_cfg.nms_iou,
            "max_detections": model_cfg.max_detections}


# Classes a saved config may name by the path they had when the checkpoint was written.
_MOVED_TARGETS = {"detector.data.voxelize.BevGrid": "detector.geometry.voxelize.BevGrid"}
# A mask config saved before ``mask.schedule``: its schedule's keys beside ``net``, and what build_model then took
# for one the config did not hold.
# Model settings a checkpoint may hold that no longer exist: how it ran, never what it computed.
_RETIRED_MODEL_KEYS = ("inference_path", "train_path")
_OLD_SCHEDULE = {"train_source": "union", "warmup_steps": 0, "train_threshold": None, "train_threshold_steps": 0,
                 "union_dilation_m": None}


def current_layout(saved: dict) -> dict:
    """A checkpoint's saved config in today's layout, so that a checkpoint written before a change of layout builds
    the model it trained: a class that moved (:data:`_MOVED_TARGETS`); a model node without ``_target_`` (the
    detector was assembled in code, which gave the backbone ``block_size`` and ``plan`` - ``dense`` and none for a
    dense model - the coder ``classes``, and took ``head_block_size`` 16 where the config had none); mask settings
    beside ``net`` instead of in ``mask.schedule`` (:data:`_OLD_SCHEDULE`); the settings of a retired second sparse
    path and its chunking (:data:`_RETIRED_MODEL_KEYS`: the values never depended on them). Today's layout is
    returned as it is."""
    cfg = copy.deepcopy(saved)
    bev = cfg.get("bev")
    if isinstance(bev, dict) and bev.get("_target_") in _MOVED_TARGETS:
        bev["_target_"] = _MOVED_TARGETS[bev["_target_"]]
    model = cfg.get("model")
    if isinstance(model, dict) and "_target_" not in model:
        sparse = bool(model["sparse"])
        model["_target_"] = "detector.models.detector.BevDetector"
        model.setdefault("head_block_size", 16)
        model["backbone"] = {**model["backbone"], "block_size": model["block_size"] if sparse else "dense",
                             "planner": model.get("plan") if sparse else None}
        model["coder"] = {**model["coder"], "classes": list(model["classes"])}
    if isinstance(model, dict):
        for key in _RETIRED_MODEL_KEYS:
            model.pop(key, None)
        if isinstance(model.get("backbone"), dict):
            model["backbone"].pop("memory_budget_mb", None)
    mask = cfg.get("mask")
    if isinstance(mask, dict) and "schedule" not in mask:
        old = {k: mask.pop(k, default) for k, default in _OLD_SCHEDULE.items()}
        schedule = {"_target_": "detector.models.mask_schedule.MaskSchedule", **old}
        mask["schedule"] = schedule if mask.get("net") else None
    return cfg


# a mask net's settings that do not change its weights: how its prediction is thresholded and dilated
_MASK_NET_SETTINGS = ("threshold", "dilation")


def _trained_net(net_cfg: DictConfig, saved_net: dict, ckpt_path: str | Path) -> DictConfig:
    """The mask net a mask override asks for, built as the checkpoint trained it: its architecture (everything but
    :data:`_MASK_NET_SETTINGS`) from the checkpoint - the weights fit no other - and its threshold and dilation from
    the override. One warning names what differs (a network the config describes differently, or settings other than
    those it trained with, which cost AP: README, Speed)."""
    net = net_cfg.copy()
    arch = {k: v for k, v in saved_net.items() if k not in _MASK_NET_SETTINGS}
    differ = [f"{k}={v} (config: {net.get(k)})" for k, v in arch.items() if net.get(k) != v]
    retuned = [f"{k}={net.get(k)} (trained at {saved_net[k]})" for k in _MASK_NET_SETTINGS
               if k in saved_net and net.get(k) != saved_net[k]]
    with open_dict(net):
        net.update(arch)
    if differ or retuned:
        log.warning("mask.net: %s", "; ".join(
            ([f"the mask net {ckpt_path} trained has " + ", ".join(differ) + ": built as trained"] if differ else [])
            + (["run at " + ", ".join(retuned)] if retuned else [])))
    return net


def load_detector(ckpt_path: str | Path, mask_override: str | DictConfig | None = None,
                  block_size: int | str | None = None) -> tuple[BevDetector, DictConfig]:
    """Rebuild the detector from a checkpoint's saved config and load its weights (weights_only).

    ``mask_override``: a mask config (``eval.yaml``'s ``mask=...`` group) or its name; None keeps the
    checkpoint's. A mask net the checkpoint did not train (e.g. ``mask=predicted`` on a ``road_map``
    checkpoint) is an error; a mask net it trained but the override does not use is dropped.
    ``block_size`` (the backbone's, neck's and head's: a tile, ``dense`` or ``auto``): how the
    sparse network runs, in place of the checkpoint's - the detections are the same every way, only the time
    differs (the mask defines the function, :mod:`detector.nn.chain`)."""
    ckpt = load_checkpoint(ckpt_path)
    saved = ckpt.get("hyper_parameters", {}).get("config")
    if not saved:
        raise ConfigError(f"{ckpt_path}: checkpoint has no saved config (was it written by scripts/train.py?)")
    cfg = OmegaConf.create(current_layout(saved))
    if block_size is not None:
        block_size = check_setting(int(block_size) if str(block_size).isdigit() else block_size, "block_size")
        cfg.model.block_size = cfg.model.head_block_size = cfg.model.backbone.block_size = block_size
    if isinstance(mask_override, DictConfig):
        cfg.mask = mask_override
    elif mask_override is not None:
        from hydra import compose, initialize_config_dir

        with initialize_config_dir(str(config_dir()), version_base=None):
            cfg.mask = compose(config_name="train", overrides=[f"mask={mask_override}"]).mask
    if mask_override is not None and cfg.mask.get("net") is not None and (saved.get("mask") or {}).get("net"):
        cfg.mask.net = _trained_net(cfg.mask.net, saved["mask"]["net"], ckpt_path)
    grid = build_grid(cfg.bev)
    model = build_model(cfg.model, cfg.mask, grid)
    state = {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if any(k.startswith("mask_net.") for k in missing):
        raise ConfigError(f"mask: {ckpt_path} has no trained mask net (trained with mask={mask_name(saved['mask'])}); "
                          "evaluate it with its own mask, mask=ground or mask=none")
    bad = [k for k in (*missing, *unexpected) if not k.startswith("mask_net.")]
    if bad:
        raise ConfigError(f"{ckpt_path}: weights do not fit the saved model config: {bad[:5]}")
    return model, cfg


def mask_name(mask_cfg) -> str:
    if mask_cfg.get("net") is not None:
        return "predicted"
    p = mask_cfg.get("provider")
    return p["_target_"].rsplit(".", 1)[-1] if p is not None else "none"


# The settings of ``data`` that describe the dataset a checkpoint trained on: evaluation takes them from its saved
# config, where the command line does not set them; the others (batch size, workers, cache) are this run's.
