"""KITTI evaluation on the CPU.

- :mod:`detector.eval.overlap`: the records of many frames and their overlaps (on :mod:`detector.geometry.iou`).
- :mod:`detector.eval.protocol`: the KITTI protocol's constants and rules.
- :mod:`detector.eval.kitti_metric`: ``evaluate(gt, dt) -> KittiResult`` (AP R40/R11, AOS, AP by distance).
- :mod:`detector.eval.kitti_files`: label/result folders (the ``scripts/kitti_eval.py`` CLI) and the
  result-file writer.
- :mod:`detector.eval.error_analysis`: which errors an evaluation makes (missed, loose, duplicate, background,
  ...) by distance band (the ``scripts/analyze_errors.py`` CLI).
- :mod:`detector.eval.reference`: an independent, literal implementation of the protocol (test oracle).
"""

from detector.eval.kitti_files import load_eval_inputs, write_results
from detector.eval.kitti_metric import EvalTimings, KittiResult, evaluate

__all__ = [
    "EvalTimings",
    "KittiResult",
    "evaluate",
    "load_eval_inputs",
    "write_results",
]
