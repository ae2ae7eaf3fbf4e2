"""A checkpoint run on frames, and its detections as files: what evaluation, ``detector-predict`` and
``detector-visualize`` run.

The frames are collated as the data pipeline collates them (:func:`~detector.data.structures.collate_frames`), get
the data-side computation mask of the checkpoint's mask config (ground plane, road map) as the loader gives it,
and are decoded with the checkpoint's decode settings (:func:`detector.build.decode_kwargs`); a point cloud is cut
to the camera's view as the checkpoint's were in training (:meth:`Predictor.camera_view`); KITTI result records
come from :func:`detector.module.frame_records`, the translation evaluation writes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from detector.data.structures import Batch, Detections, Frame, collate_frames
from detector.models.detector import BevDetector, DetectorOutput

# the box fields of a detection, as predict's JSON and text files give them (LiDAR frame: x forward, y left, z up;
# (x, y, z) the box centre, l along the heading, w across, h vertical, yaw about +z from +x)
BOX_FIELDS = ("x", "y", "z", "l", "w", "h", "yaw")


@dataclass
class Prediction:
    """A batch as the model saw it, its raw output (``out.mask``: the computation mask, None when dense) and its
    decoded detections, one per frame."""

    batch: Batch
    out: DetectorOutput
    dets: list[Detections]


class Predictor:
    """A detector ready to run: THE code path that runs a checkpoint, for evaluation
    (:func:`detector.tasks.evaluate_checkpoint`), ``detector-predict`` and ``detector-visualize`` alike - a batch's
    data-side computation mask, the batch to the device, the network, the decoding.

    Args:
        model: the detector (put in eval mode here).
        decode: the decode settings (score_threshold, nms_iou, max_detections).
        mask_provider: a data-side mask (``(batch, grid) -> MaskResult``) or None (dense, or the model's mask net).
        device: where the model runs.
        fov_only: whether the checkpoint saw its points cut to the camera's view (:meth:`camera_view`).
    """

    def __init__(self, *, model: BevDetector, decode: dict[str, Any], mask_provider=None,
                 device: str | torch.device = "cpu", fov_only: bool = True):
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.decode = dict(decode)
        self.mask_provider = mask_provider
        self.fov_only = bool(fov_only)
        self.forward: Callable[[Batch], DetectorOutput] = self.model  # the network: the model, or an exported one

    @classmethod
    def from_config(cls, model: BevDetector, cfg, device: str | torch.device = "cpu") -> Predictor:
        """The detector with the decode settings, data-side mask and camera cut of its config (as
        :func:`detector.build.load_detector` returns them: the checkpoint's, or a ``mask=`` override)."""
        from hydra.utils import instantiate

        from detector.build import decode_kwargs

        provider = None
        if cfg.model.sparse and cfg.mask.get("provider") is not None:
            provider = instantiate(cfg.mask.provider)
        return cls(model=model, decode=decode_kwargs(cfg.model), mask_provider=provider, device=device,
                   fov_only=trained_fov_only(cfg.get("data")))

    @classmethod
    def from_checkpoint(cls, ckpt_path: str | Path, mask: str | Any | None = None, device: str | None = None,
                        block_size: int | str | None = None) -> tuple[Predictor, Any]:
        """``(predictor, config)`` of a checkpoint (weights_only); ``mask``: a mask config (or its name) in place of
        the checkpoint's; ``device`` None: CUDA where available, else the CPU; ``block_size``:
        how the sparse network runs, in place of the checkpoint's (:func:`detector.build.load_detector`)."""
        from detector.build import load_detector

        model, cfg = load_detector(ckpt_path, mask, block_size)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        return cls.from_config(model, cfg, device), cfg

    def use_backend(self, backend: str, sparse: bool, out_dir: str | Path) -> None:
        """Run the network through ``backend`` (``export``: a torch.export program, ``onnx``: onnxruntime;
        :func:`detector.export.exported_forward` exports it into ``out_dir`` first) on the CPU; the mask and the
        decoding stay as they are."""
        from detector.export import exported_forward

        self.forward = exported_forward(self.model, sparse, backend, out_dir)
        self.device = torch.device("cpu")

    @property
    def classes(self) -> list[str]:
        return list(self.model.coder.classes)

    @property
    def grid(self):
        return self.model.grid

    def camera_view(self, points: np.ndarray, calib, image_size: tuple[int, int] | None = None) -> np.ndarray:
        """The points of a cloud as the checkpoint saw them in training: cut to the camera's view
        (:func:`detector.data.dataset.camera_view`) where it trained so (``data.fov_only`` on a KITTI-format root);
        every point where it did not (a LiDAR-only root, ``data.fov_only=false``) or without a calibration."""
        from detector.data.dataset import camera_view

        return camera_view(points, calib, image_size) if self.fov_only else points

    def calibrate_plan(self) -> float:
        """Load (or measure, about a second) the plan's cost model for this device now, where the model plans per
        batch (``block_size=auto``), so that no timed batch pays for it: seconds spent (0: nothing to load)."""
        from detector.nn.plan import AUTO

        model = self.model
        masked = model.mask_net is not None or (model.use_data_mask and self.mask_provider is not None)
        if not masked or AUTO not in model.settings():  # dense: no plan
            return 0.0
        t0 = time.perf_counter()
        model.backbone.planner.cost_model(self.device, torch.float32)
        return time.perf_counter() - t0

    @torch.no_grad()
    def run(self, batch: Batch) -> Prediction:
        """Detections of a collated batch: its data-side mask (unless the loader made it), on the device, the network,
        the decoding (detections on the CPU). Raises ValueError naming the frame where the mask needs what it lacks
        (e.g. a road map)."""
        if self.mask_provider is not None and batch.mask is None:
            batch.mask = self.mask_provider(batch, self.grid).mask
        batch = batch.to(self.device)
        out = self.forward(batch)
        dets = [d.to("cpu") for d in self.model.decode(out, **self.decode)]
        return Prediction(batch, out, dets)

    def __call__(self, frames: Sequence[Frame]) -> Prediction:
        """Detections of the frames (:meth:`run` on their batch)."""
        return self.run(collate_frames(frames))


def trained_fov_only(data_cfg) -> bool:
    """Whether a checkpoint's points were cut to the camera's view in training: its ``data.fov_only`` (default
    true), on a KITTI-format root - a LiDAR-only one has no camera (``data.layout``: lidar, or auto on a root with a
    ``points/`` folder)."""
    from detector.data.lidar import root_layout

    if data_cfg is None:
        return True
    layout = root_layout(str(data_cfg.get("root")), data_cfg.get("layout", "kitti"))
    return bool(data_cfg.get("fov_only", True)) and layout != "lidar"


def box_dicts(dets: Detections, classes: Sequence[str]) -> list[dict[str, Any]]:
    """The detections as ``{"x", "y", "z", "l", "w", "h", "yaw", "class", "score"}`` records (metres, radians),
    highest score first."""
    order = torch.argsort(dets.scores, descending=True, stable=True)
    boxes = dets.boxes.tensor[order].double().tolist()
    return [{**dict(zip(BOX_FIELDS, (round(v, 4) for v in b), strict=True)), "class": classes[int(c)],
             "score": round(float(s), 4)}
            for b, c, s in zip(boxes, dets.labels[order].tolist(), dets.scores[order].tolist(), strict=True)]


def openpcdet_lines(records: Sequence[dict[str, Any]]) -> list[str]:
    """OpenPCDet's custom-dataset label lines, ``x y z dx dy dz heading class``, with the score appended (LiDAR
    frame; (x, y, z) the box centre)."""
    return [" ".join(f"{r[k]:.4f}" for k in BOX_FIELDS) + f" {r['class']} {r['score']:.4f}" for r in records]
