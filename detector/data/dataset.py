"""A map-style dataset over one split of a dataset root: KITTI-format or LiDAR-only (:mod:`detector.data.lidar`)."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np
import torch.utils.data

from detector.data.kitti import KittiRoot
from detector.data.kitti_calib import Calibration
from detector.data.kitti_camera import in_camera_fov
from detector.data.kitti_labels import IMAGE_SIZE, read_label
from detector.data.lidar import LidarRoot, UnknownClasses, open_root
from detector.data.structures import Frame
from detector.errors import ConfigError, KittiFormatError

log = logging.getLogger(__name__)


def camera_view(points: np.ndarray, calib: Calibration | None, image_size: tuple[int, int] | None = None
                ) -> np.ndarray:
    """THE field-of-view cut (``data.fov_only``; the dataset, predict and visualize call it): the points that project
    into the left colour camera's image of ``image_size`` (width, height; None: KITTI's 1242 x 375), as KITTI
    detectors keep them - KITTI labels objects in the camera's view only. Without a calibration (a LiDAR-only frame
    has no camera) every point is kept."""
    if calib is None:
        return points
    return points[in_camera_fov(points, calib, image_size or IMAGE_SIZE)]


def split_overlap(first: tuple[str, Sequence[str]], second: tuple[str, Sequence[str]]) -> str | None:
    """``"splits 'train' and 'val' share 2 frame(s) (000001, 000004)"`` (the first five named, in ``second``'s
    order) when the two ``(name, frame ids)`` list frames in common, else None: the callers say what it costs (a
    validation or an evaluation that scores frames the model trained on)."""
    seen = set(first[1])
    shared = [i for i in dict.fromkeys(second[1]) if i in seen]
    if not shared:
        return None
    named = ", ".join(shared[:5]) + (", ..." if len(shared) > 5 else "")
    return f"splits '{first[0]}' and '{second[0]}' share {len(shared)} frame(s) ({named})"


class KittiDataset(torch.utils.data.Dataset):
    """Frames of ``ImageSets/{split}.txt``.

    Construction checks, cheaply, that every listed frame has its files and that they parse (points
    only by size: the full point check happens on load). A bad frame raises :class:`KittiFormatError`
    naming the file, or with ``skip_bad_frames`` is dropped with a warning and counted in
    ``self.skipped`` (a frame whose points turn out bad at load time is then replaced by the next one).
    ``fov_only`` keeps the points that project into the left colour camera's image (as KITTI detectors
    do: objects outside it are not labeled); a LiDAR-only root has no camera and keeps every point.

    ``layout``: ``kitti``, ``lidar`` or ``auto`` (:func:`detector.data.lidar.open_root`); ``classes`` and
    ``ignore_classes`` name a LiDAR-only root's known classes: objects of any other name are counted at
    construction and reported in one warning (``self.unknown``), and stay in the frames (neither trained nor scored).

    ``cache_mb``: frames as read (files parsed, points cut to the camera's view) are kept in memory up to this
    many MiB (0: none), the first ones loaded, so that later epochs skip the files and the view test - about 4 ms
    of each frame's ~13 ms of loading on make train's CPU; the augmentation runs on every load as before. Every
    load hands out its own arrays (a transform or a consumer may write into them). Each DataLoader worker process
    keeps its own cache.
    """

    def __init__(
        self,
        root: str | Path,
        split: str = "train",
        road_map: bool = False,
        skip_bad_frames: bool = False,
        transform: Callable[[Frame, np.random.Generator], Frame] | None = None,
        seed: int = 0,
        fov_only: bool = True,
        cache_mb: float = 0.0,
        layout: str = "kitti",
        classes: Iterable[str] | None = None,
        ignore_classes: Iterable[str] | None = None,
    ):
        if not (isinstance(cache_mb, (int, float)) and not isinstance(cache_mb, bool) and cache_mb >= 0):
            raise ConfigError(f"data.cache_mb must be a number >= 0 (MiB), got {cache_mb!r}")
        self.root: KittiRoot | LidarRoot = open_root(root, layout, classes, ignore_classes)
        self.unknown = UnknownClasses()
        self.split = split
        self.road_map = road_map
        self.skip_bad_frames = skip_bad_frames
        self.transform = transform
        self.seed = seed
        self.fov_only = fov_only
        self.epoch = 0
        self.cache_bytes = int(cache_mb * 2**20)
        self._cache: dict[str, Frame] = {}
        self._cached = 0  # bytes held
        self.skipped: list[tuple[str, str]] = []  # (frame id, reason)
        ids = self.root.imageset(split)
        if road_map and not self.root.has_road_maps():
            raise KittiFormatError(
                self.root.dir / "road_map",
                "mask=road_map needs road maps, and this dataset has none (real KITTI has none): "
                "use mask=predicted, mask=ground or mask=none",
            )
        self.ids = [i for i in ids if self._check(i)]
        if self.unknown:
            log.warning("%s/%s: %s", root, split, self.unknown.message(self.root.classes))
        if self.skipped:
            log.warning("%s/%s: skipped %d bad frame(s): %s (first: %s)", root, split, len(self.skipped),
                        ", ".join(fid for fid, _ in self.skipped[:20]) + (", ..." if len(self.skipped) > 20 else ""),
                        self.skipped[0][1])
        if not self.ids:
            raise KittiFormatError(self.root.root / "ImageSets" / f"{split}.txt", "no usable frames in this split")

    def _bad(self, frame_id: str, err: KittiFormatError) -> bool:
        if not self.skip_bad_frames:
            raise err
        if all(fid != frame_id for fid, _ in self.skipped):
            self.skipped.append((frame_id, str(err)))
        return False

    def _check(self, frame_id: str) -> bool:
        if isinstance(self.root, LidarRoot):
            try:
                labels = self.root.check_frame(frame_id)
            except KittiFormatError as e:
                return self._bad(frame_id, e)
            if labels is not None:
                self.unknown.add(labels, self.root.unknown(labels), self.root.path("labels", frame_id))
            return True
        try:
            bin_path = self.root.path("velodyne", frame_id)
            try:
                size = os.path.getsize(bin_path)
            except FileNotFoundError:
                raise KittiFormatError(
                    bin_path, f"frame {frame_id} is listed in ImageSets but has no point cloud"
                ) from None
            if size == 0 or size % 16:
                raise KittiFormatError(
                    bin_path, f"truncated or empty point cloud ({size} bytes, not a positive multiple of 16)"
                )
            self.root.image_size(frame_id, Calibration.from_file(self.root.path("calib", frame_id)))
            if self.root.has_labels():
                read_label(self.root.path("label_2", frame_id), with_score=False)
            if self.road_map and not self.root.path("road_map", frame_id).exists():
                raise KittiFormatError(self.root.path("road_map", frame_id), "road map not found")
        except KittiFormatError as e:
            return self._bad(frame_id, e)
        return True

    def __len__(self) -> int:
        return len(self.ids)

    def set_epoch(self, epoch: int) -> None:
        """Augmentation randomness depends on (seed, epoch, index): reproducible and resumable."""
        self.epoch = epoch

    def __getitem__(self, index: int) -> Frame:
        for k in range(len(self.ids)):
            frame_id = self.ids[(index + k) % len(self.ids)]
            try:
                frame = self._load(frame_id)
            except KittiFormatError as e:
                new = all(fid != frame_id for fid, _ in self.skipped)
                self._bad(frame_id, e)
                if new:  # told once, not at every epoch
                    log.warning("skipping bad frame %s", e)
                continue
            if self.transform is not None:
                rng = np.random.default_rng([self.seed, self.epoch, index])
                frame = self.transform(frame, rng)
            return frame
        raise KittiFormatError(self.root.root, f"no loadable frame in split {self.split}")

    def _load(self, frame_id: str) -> Frame:
        """The frame as read, its points cut to the camera's view with ``fov_only`` (KITTI labels objects in the
        camera's view only), from the cache when it holds it; the caller owns the arrays it gets."""
        frame = self._cache.get(frame_id)
        if frame is None:
            frame = self.root.read_frame(frame_id, road_map=self.road_map)
            if self.fov_only:
                frame.points = camera_view(frame.points, frame.calib, frame.image_size)
            size = _frame_bytes(frame)
            if self._cached + size > self.cache_bytes:
                return frame
            self._cache[frame_id] = frame
            self._cached += size
        return dataclasses.replace(frame, points=frame.points.copy(), gt_boxes=frame.gt_boxes.clone(),
                                   gt_names=frame.gt_names.copy())


def _frame_bytes(frame: Frame) -> int:
    """Memory a cached frame holds: its points, boxes, road map raster, plus 4 KiB for the rest (calibration,
    labels)."""
    road = 0 if frame.road_map is None else frame.road_map.raster.nbytes
    boxes = frame.gt_boxes.tensor
    return frame.points.nbytes + boxes.numel() * boxes.element_size() + road + 4096
