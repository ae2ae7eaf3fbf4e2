"""The geometry floor: what data, models and eval all use, importing nothing of ours.

- :mod:`detector.geometry.boxes`: ``Boxes3D`` (oriented 3D boxes in the LiDAR frame) and points in boxes.
- :mod:`detector.geometry.voxelize`: ``BevGrid`` (the BEV grid's cell convention) and ``voxelize``.
- :mod:`detector.geometry.box_masks`: the grid cells of boxes, box masks, and binary morphology on the grid.
- :mod:`detector.geometry.iou`: exact 2D, rotated BEV and 3D overlaps (NMS and the KITTI metric).

KITTI's camera frame and calibration are not here: :mod:`detector.data.kitti_camera`.
"""
