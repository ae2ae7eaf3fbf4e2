"""The detector as plain ``nn.Module``\\ s (built from ``configs/model`` by :func:`detector.build.build_model`).

- :mod:`~detector.models.detector`: ``BevDetector`` (backbone, top-down neck, head; decoding) and ``DetectorOutput``.
- :mod:`~detector.models.head`: ``DetectionHead``; :mod:`~detector.models.targets`: ``BoxCoder`` (targets and box
  encoding); :mod:`~detector.models.losses`; :mod:`~detector.models.nms`: rotated NMS in BEV.
- :mod:`~detector.models.mask_net`: ``MaskNet`` (the predicted computation mask); :mod:`~detector.models.mask_schedule`:
  ``MaskSchedule`` (how training uses it); :mod:`~detector.models.mask_quality`: its recall and MACs.
"""

from detector.models.detector import BevDetector, DetectorOutput
from detector.models.head import DetectionHead
from detector.models.mask_net import MaskNet
from detector.models.mask_schedule import MaskSchedule
from detector.models.targets import BoxCoder

__all__ = ["BevDetector", "BoxCoder", "DetectionHead", "DetectorOutput", "MaskNet", "MaskSchedule"]
