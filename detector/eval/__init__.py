"""KITTI evaluation on the CPU.

- :mod:`detector.eval.iou`: exact overlaps (2D image boxes, rotated BEV rectangles, 3D boxes), float64.
- :mod:`detector.eval.protocol`: the KITTI protocol's constants and rules.
- :mod:`detector.eval.kitti_metric`: ``evaluate(gt, dt) -> KittiResult`` (AP R40/R11, AOS, AP by distance).
- :mod:`detector.eval.kitti_files`: label/result folders (the ``scripts/kitti_eval.py`` CLI) and the
  result-file writer.
- :mod:`detector.eval.reference`: an independent, literal implementation of the protocol (test oracle).
"""

from detector.eval.iou import bev_iou, box2d_overlap, iou3d
from detector.eval.kitti_files import load_eval_inputs, write_results
from detector.eval.kitti_metric import EvalTimings, KittiResult, evaluate

__all__ = [
    "EvalTimings",
    "KittiResult",
    "bev_iou",
    "box2d_overlap",
    "evaluate",
    "iou3d",
    "load_eval_inputs",
    "write_results",
]
