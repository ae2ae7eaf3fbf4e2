"""``train(cfg)`` and ``evaluate(cfg)``: plain functions; config reaches code only through instantiate here."""

from __future__ import annotations

import copy
import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.pytorch.callbacks import LearningRateMonitor
from omegaconf import DictConfig, OmegaConf, open_dict

from detector.build import build_grid, build_model, decode_kwargs, instantiate_checked, mask_name
from detector.callbacks import AtomicCheckpointIO, LastCheckpoint, init_from_checkpoint, load_checkpoint
from detector.config import check_types
from detector.data.datamodule import KittiDataModule
from detector.data.dataset import split_overlap
from detector.data.kitti import KittiRoot
from detector.data.lidar import open_root, root_layout
from detector.errors import ConfigError, KittiFormatError
from detector.eval.lidar_metric import missing_overlap_message, missing_overlaps, overlap_overrides
from detector.geometry.voxelize import BevGrid
from detector.models.detector import BevDetector
from detector.models.targets import anchor_overrides, missing_anchors
from detector.module import SCOPE, DetectorModule, frame_records, score_records, write_records
from detector.outputs import writable_dir

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------------
def ensure_dataset(data_cfg: DictConfig) -> None:
    """Generate the simulated sample where ``data.root`` does not exist or is an empty folder (and
    ``data.generate_if_missing``); never write into a root that holds anything: a split missing there is an error
    naming the file and the splits there are. Warn (one line) when a simulated root was written by another version
    of the simulator (:func:`detector.sim.writer.stale_sample`)."""
    root = Path(data_cfg.root).expanduser()
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        open_root(root, data_cfg.get("layout", "kitti")).imageset(data_cfg.train_split)  # else: names the others
        if (root / "sim.json").is_file():  # a simulated root: the simulator (and open3d, ~2 s) is imported for it only
            from detector.sim.writer import stale_sample

            if stale := stale_sample(root):
                log.warning(stale)
        return
    if not data_cfg.get("generate_if_missing", False):
        raise ConfigError(f"data.root={root}: no dataset there (data.generate_if_missing=false)")
    from detector.sim import generate_dataset

    log.info("dataset %s not found: generating %d simulated frames", root, data_cfg.generate_frames)
    generate_dataset(root, frames=int(data_cfg.generate_frames), seed=int(data_cfg.get("seed", 0)))
    KittiRoot(root).imageset(data_cfg.train_split)  # a split the sample does not write (train / val)


# Keys of the data config read by ensure_dataset (where the frames come from), not by the data module.
DATASET_KEYS = ("generate_if_missing", "generate_frames")


def build_datamodule(data_cfg: DictConfig, mask_cfg: DictConfig | None, grid: BevGrid, sparse: bool,
                     batch_size: int | None = None) -> KittiDataModule:
    provider = None
    if sparse and mask_cfg is not None and mask_cfg.get("provider") is not None:
        provider = instantiate(mask_cfg.provider)
    augment = instantiate(data_cfg.augment) if data_cfg.get("augment") else None
    node = {k: v for k, v in OmegaConf.to_container(data_cfg, resolve=True).items()
            if k not in ("augment", "memory_budget_mb", *DATASET_KEYS)}  # memory_budget_mb: batch_size=auto's
    extra = {} if batch_size is None else {"batch_size": batch_size}
    return instantiate(node, _partial_=True)(grid=grid, augment=augment, mask_provider=provider, **extra)


def validate_config(cfg: DictConfig) -> None:
    for key in ("trainer", "data", "optimizer", "scheduler", "bev", "model", "model.backbone", "model.coder"):
        node = OmegaConf.select(cfg, key)
        if isinstance(node, DictConfig):
            check_types(node, key, skip=("batch_size",) if key == "data" else ())
    bs = cfg.data.batch_size
    if not (bs == "auto" or (isinstance(bs, int) and not isinstance(bs, bool) and bs >= 1)):
        raise ConfigError(f"data.batch_size must be a positive integer or 'auto', got {bs!r}")
    nw = cfg.data.num_workers
    if isinstance(nw, bool) or not isinstance(nw, int) or nw < 0:
        raise ConfigError(f"data.num_workers must be an integer >= 0, got {nw!r}")
    bsz = cfg.model.block_size
    if not (bsz in ("auto", "dense") or (isinstance(bsz, int) and bsz >= 1) or OmegaConf.is_list(bsz)):
        raise ConfigError(f"model.block_size must be an int >= 1, auto, dense or a list, got {bsz!r}")
    hbs = cfg.model.head_block_size
    if not (hbs in ("auto", "dense") or (isinstance(hbs, int) and not isinstance(hbs, bool) and hbs >= 1)):
        raise ConfigError(f"model.head_block_size must be an int >= 1, auto or dense, got {hbs!r}")
    lr = cfg.optimizer.lr
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or lr <= 0:
        raise ConfigError(f"optimizer.lr must be a positive number, got {lr!r}")
    if not cfg.model.classes:
        raise ConfigError("model.classes must name at least one class")
    check_class_settings(cfg.model, cfg.data)
    if (schedule := OmegaConf.select(cfg, "mask.schedule")) is not None:
        instantiate_checked(schedule)  # MaskSchedule checks its values


def _plain(node: Any) -> Any:
    """A config node as plain containers (resolved); any other value as it is."""
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def check_class_settings(model_cfg: DictConfig, data_cfg: DictConfig) -> None:
    """Every class the model learns needs an anchor (``model.coder.anchors``, or a built-in one) and, on a LiDAR-only
    root, a minimum IoU for the scoring of validation and evaluation (``data.classes``). Checked before any work:
    one :class:`ConfigError` names all that is missing and the command-line overrides that add it (the same ones
    :class:`~detector.models.targets.BoxCoder` and the LiDAR-only metric name, each alone)."""
    classes = [str(c) for c in model_cfg.classes]
    anchors = _plain(OmegaConf.select(model_cfg, "coder.anchors"))
    overlaps = _plain(data_cfg.get("classes"))
    no_anchor = missing_anchors(classes, anchors)
    lidar = root_layout(str(data_cfg.root), data_cfg.get("layout", "kitti")) == "lidar"
    no_iou = missing_overlaps(classes, overlaps) if lidar else []
    if not (no_anchor or no_iou):
        return
    what = ([f"no anchor size for {', '.join(no_anchor)} (model.coder.anchors)"] if no_anchor else []) + (
        [f"no minimum IoU for {', '.join(no_iou)} (data.classes: a LiDAR-only root is scored with it)"] if no_iou
        else [])
    fix = anchor_overrides(no_anchor, anchors) + overlap_overrides(no_iou, overlaps)
    raise ConfigError(f"model.classes: {'; '.join(what)}: add {' '.join(fix)}"
                      + (" (l, w, h, z: the typical length, width, height and centre height, m)" if no_anchor else ""))


# --------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------
def train(cfg: DictConfig) -> dict[str, Any]:
    """Train, then (``evaluate_after``) evaluate the best checkpoint on the val split.

    Returns {"output_dir", "best_ckpt", "metrics", "wall_s", "fit_s", "evaluate_s", "plan"} (``plan``: the mean
    MACs / dense of the training steps' plans and their bound, :meth:`DetectorModule.plan_summary`)."""
    t_start = time.time()
    validate_config(cfg)
    out_dir = _run_folder(Path(cfg.paths.output_dir))
    print(f"output directory: {out_dir.resolve()}")
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    grid = build_grid(cfg.bev)
    ensure_dataset(cfg.data)
    _warn_split_overlap(cfg.data)
    model = build_model(cfg.model, cfg.mask, grid)
    if cfg.get("init_from"):  # a new run from a checkpoint's weights only (fine-tuning)
        print(init_from_checkpoint(model, cfg.init_from, resume=cfg.get("ckpt_path")).line())
    sparse = bool(cfg.model.sparse)
    _warn_unused_mask(cfg)
    if cfg.get("ckpt_path"):
        check_resume(cfg.ckpt_path, cfg, model)
    bs = cfg.data.batch_size
    if bs == "auto":
        from detector.batch_size import find_batch_size

        bs = find_batch_size(lambda b: build_datamodule(cfg.data, cfg.mask, grid, sparse, b), model,
                             budget_mb=cfg.data.get("memory_budget_mb"))
        print(f"data.batch_size=auto: using {bs}")
    dm = build_datamodule(cfg.data, cfg.mask, grid, sparse, bs)
    from detector.batch_size import probe_shares
    from detector.memory import estimate

    shares = probe_shares(model, lambda b: build_datamodule(cfg.data, cfg.mask, grid, sparse, b))
    print(estimate(model, bs, shares, train=True).describe() + " (detector/memory.py, from shapes)")
    config = OmegaConf.to_container(cfg, resolve=True)
    config["data"]["batch_size"] = bs
    if choices := _choices():
        config["choices"] = choices  # the config groups' options, to name them to a resume that differs
    scheduler = instantiate(cfg.scheduler) if cfg.get("scheduler") else None
    module = DetectorModule(model, instantiate(cfg.optimizer), scheduler, config=config,
                            decode=decode_kwargs(cfg.model), val_images=cfg.get("val_images", 4))
    callbacks = [instantiate(c) for c in cfg.get("callbacks", {}).values() if c is not None and "_target_" in c]
    logger = instantiate(cfg.logger) if cfg.get("logger") and "_target_" in cfg.logger else False
    if not logger:  # nothing to monitor the learning rate into
        callbacks = [c for c in callbacks if not isinstance(c, LearningRateMonitor)]
    trainer: L.Trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=logger, plugins=[AtomicCheckpointIO()])
    _check_train_batches(dm, bs, trainer)
    t_fit = time.time()
    trainer.fit(module, datamodule=dm, ckpt_path=cfg.get("ckpt_path"))
    result: dict[str, Any] = {"output_dir": str(out_dir), "best_ckpt": None, "metrics": None,
                              "fit_s": time.time() - t_fit, "plan": module.plan_summary(),
                              "skipped_frames": [fid for fid, _ in dm.dataset("train").skipped]}
    if result["skipped_frames"]:
        print(f"skipped {len(result['skipped_frames'])} bad training frame(s) (data.skip_bad_frames; their ids and "
              "reasons in the warnings above and in run.json)")
    # the best by the monitored metric, else the latest state (no metric: validation off); fast_dev_run saves none
    candidates = sorted(trainer.checkpoint_callbacks, key=lambda cb: isinstance(cb, LastCheckpoint))
    best = next((p for cb in candidates for p in (cb.best_model_path, cb.last_model_path) if p and Path(p).is_file()),
                "")
    result["best_ckpt"] = best or None
    if cfg.get("evaluate_after") and best and trainer.is_global_zero:
        t_eval = time.time()
        metrics = evaluate_checkpoint(best, cfg.data, out_dir / "eval", split=cfg.data.val_split)
        result["metrics"], result["evaluate_s"] = metrics, time.time() - t_eval
        if logger:
            flat = {f"final/{c}_{m}_R40_{lvl}": v for c, ms in metrics.items() if isinstance(ms, dict)
                    for m, r in ms.items() if isinstance(r, dict) and "R40" in r
                    for lvl, v in r["R40"].items()}
            logger.log_hyperparams(_flat_hparams(config), flat)
    result["wall_s"] = time.time() - t_start
    if trainer.is_global_zero:
        (out_dir / "run.json").write_text(json.dumps(result, indent=1))
    return result


def _warn_split_overlap(data_cfg: DictConfig) -> None:
    """One warning when the training and validation splits list frames in common: validation and the evaluation
    after training would score frames the model trained on. A split that is missing is the data module's error."""
    root = open_root(data_cfg.root, data_cfg.get("layout", "kitti"))
    try:
        line = split_overlap((data_cfg.train_split, root.imageset(data_cfg.train_split)),
                             (data_cfg.val_split, root.imageset(data_cfg.val_split)))
    except KittiFormatError:
        return
    if line:
        log.warning("data.root=%s: %s (data.train_split, data.val_split): validation and the evaluation after "
                    "training score frames the model trains on", data_cfg.root, line)


def _run_folder(out_dir: Path) -> Path:
    """``paths.output_dir``, writable and not holding another run's checkpoints (two runs in one folder would mix
    their checkpoints and ``run.json``). A DDP worker Lightning started shares its launcher's folder."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        ckpts = out_dir / "checkpoints"
        if (out_dir / "run.json").is_file() or (ckpts.is_dir() and any(ckpts.iterdir())):
            raise ConfigError(f"paths.output_dir={out_dir}: already holds a run (checkpoints/ or run.json): one "
                              "folder per run; choose a new folder (resume with ckpt_path=.../last.ckpt)")
    return writable_dir(out_dir, "paths.output_dir")


def _warn_unused_mask(cfg: DictConfig) -> None:
    """One warning when the command line chose a mask for a dense model, which computes every cell."""
    if cfg.model.sparse or not HydraConfig.initialized():
        return
    chosen = [o for o in HydraConfig.get().overrides.task if o.split("=", 1)[0].lstrip("+~") == "mask"]
    if chosen and chosen[-1].split("=", 1)[-1] not in ("none", "null"):
        log.warning("%s is not used: model=dense computes every cell (a mask needs model=sparse)", chosen[-1])


# The config groups whose settings shape the weights, for naming what differs from a checkpoint's.
_SHAPING = ("bev", "model", "mask")


def check_resume(ckpt_path: str | Path, cfg: DictConfig, model: BevDetector) -> None:
    """Before fitting: a checkpoint to resume from must hold tensors of this model's shapes. Otherwise one
    :class:`ConfigError` names the settings it was trained with that differ from this run's (e.g. its ``bev``)."""
    ckpt = load_checkpoint(ckpt_path)
    state = {k.removeprefix("model."): v for k, v in ckpt.get("state_dict", {}).items()}
    own = model.state_dict()
    bad = sorted(k for k in own.keys() | state.keys()
                 if k not in state or k not in own or tuple(state[k].shape) != tuple(own[k].shape))
    if not bad:
        return
    saved = (ckpt.get("hyper_parameters") or {}).get("config") or {}
    then_choices, now_choices = saved.get("choices") or {}, _choices()
    diffs = [f"{g}={then_choices[g]} (this run: {g}={now_choices[g]})" for g in _SHAPING
             if g in then_choices and g in now_choices and then_choices[g] != now_choices[g]]
    for group in _SHAPING:
        then, now = OmegaConf.select(OmegaConf.create(saved), group), OmegaConf.select(cfg, group)
        then = OmegaConf.to_container(then, resolve=False) if isinstance(then, DictConfig) else then
        now = OmegaConf.to_container(now, resolve=True) if isinstance(now, DictConfig) else now
        diffs += _differences(then, now, group)
    named = ", ".join(diffs[:6]) + (", ..." if len(diffs) > 6 else "") if diffs else f"tensors {', '.join(bad[:3])}"
    raise ConfigError(f"ckpt_path={ckpt_path}: its weights do not fit this run's model; it was trained with "
                      f"{named}: resume with the settings it was trained with")


def _choices() -> dict[str, str]:
    """The option chosen in each config group of this run (``bev: small`` ...), where Hydra composed it."""
    if not HydraConfig.initialized():
        return {}
    return {k: str(v) for k, v in HydraConfig.get().runtime.choices.items() if not k.startswith("hydra")}


def _differences(then: Any, now: Any, key: str) -> list[str]:
    """``key=<checkpoint's value> (this run: <value>)`` for each leaf where the two configs differ."""
    if isinstance(then, dict) and isinstance(now, dict):
        return [d for k in sorted(then.keys() | now.keys(), key=str)
                for d in _differences(then.get(k), now.get(k), f"{key}.{k}")]
    return [] if then == now else [f"{key}={then} (this run: {now})"]


def _check_train_batches(dm: KittiDataModule, batch_size: int, trainer: L.Trainer) -> None:
    """The training split must give at least one batch per process (training drops a last partial batch): else one
    :class:`ConfigError` says why (frames, skipped, batch size, processes)."""
    ds = dm.dataset("train")
    per_rank = len(ds) // max(trainer.world_size, 1)
    limit = trainer.limit_train_batches
    if per_rank // batch_size == 0 or limit == 0:
        why = ("trainer.limit_train_batches=0" if limit == 0 else
               f"{len(ds)} usable frame(s) in split '{ds.split}' of {dm.root}"
               + (f" ({len(ds.skipped)} skipped as bad)" if ds.skipped else "")
               + f" for data.batch_size={batch_size}"
               + (f" on {trainer.world_size} processes" if trainer.world_size > 1 else "")
               + " (a last partial batch is dropped)")
        raise ConfigError(f"no training batch: {why}")


def _flat_hparams(config: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat_hparams(v, key + "."))
        elif isinstance(v, (int, float, str, bool)) or v is None:
            out[key] = v if v is not None else "null"
        else:
            out[key] = str(v)
    return out


# --------------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------------
@torch.no_grad()
def evaluate_checkpoint(ckpt_path: str | Path, data_cfg: DictConfig, out_dir: str | Path, split: str,
                        mask_override: str | DictConfig | None = None, write_results: bool = True,
                        device: str | None = None, backend: str = "eager", block_size: int | str | None = None
                        ) -> dict[str, Any]:
    """Run a checkpoint over ``split`` of ``data_cfg.root`` with the checkpoint's decode settings (those
    validation used) through :class:`detector.predict.Predictor` (the code path predict and visualize run); print
    the table (KITTI's, or the LiDAR-only one) and, where the mask was empty or every AP is 0, one line saying what
    to check; write metrics.json and (``write_results``) the result files ``out_dir/data`` and the ground truth
    they were scored against ``out_dir/label_2`` (both filtered by :func:`detector.module.frame_records`, the
    translation validation uses): ``scripts/kitti_eval.py`` on the two folders prints the same table.
    ``block_size``: :func:`load_detector`'s. The plan's cost model is loaded (or calibrated)
    before the timed loop, so ``_run.time_ms_per_frame.plan`` holds the planning alone (``_run.plan_cost_model_ms``:
    the load).
    Returns the metric JSON."""
    from detector.predict import Predictor

    device = device or ("cuda" if torch.cuda.is_available() and backend == "eager" else "cpu")
    predictor, cfg = Predictor.from_checkpoint(ckpt_path, mask_override, device, block_size)
    model, sparse = predictor.model, bool(cfg.model.sparse)
    if backend != "eager":  # the exported network (detector/export.py), masked and decoded the same way
        predictor.use_backend(backend, sparse, Path(out_dir) / backend)
    data_cfg = data_cfg.copy()
    with open_dict(data_cfg):
        data_cfg.val_split = split
        data_cfg.augment = None
        data_cfg.batch_size = int(data_cfg.eval_batch_size or 4)
    dm = build_datamodule(data_cfg, cfg.mask, model.grid, sparse)
    classes = list(cfg.model.classes)
    lidar = dm.dataset("val").root.layout == "lidar"
    overlaps = _plain(data_cfg.get("classes"))
    if lidar and (missing := missing_overlaps(classes, overlaps)):  # before the frames run, not after
        raise ConfigError(missing_overlap_message(missing, overlaps))
    loader = dm.val_dataloader()
    out_dir = Path(out_dir)
    res_dir, gt_dir = out_dir / "data", out_dir / "label_2"
    if write_results:
        res_dir.mkdir(parents=True, exist_ok=True)
        gt_dir.mkdir(parents=True, exist_ok=True)
    records, sparsity, times = [], [], {}
    outside: list[str] = []  # labeled objects not scored (box centre outside the BEV grid): "frame name distance"
    n_frames = 0
    cost_model_s = predictor.calibrate_plan()
    t0 = time.perf_counter()
    model.timing = True
    for batch in loader:
        p = predictor.run(batch)
        sparsity.append(p.out.sparsity)
        for k, v in p.out.times.items():
            times[k] = times.get(k, 0.0) + v
        for r in frame_records(p.batch, p.dets, classes, model.grid):
            n_frames += 1
            if write_results:
                write_records(res_dir / f"{r.frame_id}.txt", r.dt)
            if r.gt is not None:
                if write_results:
                    write_records(gt_dir / f"{r.frame_id}.txt", r.gt)
                records.append(r)
            outside += r.outside_lines()
    wall = time.perf_counter() - t0
    if not records:
        raise KittiFormatError(dm.dataset("val").root.labels_dir,
                               f"no labels for split '{split}': evaluation needs label files")
    result, eval_classes, table = score_records(records, classes, dm.min_overlap)
    metrics = result.to_json()
    g = model.grid
    kept = SCOPE.removesuffix(" (DontCare kept)") if lidar else SCOPE  # a LiDAR-only root has no DontCare
    scope = f"{kept}: x [{g.x_range[0]}, {g.x_range[1]}) y [{g.y_range[0]}, {g.y_range[1]}) m"
    mean_sparsity = float(np.mean(sparsity)) if sparsity else 0.0
    heading = (f"LiDAR-only evaluation of {ckpt_path}: BEV and 3D AP, overall and by distance from the sensor (no "
               "camera: no DontCare, no difficulty levels)" if lidar else
               f"KITTI evaluation of {ckpt_path}: AP by KITTI difficulty level")
    print(f"\n{heading}\n{n_frames} frames of {data_cfg.root} split '{split}'; "
          f"mask {'none (dense)' if not sparse else mask_name(cfg.mask)}, "
          f"mean sparsity {mean_sparsity:.3f}; decode {decode_kwargs(cfg.model)}\nscored: {scope}")
    print(table)
    if outside:
        print(f"not scored: {len(outside)} labeled object(s) outside the BEV grid: {'; '.join(outside[:20])}"
              + (f"; ... ({len(outside) - 20} more in metrics.json)" if len(outside) > 20 else ""))
    if hint := _evaluation_hint(ckpt_path, cfg, result, mean_sparsity, eval_classes):
        print(f"hint: {hint}")
    if write_results and not lidar:
        print(f"the same table from the files: python scripts/kitti_eval.py gt={gt_dir} results={res_dir} "
              f"classes={','.join(eval_classes)}")
    summary = {"frames": n_frames, "ms_per_frame": 1000 * wall / max(n_frames, 1),
               "time_ms_per_frame": {k: 1000 * v / max(n_frames, 1) for k, v in times.items() if k != "start"},
               "plan_cost_model_ms": 1000 * cost_model_s,
               "mean_sparsity": mean_sparsity, "checkpoint": str(ckpt_path), "backend": backend,
               "scope": scope, "decode": decode_kwargs(cfg.model),
               "outside_grid": {"count": len(outside), "objects": outside}}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "metrics.json").write_text(json.dumps({**metrics, "_run": summary}, indent=1))
    print(f"metrics: {out_dir / 'metrics.json'}"
          + (f"; result files: {res_dir}; ground truth scored: {gt_dir}" if write_results else ""))
    return metrics


def _evaluation_hint(ckpt_path: str | Path, cfg: DictConfig, result: Any, mean_sparsity: float,
                     classes: Sequence[str]) -> str | None:
    """What to check when an evaluation found nothing: a computation mask that left (nearly) every cell out (mean
    sparsity 0.999 or more), every AP 0, or no labeled object of the scored classes in the grid; else None."""
    n_gt = int(sum(np.sum(n) for n in result.num_gt))
    if n_gt == 0:
        return (f"no labeled object of {', '.join(classes)} inside the BEV grid in these frames: check the split "
                "and that model.classes names classes of its labels")
    empty = mean_sparsity >= 0.999
    if not empty and any(v > 0 for v in _leaves(result.to_json())):
        return None
    step = load_checkpoint(ckpt_path).get("global_step", "?")
    if empty and cfg.mask.get("net") is not None:
        return (f"the computation mask was empty (mean sparsity {mean_sparsity:.3f}: no cell computed, nothing can be "
                f"found): the mask net predicted no foreground - try mask=none (the same weights, dense) or a lower "
                f"threshold (mask=predicted mask.net.threshold=0.2), or train longer (this checkpoint: step {step})")
    if empty:
        return (f"the computation mask was empty (mean sparsity {mean_sparsity:.3f}: no cell computed, nothing can be "
                f"found): the {mask_name(cfg.mask)} mask marked nothing in these frames - try mask=none (the same "
                "weights, dense)")
    return (f"every AP is 0: check that the model trained long enough (this checkpoint: step {step}), that "
            f"model.classes ({', '.join(cfg.model.classes)}) names the labels' classes, and the mask (mean sparsity "
            f"{mean_sparsity:.3f}; mask=none runs the same weights dense)")


def _leaves(node: Any) -> list[float]:
    """The numbers of a metric JSON."""
    if isinstance(node, dict):
        return [v for x in node.values() for v in _leaves(x)]
    return [float(node)]


CHECKPOINT_DATA = ("root", "layout", "classes", "ignore_classes", "train_split", "val_split", "test_split",
                   "fov_only", "skip_bad_frames")


def checkpoint_data(cfg: DictConfig, saved_data: dict) -> tuple[DictConfig, str, list[str]]:
    """The data settings and the split of ``evaluate``: the checkpoint's (:data:`CHECKPOINT_DATA` of its saved
    ``data``), except where the command line sets them, and eval.yaml's ``data`` for the rest. The command line sets
    a key by naming it (``data.root=DIR``, ``+data.classes.Forklift=0.6``, ``split=NAME``) or by choosing an option
    of the ``data`` group: the keys in which that option differs from eval.yaml's default one (``data=lidar``: the
    LiDAR-only layout, its root - unless ``data.root`` is given -, no camera cut, its class names and ignored names).
    A mapping given for ``data.classes`` adds to the checkpoint's (its other classes keep their IoUs). The split:
    ``split=``, else the checkpoint's ``val_split`` (or the command line's ``data.val_split``). A config composed
    in code (no Hydra run) is taken as it is. Returns (data config, split, the keys the command line set)."""
    given = _command_line_data_keys()
    if given is None:
        return cfg.data, cfg.split, []
    data = OmegaConf.to_container(cfg.data, resolve=True)
    for key in CHECKPOINT_DATA:
        if key not in saved_data:
            continue
        value = copy.deepcopy(saved_data[key])
        for path in sorted(p for p in given if p == key or p.startswith(key + ".")):
            value = _put(value, path.split(".")[1:], _plain(OmegaConf.select(cfg.data, path)))
        data[key] = value
    split = cfg.split if "split" in given else data["val_split"]
    return OmegaConf.create(data), split, sorted(given)


def _command_line_data_keys() -> set[str] | None:
    """The keys of ``data`` (and ``split``) this Hydra run's command line sets (:func:`checkpoint_data`); None
    without a Hydra run."""
    if not HydraConfig.initialized():
        return None
    from hydra import compose
    from hydra.core.override_parser.overrides_parser import OverridesParser

    keys: set[str] = set()
    for o in OverridesParser.create().parse_overrides(list(HydraConfig.get().overrides.task)):
        key = o.key_or_group
        if key == "split" or key.startswith("data."):
            keys.add(key.removeprefix("data."))
        elif key == "data" and isinstance(o.value(), str):
            name = HydraConfig.get().job.config_name
            chosen = compose(name, overrides=[f"data={o.value()}"]).data
            keys |= set(_changed(_plain(compose(name).data), _plain(chosen), ""))
    return keys


def _changed(then: Any, now: Any, key: str) -> list[str]:
    """The dotted keys at which two plain configs differ (a node that is a mapping on one side only: its key)."""
    if isinstance(then, dict) and isinstance(now, dict):
        return [d for k in then.keys() | now.keys() for d in _changed(then.get(k), now.get(k), f"{key}{k}.")]
    return [] if then == now else [key.rstrip(".")]


def _put(node: Any, path: list[str], value: Any) -> Any:
    """``node`` with ``value`` at ``path`` (a mapping at the end merged into a mapping there)."""
    if not path:
        return {**node, **value} if isinstance(node, dict) and isinstance(value, dict) else value
    node = dict(node) if isinstance(node, dict) else {}
    node[path[0]] = _put(node.get(path[0]), path[1:], value)
    return node


def evaluate(cfg: DictConfig) -> dict[str, Any]:
    """``scripts/evaluate.py``: the checkpoint on the split it was validated on, with the data settings it trained
    with (:func:`checkpoint_data`: the command line's where it gives them). Says which split of which root it
    evaluates, and warns (one line) when those frames are also in the split the checkpoint trained on."""
    out_dir = Path(cfg.paths.output_dir)
    print(f"output directory: {out_dir.resolve()}")
    saved_data = (load_checkpoint(cfg.ckpt_path).get("hyper_parameters") or {}).get("config", {}).get("data") or {}
    data_cfg, split, given = checkpoint_data(cfg, saved_data)
    layout = data_cfg.get("layout", "kitti")
    try:  # clear error when the root is missing, or of the other kind
        root = open_root(data_cfg.root, layout)
    except KittiFormatError:
        if root_layout(data_cfg.root, layout) == "kitti" and root_layout(data_cfg.root) == "lidar":
            source = "given" if "layout" in given else "the checkpoint's"
            raise ConfigError(f"data.root={data_cfg.root} is a LiDAR-only root (points/, labels/), read as a "
                              f"KITTI-format one (data.layout=kitti, {source}): add data=lidar") from None
        raise
    told = sorted({g.split(".")[0] for g in given} & {*CHECKPOINT_DATA, "split"})
    print(f"evaluating split '{split}' of {data_cfg.root} (layout {root.layout}) with the data settings the "
          "checkpoint trained with" + (f"; from the command line: {', '.join(told)}" if told else ""))
    _warn_trained_frames(root, split, saved_data)
    # ``mask=<name>`` on the command line selects eval.yaml's optional mask group (None: the checkpoint's).
    return evaluate_checkpoint(cfg.ckpt_path, data_cfg, out_dir, split=split, mask_override=cfg.get("mask"),
                               write_results=cfg.write_results, backend=cfg.get("backend", "eager"),
                               block_size=cfg.get("block_size"))


def _warn_trained_frames(root: Any, split: str, saved_data: dict) -> None:
    """One warning when the evaluated split of ``root`` shares frames with the split the checkpoint trained on
    (the same root)."""
    trained, train_split = saved_data.get("root"), saved_data.get("train_split")
    if not trained or not train_split or Path(str(trained)).expanduser().resolve() != root.root.resolve():
        return
    try:
        line = split_overlap((train_split, root.imageset(train_split)), (split, root.imageset(split)))
    except KittiFormatError:
        return
    if line:
        log.warning("%s: %s: the checkpoint trained on split '%s' of this root, so these scores include frames it "
                    "learnt", root.root, line, train_split)
