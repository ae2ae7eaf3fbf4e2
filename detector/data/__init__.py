"""Data: dataset files, frames and batches, datasets, augmentation, masks from data, loaders.

- KITTI roots: :mod:`~detector.data.kitti` (the root, point clouds, image sets), :mod:`~detector.data.kitti_labels`,
  :mod:`~detector.data.kitti_calib`, :mod:`~detector.data.kitti_camera` (boxes <-> camera labels),
  :mod:`~detector.data.kitti_batch`; LiDAR-only roots: :mod:`~detector.data.lidar`, :mod:`~detector.data.lidar_labels`;
  :mod:`~detector.data.convert` (KITTI -> LiDAR-only); point-cloud files: :mod:`~detector.data.pointcloud`;
  :mod:`~detector.data.road_map`.
- :mod:`~detector.data.structures`: ``Frame`` and ``Batch``; :mod:`~detector.data.dataset`: ``KittiDataset``;
  :mod:`~detector.data.datamodule`: ``KittiDataModule`` (resumable sampler and loaders).
- :mod:`~detector.data.augment` and :mod:`~detector.data.gt_database`: training augmentation and GT sampling;
  :mod:`~detector.data.masks`: computation masks from data (road map, ground); :mod:`~detector.data.domains`: simulated
  vs real statistics.

The names live in their modules (importing this package imports none of them: ``scripts/kitti_eval.py`` reads labels
without loading Lightning).
"""

__all__ = [
    "augment", "convert", "datamodule", "dataset", "domains", "gt_database", "kitti", "kitti_batch", "kitti_calib",
    "kitti_camera", "kitti_labels", "lidar", "lidar_labels", "masks", "pointcloud", "road_map", "structures",
]
