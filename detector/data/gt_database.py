"""Ground-truth database for GT sampling: every labeled object of chosen classes of a training split (of a
KITTI-format or a LiDAR-only root), with the points inside its box.

Stored as one ``.npz`` of plain arrays (no pickle: read with ``allow_pickle=False``) in a cache folder outside the
dataset (a dataset is read-only to training), one subfolder per dataset root, and rebuilt when its source changes:
the file records a fingerprint of the builder version, the classes, the frame ids and the size and mtime of every
point, label (and calibration) file it read. A LiDAR-only root has no difficulty levels: its objects are
stored with difficulty 0.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from detector.data.kitti import KittiRoot
from detector.data.kitti_labels import KittiLabels
from detector.data.kitti_labels import difficulty as label_difficulty
from detector.data.lidar import LidarRoot, open_root
from detector.errors import KittiFormatError
from detector.geometry.boxes import points_in_boxes_sparse
from detector.outputs import atomic_path
from detector.resources import cache_dir as user_cache_dir

log = logging.getLogger(__name__)

_VERSION = "gtdb-2"  # 2: difficulty by the metric's rule (height > the minimum, not >=)
DEFAULT_CLASSES = ("Car", "Pedestrian", "Cyclist")


@dataclass
class GtDatabase:
    """Objects of K labeled boxes. ``boxes`` [K, 7] float32 LiDAR boxes (as in ``Frame.gt_boxes``) at
    their place in their source frame; ``points[offsets[k]:offsets[k+1]]`` [n_k, 4] float32 are the
    source frame's points inside box k (``Boxes3D.points_in_boxes``, margin 0), unchanged."""

    boxes: np.ndarray
    names: np.ndarray
    difficulty: np.ndarray
    frame_ids: np.ndarray
    points: np.ndarray
    offsets: np.ndarray
    fingerprint: str = ""

    def __len__(self) -> int:
        return len(self.boxes)

    @property
    def num_points(self) -> np.ndarray:
        return np.diff(self.offsets)

    def object_points(self, k: int) -> np.ndarray:
        return self.points[self.offsets[k]: self.offsets[k + 1]]

    # --- building ---------------------------------------------------------------------------------
    @classmethod
    def build(cls, root: KittiRoot | LidarRoot, frame_ids: Sequence[str], classes: Sequence[str] = DEFAULT_CLASSES,
              fingerprint: str = "", skip_bad_frames: bool = False) -> GtDatabase:
        """Read every frame (labels required) and collect its objects of ``classes``. A bad frame raises its
        :class:`KittiFormatError`, or with ``skip_bad_frames`` is left out (one warning lists them)."""
        if not root.has_labels():
            raise KittiFormatError(root.labels_dir, f"no {root.labels_dir.name} folder: a GT database needs a "
                                   "labeled split")
        boxes, names, diff, fids, pts, counts = [], [], [], [], [], []
        skipped: list[tuple[str, str]] = []
        for fid in frame_ids:
            try:
                f = root.read_frame(fid)
            except KittiFormatError as e:
                if not skip_bad_frames:
                    raise
                skipped.append((fid, str(e)))
                continue
            keep = np.isin(f.gt_names, np.asarray(classes))
            if not keep.any():
                continue
            b = f.gt_boxes[torch.from_numpy(np.flatnonzero(keep))]
            for idx in points_in_boxes_sparse(f.points, b):
                pts.append(f.points[idx])
                counts.append(len(idx))
            boxes.append(b.numpy().astype(np.float32))
            names.append(f.gt_names[keep])
            diff.append(_difficulty(f.labels, len(f.gt_names))[keep])
            fids.append(np.full(int(keep.sum()), fid, dtype="<U16"))
        if skipped:
            log.warning("GT database of %s: left out %d bad frame(s): %s (first: %s)", root.root, len(skipped),
                        ", ".join(fid for fid, _ in skipped[:20]) + (", ..." if len(skipped) > 20 else ""),
                        skipped[0][1])
        offsets = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)
        return cls(
            boxes=np.concatenate(boxes) if boxes else np.zeros((0, 7), np.float32),
            names=np.concatenate(names).astype("<U16") if names else np.zeros(0, "<U16"),
            difficulty=np.concatenate(diff) if diff else np.zeros(0, np.int8),
            frame_ids=np.concatenate(fids) if fids else np.zeros(0, "<U16"),
            points=np.concatenate(pts).astype(np.float32) if pts else np.zeros((0, 4), np.float32),
            offsets=offsets,
            fingerprint=fingerprint,
        )

    # --- storage -----------------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:  # a concurrent reader (or writer) never sees half a file
            np.savez(tmp, boxes=self.boxes, names=self.names, difficulty=self.difficulty, frame_ids=self.frame_ids,
                     points=self.points, offsets=self.offsets, fingerprint=np.asarray(self.fingerprint))

    @classmethod
    def load(cls, path: str | Path) -> GtDatabase:
        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as z:
                db = cls(z["boxes"], z["names"], z["difficulty"], z["frame_ids"], z["points"], z["offsets"],
                         str(z["fingerprint"]))
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: GT database not found") from None
        except (KeyError, ValueError, OSError) as e:
            raise ValueError(f"{path}: not a valid GT database file ({e})") from None
        k = len(db.boxes)
        if (db.boxes.shape != (k, 7) or db.offsets.shape != (k + 1,) or len(db.names) != k
                or db.points.ndim != 2 or db.points.shape[1] != 4 or int(db.offsets[-1]) != len(db.points)):
            raise ValueError(f"{path}: inconsistent GT database arrays")
        return db

    @classmethod
    def load_or_build(
        cls,
        root: str | Path,
        split: str = "train",
        classes: Sequence[str] = DEFAULT_CLASSES,
        cache_dir: str | Path | None = None,
        frame_ids: Sequence[str] | None = None,
        skip_bad_frames: bool = False,
        layout: str = "kitti",
    ) -> GtDatabase:
        """The database of ``ImageSets/{split}.txt`` (or the given ``frame_ids``), from the cache file
        ``{cache_dir}/<root name>-<hash of its path>/gt_{split}_{classes}.npz`` when its fingerprint matches the
        source, else built (``skip_bad_frames``: bad frames left out, :meth:`build`) and saved there. Nothing is
        written into ``root``. ``cache_dir`` None: ``gt_database/`` in :func:`detector.resources.cache_dir`.
        ``layout``: kitti, lidar or auto (:func:`detector.data.lidar.open_root`)."""
        kroot = open_root(root, layout)
        ids = list(frame_ids) if frame_ids is not None else kroot.imageset(split)
        classes = tuple(str(c) for c in classes)
        fp = source_fingerprint(kroot, ids, classes)
        path = cache_path(kroot.root, split, classes, cache_dir)
        if path.is_file():
            try:
                db = cls.load(path)
                if db.fingerprint == fp:
                    return db
            except ValueError:
                pass  # unreadable cache: rebuild
        db = cls.build(kroot, ids, classes, fingerprint=fp, skip_bad_frames=skip_bad_frames)
        db.save(path)
        return db


def cache_path(root: str | Path, split: str, classes: Sequence[str], cache_dir: str | Path | None = None) -> Path:
    """Where :meth:`GtDatabase.load_or_build` keeps the database of ``root``'s ``split``: a subfolder per root (its
    name and a hash of its absolute path, so two roots of one name do not share a file)."""
    root = Path(root).expanduser().resolve()
    key = hashlib.sha256(str(root).encode()).hexdigest()[:12]
    base = Path(cache_dir).expanduser() if cache_dir is not None else user_cache_dir() / "gt_database"
    return base / f"{root.name}-{key}" / f"gt_{split}_{'-'.join(classes)}.npz"


def source_fingerprint(root: KittiRoot | LidarRoot, frame_ids: Sequence[str], classes: Sequence[str]) -> str:
    h = hashlib.sha256()
    h.update(f"{_VERSION}|{','.join(classes)}|".encode())
    for fid in frame_ids:
        for p in root.source_files(fid):
            kind = p.parent.name
            try:
                st = p.stat()
                h.update(f"{fid}:{kind}:{st.st_size}:{st.st_mtime_ns};".encode())
            except FileNotFoundError:
                if root.layout == "kitti":  # a LiDAR-only frame has one of its point files only
                    h.update(f"{fid}:{kind}:missing;".encode())
    return h.hexdigest()


def _difficulty(labels: KittiLabels | object, n: int) -> np.ndarray:
    """KITTI difficulty of a frame's objects (DontCare excluded; the metric's rule, kitti_labels.difficulty), or
    0 for every object of a LiDAR-only frame (no difficulty levels)."""
    if isinstance(labels, KittiLabels):
        return label_difficulty(labels.select(labels.name != "DontCare"))
    return np.zeros(n, np.int8)
