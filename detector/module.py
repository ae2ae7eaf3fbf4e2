"""The LightningModule: training and validation steps around the plain :class:`BevDetector`."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.distributed as dist

from detector.data.kitti_camera import boxes_to_labels, labels_to_boxes
from detector.data.kitti_labels import IMAGE_SIZE, KittiLabels, as_written, write_label
from detector.data.lidar_labels import LidarLabels, write_lidar_label
from detector.data.structures import Batch, Detections, Frame
from detector.models.detector import BevDetector

SCOPE = "ground truth and detections whose box centre lies inside the BEV grid (DontCare kept)"


@dataclass
class FrameRecords:
    """One frame's KITTI records as the metric sees them and as the files hold them: ``gt`` None for a
    frame without labels (e.g. the testing split). ``outside``: the labeled objects (DontCare excluded)
    left out of ``gt`` because their box centre lies outside the BEV grid (reported, not scored). A LiDAR-only
    frame's records are :class:`LidarLabels` (LiDAR frame; its own files, :func:`write_records`)."""

    frame_id: str
    gt: KittiLabels | LidarLabels | None
    dt: KittiLabels | LidarLabels
    outside: KittiLabels | LidarLabels | None = None

    def outside_lines(self) -> list[str]:
        """``"frame name distance"`` of each object of ``outside`` (BEV distance from the sensor)."""
        o = self.outside
        if o is None:
            return []
        d = np.hypot(o.boxes[:, 0], o.boxes[:, 1]) if isinstance(o, LidarLabels) else \
            np.hypot(o.location[:, 0], o.location[:, 2])
        return [f"{self.frame_id} {name} {x:.1f} m" for name, x in zip(o.name, d, strict=True)]


def write_records(path, records: KittiLabels | LidarLabels) -> None:
    """A frame's records as a file: KITTI's label/result format, or the LiDAR-only one (detector.data.lidar)."""
    if isinstance(records, LidarLabels):
        write_lidar_label(path, records)
    else:
        write_label(path, records)


def _inside(x: np.ndarray, y: np.ndarray, grid) -> np.ndarray:
    return (x >= grid.x_range[0]) & (x < grid.x_range[1]) & (y >= grid.y_range[0]) & (y < grid.y_range[1])


def frame_records(batch: Batch, dets: Sequence[Detections], classes: Sequence[str], grid) -> list[FrameRecords]:
    """THE translation of a batch's predictions and ground truth into KITTI records, used by validation
    (``DetectorModule.validation_step``) and evaluation (``tasks.evaluate_checkpoint``) alike.

    Detections → result records (camera frame, 2D box projected with P2 and clipped, alpha, score). Both
    sides are filtered the same way: records whose box centre lies inside the BEV grid (what the detector
    can see, as in PIXOR's evaluation; DontCare regions kept). Both are returned exactly as the KITTI
    files written from them read back (:func:`as_written`), so the result and label files give the same
    AP as the records in memory.
    """
    out = []
    for f, d in zip(batch.frames, dets, strict=True):
        if f.calib is None:
            out.append(_lidar_records(f, d, classes, grid))
            continue
        d = d.to("cpu")
        names = np.asarray(classes)[d.labels.numpy()] if len(d) else np.zeros(0, "<U16")
        boxes = d.boxes.to("cpu", torch.float64)
        res = boxes_to_labels(boxes, names, f.calib, scores=d.scores.numpy(), image_size=f.image_size or IMAGE_SIZE)
        xy = boxes.tensor[:, :2].numpy()
        res = as_written(res.select(_inside(xy[:, 0], xy[:, 1], grid)), f"frame {f.frame_id} detections")
        gt = outside = None
        if f.labels is not None:
            lab = f.labels
            obj = lab.name != "DontCare"
            xy = np.zeros((len(lab), 2))
            xy[obj] = labels_to_boxes(lab.select(obj), f.calib).tensor[:, :2].double().numpy()
            keep = ~obj | _inside(xy[:, 0], xy[:, 1], grid)
            gt = as_written(lab.select(keep), f"frame {f.frame_id} labels")
            outside = lab.select(~keep)
        out.append(FrameRecords(f.frame_id, gt, res, outside))
    return out


def _lidar_records(f: Frame, d: Detections, classes: Sequence[str], grid) -> FrameRecords:
    """A LiDAR-only frame's records: the LiDAR-frame boxes, filtered like KITTI's by the box centre (the file
    writer keeps every float64 digit, so the files read back as these records)."""
    d = d.to("cpu")
    names = np.asarray(classes)[d.labels.numpy()] if len(d) else np.zeros(0, "<U16")
    res = LidarLabels(d.boxes.tensor.double().numpy(), names, d.scores.double().numpy())
    res = res.select(_inside(res.boxes[:, 0], res.boxes[:, 1], grid))
    gt = outside = None
    if f.labels is not None:
        keep = _inside(f.labels.boxes[:, 0], f.labels.boxes[:, 1], grid)
        gt, outside = f.labels.select(keep), f.labels.select(~keep)
    return FrameRecords(f.frame_id, gt, res, outside)


def score_records(records: Sequence[FrameRecords], classes: Sequence[str],
                  min_overlap: Mapping[str, float] | None = None) -> tuple[Any, list[str], str]:
    """THE scoring of validation and evaluation: ``(result, classes scored, table text)``. KITTI records: the
    KITTI metric (Car / Pedestrian / Cyclist of ``classes``, plus any other class given a minimum IoU in
    ``min_overlap``); LiDAR-only records: BEV and 3D AP overall and by distance band, every class of
    ``classes``, each with its minimum IoU from ``min_overlap`` (protocol L1-L4)."""
    from detector.eval.kitti_metric import evaluate
    from detector.eval.lidar_metric import evaluate_lidar, lidar_table
    from detector.eval.protocol import EVAL_CLASSES, MIN_OVERLAP

    gts, dts = [r.gt for r in records], [r.dt for r in records]
    if records and isinstance(records[0].gt, LidarLabels):
        overlaps = dict(min_overlap) if min_overlap is not None else dict(MIN_OVERLAP)
        result = evaluate_lidar(gts, dts, overlaps, classes)
        return result, list(classes), lidar_table(result)
    extra = dict(min_overlap or {})
    eval_classes = [c for c in classes if c in EVAL_CLASSES or c in extra]
    result = evaluate(gts, dts, classes=eval_classes, min_overlap=extra or None)
    return result, eval_classes, result.table()


def gather_records(records: list[FrameRecords]) -> list[FrameRecords]:
    """All processes' validation records (DDP: ``all_gather_object``), each frame once: the distributed
    sampler pads the last batch by repeating frames. Order: rank 0's records, then rank 1's, ..."""
    if dist.is_available() and dist.is_initialized():
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, records)
        records = [r for part in gathered for r in part]
    seen, unique = set(), []
    for r in records:
        if r.frame_id not in seen:
            seen.add(r.frame_id)
            unique.append(r)
    return unique


def log_pr_curves(exp, result, classes: Sequence[str], level: str, step: int) -> None:
    """TensorBoard's ``val/pr_<class>_bev_<level>``: BEV precision against recall at the metric's own score thresholds
    (the counts its matching found, :class:`detector.eval.matching.LevelCounts`, the points its AP comes from), the
    lowest threshold first as TensorBoard orders them. ``exp``: a SummaryWriter; ``result``: the metric's result. A
    class with fewer than two thresholds (under two true positives) has no curve yet."""
    for cls in classes:
        counts = result.counts.get((cls, "bev", level))
        if counts is None or counts.thresholds.size < 2 or counts.n_gt == 0:
            continue
        precision, _ = counts.curves()
        tp, fp, fn = (np.asarray(a, np.float64)[::-1] for a in (counts.tp, counts.fp, counts.fn))
        exp.add_pr_curve_raw(f"val/pr_{cls}_bev_{level}", tp, fp, np.zeros_like(tp), fn, precision[::-1],
                             tp / counts.n_gt, step, num_thresholds=counts.thresholds.size)


class DetectorModule(L.LightningModule):
    """Holds the detector; the optimizer and schedule come from config as partials.

    ``optimizer``: ``params -> Optimizer``; ``scheduler``: ``(optimizer, total_steps) -> LRScheduler``
    stepped every optimizer step (one-cycle by default). ``decode``: the decode settings
    (score_threshold, nms_iou, max_detections; ``build.decode_kwargs``), the same evaluation uses.
    ``val_images``: TensorBoard gets the bird's-eye views (:func:`detector.viz.bev_image`) of this many validation
    frames - the first ones of the val split, the same every validation - each ``image_every_n_val``-th validation,
    and a precision-recall curve per scored class every validation.
    """

    def __init__(
        self,
        model: BevDetector,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., Any] | None = None,
        eval_classes: Sequence[str] | None = None,
        image_every_n_val: int = 1,
        config: dict | None = None,
        decode: Mapping[str, Any] | None = None,
        val_images: int = 4,
    ):
        super().__init__()
        self.model = model
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.classes = list(model.coder.classes)
        self.eval_classes = list(eval_classes or [c for c in self.classes if c in ("Car", "Pedestrian", "Cyclist")])
        self.image_every_n_val = max(1, int(image_every_n_val))
        self.val_images = max(0, int(val_images))
        self.decode_kwargs = dict(decode or {})
        # The resolved config goes into the checkpoint as plain containers (loadable with weights_only).
        self.save_hyperparameters({"config": config or {}}, logger=False)
        self._val_records: list[FrameRecords] = []
        self._val_frames: list[tuple[Frame, Detections, torch.Tensor | None]] = []
        self._validations = 0  # validation epochs run (sanity checks not counted)
        self.last_metrics: dict | None = None
        self._plan_macs = [0, 0.0, 0.0]  # training steps with a plan, sum of mac_ratio, sum of mac_bound

    # --- data -------------------------------------------------------------------------------------
    def transfer_batch_to_device(self, batch: Batch, device: torch.device, dataloader_idx: int) -> Batch:
        return batch.to(device)

    # --- steps ------------------------------------------------------------------------------------
    def forward(self, batch: Batch):
        return self.model(batch)

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        t0 = time.perf_counter()
        self.model.timing = True
        out = self.model(batch, step=self.global_step)
        loss, logs = self.model.loss(out, batch)
        B = batch.size
        if self._logged_step():
            self.log_dict({f"train/{k}": v for k, v in logs.items()}, batch_size=B, prog_bar=False)
            self.log("train/loss", loss.detach(), batch_size=B, prog_bar=True)
            self.log("train/mask_sparsity", out.sparsity, batch_size=B)
            if "backbone" in out.times:
                self.log("train/backbone_ms_per_frame", 1000 * out.times["backbone"] / B, batch_size=B)
            self.log("train/step_forward_ms", 1000 * (time.perf_counter() - t0), batch_size=B)
        self._log_plan(out)
        return loss

    def _logged_step(self) -> bool:
        """Whether Lightning writes this training step's values (every ``log_every_n_steps`` and when
        stopping); it drops the others, but each ``self.log`` call still costs its time, and a step logs over a dozen
        scalars - a visible share of a small CPU step (docs/speed.md)."""
        t = self.trainer
        return t.should_stop or (self.global_step + 1) % max(1, t.log_every_n_steps) == 0

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self.model.timing = True
        out = self.model(batch)
        dets = self.model.decode(out, **self.decode_kwargs)
        B = batch.size
        self.log("val/mask_sparsity", out.sparsity, batch_size=B, sync_dist=True)
        self._log_mask_quality(out, batch)
        for k in ("backbone", "voxelize", "mask", "head", "decode", "network"):  # network: the capacity path's graph
            if k in out.times:
                self.log(f"val/time_{k}_ms_per_frame", 1000 * out.times[k] / B, batch_size=B, sync_dist=True)
        records = frame_records(batch, dets, self.classes, self.model.grid)
        self._val_records += [r for r in records if r.gt is not None]
        for i in range(min(B, self.val_images - len(self._val_frames))):  # the loader's first frames: fixed
            self._val_frames.append((batch.frames[i], dets[i].to("cpu"),
                                     None if out.mask is None else out.mask[i, 0].cpu()))

    def _log_mask_quality(self, out, batch: Batch) -> None:
        """val/mask_recall and val/mask_boxes_covered (weighted by boxes: the epoch value is the mean over all
        boxes) and val/tiles_active_s{1,2,4,8,16} (weighted by frames) - detector/models/mask_quality.py."""
        if out.mask is None:
            return
        from detector.models.mask_quality import class_boxes, mask_quality

        q = mask_quality(out.mask, class_boxes(batch.gt_boxes, batch.gt_names, self.classes), self.model.grid)
        n = int(q.pop("n_boxes"))
        if n:
            for k in ("mask_recall", "mask_boxes_covered"):
                self.log(f"val/{k}", q[k], batch_size=n, sync_dist=True)
        for k in [k for k in q if k.startswith("tiles_active")]:
            self.log(f"val/{k}", q[k], batch_size=batch.size, sync_dist=True)

    def _log_plan(self, out) -> None:
        """The execution plan: plan/<stage> scalars (tile, 0 = dense) and each new plan once as text."""
        if out.plan is None:
            return
        if self._logged_step():
            self.log_dict(out.plan.as_scalars(), batch_size=1)
        if out.plan.macs:
            self._plan_macs = [self._plan_macs[0] + 1, self._plan_macs[1] + out.plan.mac_ratio(),
                               self._plan_macs[2] + out.plan.mac_bound()]
        exp = getattr(self.logger, "experiment", None)
        for plan in self.model.backbone.planner.take_new():
            if exp is not None and hasattr(exp, "add_text") and self.trainer.is_global_zero:
                exp.add_text("plan", "```\n" + plan.describe() + "\n```", self.global_step)

    def plan_summary(self) -> dict[str, float] | None:
        """Mean over this process's training steps of the plan's MACs / dense and of its bound (None without
        a plan): what the active tiles and halos let the convolutions save."""
        n, ratio, bound = self._plan_macs
        return {"steps": n, "mac_ratio": ratio / n, "mac_bound": bound / n} if n else None

    def scored_classes(self, lidar: bool, min_overlap: Mapping[str, float] | None) -> list[str]:
        """The classes validation scores: on a LiDAR-only root (``lidar``) or with ``data.classes`` given
        (``min_overlap``) the model's classes, else KITTI's three among them (with any other class given a minimum
        IoU: :func:`score_records`)."""
        from detector.eval.protocol import EVAL_CLASSES

        if lidar:
            return list(self.classes)
        classes = self.classes if min_overlap else self.eval_classes
        return [c for c in classes if c in EVAL_CLASSES or c in (min_overlap or {})]

    def monitor_key(self, lidar: bool, min_overlap: Mapping[str, float] | None) -> str | None:
        """The metric ``callbacks.model_checkpoint.monitor=auto`` stands for: the BEV AP R40 of the first class
        validation scores, at KITTI's moderate difficulty (a KITTI root) or overall (a LiDAR-only root, which has no
        difficulty levels); None where validation scores no class."""
        scored = self.scored_classes(lidar, min_overlap)
        return f"val/AP_{scored[0]}_bev_R40_{'overall' if lidar else 'moderate'}" if scored else None

    def on_validation_epoch_start(self) -> None:
        self._val_records = []
        self._val_frames = []

    def on_validation_epoch_end(self) -> None:
        unique = gather_records(self._val_records)
        self._val_records = []
        if not unique:
            return
        lidar = isinstance(unique[0].gt, LidarLabels)
        # a LiDAR-only root's classes are the model's, scored with the data's minimum IoUs (data.classes)
        min_overlap = getattr(getattr(self.trainer, "datamodule", None), "min_overlap", None)
        result, eval_classes, _ = score_records(unique, self.scored_classes(lidar, min_overlap), min_overlap)
        metrics = result.to_json()
        self.last_metrics = metrics
        flat = {}
        for cls in eval_classes:
            for metric in ("bev", "3d", "2d", "aos"):
                for level in (*result.levels, *result.distance_levels) if lidar else ("easy", "moderate", "hard"):
                    v = metrics.get(cls, {}).get(metric, {}).get("R40", {}).get(level)
                    if v is None:
                        v = metrics.get("distance", {}).get(cls, {}).get(metric, {}).get("R40", {}).get(level)
                    if v is not None:
                        flat[f"val/AP_{cls}_{metric}_R40_{level}"] = float(v)
        if flat:
            self.log_dict(flat, sync_dist=False, rank_zero_only=True)
        if self.trainer.sanity_checking or not self.trainer.is_global_zero:
            return
        exp = getattr(self.logger, "experiment", None) if self.logger is not None else None
        if exp is not None and hasattr(exp, "add_pr_curve_raw"):
            log_pr_curves(exp, result, eval_classes, "overall" if lidar else "moderate", self.global_step)
        if exp is not None and hasattr(exp, "add_image") and self._validations % self.image_every_n_val == 0:
            for frame, dets, mask in self._val_frames:
                self._log_bev_image(exp, frame, dets, mask)
        self._val_frames = []
        self._validations += 1

    def _log_bev_image(self, exp, frame: Frame, dets: Detections, mask: torch.Tensor | None) -> None:
        """val/bev/<frame id>: the frame's points, computation mask, ground truth and detections (those scored at
        least bev_image's default threshold), with their classes and scores."""
        from detector.viz import bev_image

        names = np.asarray(self.classes)[dets.labels.numpy()] if len(dets) else []
        img = bev_image(frame.points, self.model.grid, gt_boxes=frame.gt_boxes, gt_names=frame.gt_names,
                        det_boxes=dets.boxes, det_scores=dets.scores, det_names=names, mask=mask,
                        title=f"frame {frame.frame_id}")
        exp.add_image(f"val/bev/{frame.frame_id}", img, self.global_step, dataformats="HWC")

    # --- checkpoints ------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The execution plan's cost models go with the weights: a resumed run plans as the run it continues."""
        state = self.model.backbone.planner.state()
        if state:
            checkpoint["plan_cost"] = state

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if checkpoint.get("plan_cost"):
            self.model.backbone.planner.restore(checkpoint["plan_cost"])

    # --- optimization -----------------------------------------------------------------------------
    def configure_optimizers(self):
        opt = self.optimizer_factory(params=[p for p in self.parameters() if p.requires_grad])
        if self.scheduler_factory is None:
            return opt
        # +1: Lightning may step the schedule once after the last optimizer step
        sched = self.scheduler_factory(optimizer=opt, total_steps=int(self.trainer.estimated_stepping_batches) + 1)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
