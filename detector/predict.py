"""A checkpoint run on frames, and its detections as files: what ``detector-predict`` and ``detector-visualize`` use.

The frames are collated as the data pipeline collates them (:func:`~detector.data.structures.collate_frames`), get
the data-side computation mask of the checkpoint's mask config (ground plane, road map) as the loader gives it,
and are decoded with the checkpoint's decode settings (:func:`detector.tasks.decode_kwargs`), as evaluation does;
KITTI result records come from :func:`detector.module.frame_records`, the translation evaluation writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    """A detector ready to run on frames.

    Args:
        model: the detector (put in eval mode here).
        decode: the decode settings (score_threshold, nms_iou, max_detections).
        mask_provider: a data-side mask (``(batch, grid) -> MaskResult``) or None (dense, or the model's mask net).
        device: where the model runs.
    """

    def __init__(self, *, model: BevDetector, decode: dict[str, Any], mask_provider=None,
                 device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.decode = dict(decode)
        self.mask_provider = mask_provider

    @classmethod
    def from_config(cls, model: BevDetector, cfg, device: str | torch.device = "cpu") -> Predictor:
        """The detector with the decode settings and data-side mask of its config (as
        :func:`detector.tasks.load_detector` returns them: the checkpoint's, or a ``mask=`` override)."""
        from hydra.utils import instantiate

        from detector.tasks import decode_kwargs

        provider = None
        if cfg.model.sparse and cfg.mask.get("provider") is not None:
            provider = instantiate(cfg.mask.provider)
        return cls(model=model, decode=decode_kwargs(cfg.model), mask_provider=provider, device=device)

    @classmethod
    def from_checkpoint(cls, ckpt_path: str | Path, mask: str | None = None, device: str | None = None,
                        inference_path: str | None = None) -> tuple[Predictor, Any]:
        """``(predictor, config)`` of a checkpoint (weights_only); ``mask``: a mask config name in place of the
        checkpoint's; ``device`` None: CUDA where available, else the CPU; ``inference_path``: in place of the
        checkpoint's ``model.inference_path``."""
        from detector.tasks import load_detector

        model, cfg = load_detector(ckpt_path, mask, inference_path)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        return cls.from_config(model, cfg, device), cfg

    @property
    def classes(self) -> list[str]:
        return list(self.model.coder.classes)

    @property
    def grid(self):
        return self.model.grid

    @torch.no_grad()
    def __call__(self, frames: Sequence[Frame]) -> Prediction:
        """Detections of the frames (raises ValueError naming the frame where the mask needs what it lacks, e.g. a
        road map)."""
        batch = collate_frames(frames)
        if self.mask_provider is not None:
            batch.mask = self.mask_provider(batch, self.grid).mask
        batch = batch.to(self.device)
        out = self.model(batch)
        dets = [d.to("cpu") for d in self.model.decode(out, **self.decode)]
        return Prediction(batch, out, dets)


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
