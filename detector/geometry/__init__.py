"""The geometry floor: what data, models and eval all use, importing nothing of ours.

- :mod:`detector.geometry.boxes`: ``Boxes3D`` (oriented 3D boxes in the LiDAR frame) and points in boxes.
- :mod:`detector.geometry.voxelize`: ``BevGrid`` (the BEV grid's cell convention) and ``voxelize``.
- :mod:`detector.geometry.box_masks`: the grid cells of boxes, box masks, and binary morphology on the grid.
- :mod:`detector.geometry.iou`: exact 2D, rotated BEV and 3D overlaps (NMS and the KITTI metric).

KITTI's camera frame and calibration are not here: :mod:`detector.data.kitti_camera`.
"""

from detector.geometry.boxes import Boxes3D, points_in_boxes_sparse
from detector.geometry.iou import bev_iou, box2d_overlap, iou3d
from detector.geometry.voxelize import BevGrid

# (the function ``voxelize`` stays in its module: re-exported here, its name would hide the module
# ``detector.geometry.voxelize`` that configs name targets by)
__all__ = ["BevGrid", "Boxes3D", "bev_iou", "box2d_overlap", "iou3d", "points_in_boxes_sparse"]
