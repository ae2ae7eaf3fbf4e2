"""LightningDataModule over a dataset root (KITTI-format or LiDAR-only), with a sampler that resumes mid-epoch exactly.

Randomness: the train order is a permutation drawn from (seed, epoch); a frame's augmentation draws from
(seed, epoch, index). Both are independent of workers, ranks and restarts, so a run resumed from a
mid-epoch checkpoint sees exactly the batches the uninterrupted run would have seen.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from pathlib import Path

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Sampler

from detector.data.dataset import KittiDataset
from detector.data.lidar import open_root
from detector.data.masks import RoadMapMask
from detector.data.structures import Batch, Frame, collate_frames
from detector.errors import ConfigError, KittiFormatError
from detector.geometry.voxelize import BevGrid


class EpochSampler(Sampler):
    """Yields ``(epoch, index)`` pairs: a (seed, epoch)-seeded permutation (or the identity without
    ``shuffle``), sharded across distributed ranks (padded to equal length, like DistributedSampler).
    ``resume(epoch, skip)`` makes the next iteration start at epoch ``epoch`` past ``skip`` samples."""

    def __init__(self, size: int, shuffle: bool, seed: int = 0, drop_last: bool = False):
        self.size = size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self._skip = 0

    def _replicas(self) -> tuple[int, int]:
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size(), dist.get_rank()
        return 1, 0

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self._skip = 0
        self.epoch = epoch

    def resume(self, epoch: int, skip: int) -> None:
        self.epoch, self._skip = epoch, skip

    def __len__(self) -> int:  # the full epoch: Lightning counts resumed batches itself
        world, _ = self._replicas()
        return self.size // world if self.drop_last else math.ceil(self.size / world)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        world, rank = self._replicas()
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(self.size)
        else:
            order = np.arange(self.size)
        n = len(self)
        order = np.resize(order, n * world)  # pad by wrapping around
        mine = order[rank::world][self._skip:]
        self._skip = 0
        epoch = self.epoch
        return iter([(epoch, int(i)) for i in mine])


class ResumableDataLoader(DataLoader):
    """A DataLoader Lightning can checkpoint (it has ``state_dict``/``load_state_dict``): the state is the
    epoch and the number of batches the training loop has processed in it (``progress()``)."""

    def __init__(self, *args, progress: Callable[[], int] = lambda: 0, **kwargs):
        super().__init__(*args, **kwargs)
        self._progress = progress

    def state_dict(self) -> dict:
        return {"epoch": int(self.sampler.epoch), "batches": int(self._progress())}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.resume(int(state["epoch"]), int(state["batches"]) * int(self.batch_size))


class _Indexed(torch.utils.data.Dataset):
    """Adapts a KittiDataset to the sampler's ``(epoch, index)`` keys."""

    def __init__(self, ds: KittiDataset):
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, key) -> Frame:
        epoch, index = key if isinstance(key, tuple) else (0, key)
        self.ds.set_epoch(epoch)
        return self.ds[index]


def collate(frames: list[Frame], mask_provider=None, grid: BevGrid | None = None) -> Batch:
    batch = collate_frames(frames)
    if mask_provider is not None:
        batch.mask = mask_provider(batch, grid).mask
    return batch


def _min_overlaps(classes: Mapping[str, float] | None) -> dict[str, float] | None:
    """``data.classes`` checked: {name: minimum IoU in [0, 1)}."""
    if classes is None:
        return None
    if not isinstance(classes, Mapping) or not classes:
        raise ConfigError(f"data.classes must map each class name to its minimum IoU (e.g. {{Car: 0.7}}), "
                          f"got {classes!r}")
    out = {}
    for name, v in classes.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
            raise ConfigError(f"data.classes.{name}={v!r}: the minimum IoU must be a number in [0, 1)")
        out[str(name)] = float(v)
    return out


class KittiDataModule(L.LightningDataModule):
    """Train / val (/ test) splits of a KITTI-format or LiDAR-only root (``layout``: kitti, lidar, auto).

    ``augment`` is a callable ``(Frame, np.random.Generator) -> Frame`` applied to training frames;
    ``mask_provider`` (road map, ground) computes the computation mask in the loader workers.
    ``classes``: the dataset's class names, each with its minimum IoU (BEV and 3D) for a match in evaluation
    (``min_overlap``; None: KITTI's Car 0.7, Pedestrian and Cyclist 0.5); ``ignore_classes``: names known but
    neither trained nor scored (LiDAR-only roots; any other name is counted and reported).
    """

    def __init__(
        self,
        root: str,
        grid: BevGrid,
        batch_size: int = 4,
        eval_batch_size: int | None = None,
        num_workers: int = 2,
        train_split: str = "train",
        val_split: str = "val",
        test_split: str | None = None,
        augment: Callable[[Frame, np.random.Generator], Frame] | None = None,
        mask_provider=None,
        skip_bad_frames: bool = False,
        seed: int = 0,
        pin_memory: bool = False,
        fov_only: bool = True,
        cache_mb: float = 0.0,
        layout: str = "kitti",
        classes: Mapping[str, float] | None = None,
        ignore_classes: list[str] | None = None,
    ):
        super().__init__()
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"data.batch_size must be a positive integer (or 'auto'), got {batch_size!r}")
        if num_workers < 0:
            raise ConfigError(f"data.num_workers must be >= 0, got {num_workers}")
        self.root = str(Path(root).expanduser())
        self.grid = grid
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.num_workers = num_workers
        self.splits = {"train": train_split, "val": val_split, "test": test_split}
        self.augment = augment
        self.mask_provider = mask_provider
        self.skip_bad_frames = skip_bad_frames
        self.seed = seed
        self.pin_memory = pin_memory
        self.fov_only = fov_only
        self.cache_mb = cache_mb
        self.layout = layout
        self.min_overlap = _min_overlaps(classes)
        self.ignore_classes = None if ignore_classes is None else list(ignore_classes)
        self.datasets: dict[str, KittiDataset] = {}

    def dataset(self, stage: str) -> KittiDataset:
        if stage not in self.datasets:
            split = self.splits[stage]
            if split is None:
                raise ConfigError(f"no {stage} split configured (data.{stage}_split)")
            needs_road = isinstance(self.mask_provider, RoadMapMask)
            root = open_root(self.root, self.layout, self.min_overlap, self.ignore_classes)
            if stage == "train" and not root.has_labels():  # else it would learn empty scenes
                raise KittiFormatError(root.labels_dir, "training needs labels, and this dataset has no "
                                       f"{root.labels_dir.name} folder")
            self.datasets[stage] = KittiDataset(
                self.root, split, road_map=needs_road, skip_bad_frames=self.skip_bad_frames,
                transform=self.augment if stage == "train" else None, seed=self.seed, fov_only=self.fov_only,
                cache_mb=self.cache_mb, layout=self.layout, classes=self.min_overlap,
                ignore_classes=self.ignore_classes,
            )
        return self.datasets[stage]

    def setup(self, stage: str | None = None) -> None:
        if stage in (None, "fit"):
            self.dataset("train")
            self.dataset("val")
        elif stage == "validate":
            self.dataset("val")
        elif stage in ("test", "predict"):
            self.dataset("test" if self.splits["test"] else "val")

    def _progress(self) -> int:
        trainer = self.trainer
        if trainer is None:
            return 0
        return int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)

    def _loader(self, stage: str, batch_size: int, shuffle: bool) -> DataLoader:
        ds = self.dataset(stage)
        sampler = EpochSampler(len(ds), shuffle=shuffle, seed=self.seed, drop_last=shuffle)
        return ResumableDataLoader(
            _Indexed(ds), batch_size=batch_size, sampler=sampler, drop_last=shuffle,
            num_workers=self.num_workers, persistent_workers=self.num_workers > 0,
            collate_fn=partial(collate, mask_provider=self.mask_provider, grid=self.grid),
            pin_memory=self.pin_memory, progress=self._progress if stage == "train" else (lambda: 0),
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", self.eval_batch_size, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test" if self.splits["test"] else "val", self.eval_batch_size, shuffle=False)
