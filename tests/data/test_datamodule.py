"""The train loader: EpochSampler's order, its sharding across ranks and its mid-epoch resume; augmented
batches that do not depend on the number of loader workers or torch threads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from detector.build import build_grid
from detector.data.datamodule import EpochSampler, ResumableDataLoader
from detector.resources import config_dir
from detector.tasks import build_datamodule


def _shards(size: int, world: int, shuffle: bool, drop_last: bool, epoch: int = 0, seed: int = 0):
    out = []
    for rank in range(world):
        s = EpochSampler(size, shuffle=shuffle, seed=seed, drop_last=drop_last)
        s._replicas = lambda rank=rank: (world, rank)
        s.set_epoch(epoch)
        out.append([i for e, i in s])
        assert all(e == epoch for e, _ in s)
        assert len(out[-1]) == len(s)
    return out


@pytest.mark.parametrize("size", [7, 8])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_split_one_permutation(size, world, drop_last):
    shards = _shards(size, world, shuffle=True, drop_last=drop_last, epoch=3)
    order = np.random.default_rng([0, 3]).permutation(size)  # the (seed, epoch) permutation
    per_rank = size // world if drop_last else -(-size // world)
    assert [len(s) for s in shards] == [per_rank] * world
    interleaved = [shards[r][k] for k in range(per_rank) for r in range(world)]
    np.testing.assert_array_equal(interleaved, np.resize(order, per_rank * world))
    seen = [i for s in shards for i in s]
    if drop_last:
        assert len(set(seen)) == len(seen) == per_rank * world  # disjoint, nothing repeated
    else:
        assert set(seen) == set(range(size))  # every frame, padded by wrapping around
        assert len(seen) - size == per_rank * world - size


def test_order_depends_on_seed_and_epoch_only():
    a = _shards(50, 1, True, True, epoch=1)[0]
    assert a == _shards(50, 1, True, True, epoch=1)[0]
    assert a != _shards(50, 1, True, True, epoch=2)[0]
    assert a != _shards(50, 1, True, True, epoch=1, seed=1)[0]
    assert _shards(6, 1, shuffle=False, drop_last=False)[0] == list(range(6))


@pytest.mark.parametrize("world", [1, 2])
def test_resume_skips_what_was_seen_once(world):
    for rank in range(world):
        full = _shards(11, world, True, True, epoch=4)[rank]
        s = EpochSampler(11, shuffle=True, drop_last=True)
        s._replicas = lambda rank=rank: (world, rank)
        s.resume(4, 3)
        assert [i for _, i in s] == full[3:]
        assert [i for _, i in s] == full  # the next pass of the same epoch is whole again
        s.resume(4, 2)
        s.set_epoch(5)  # a new epoch forgets the skip
        assert [i for _, i in s] == _shards(11, world, True, True, epoch=5)[rank]


class _Keys(torch.utils.data.Dataset):
    """Returns the sampler's (epoch, index) key as the sample."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, key):
        return key


def test_loader_state_resumes_after_the_processed_batches():
    s = EpochSampler(10, shuffle=True, drop_last=True)
    loader = ResumableDataLoader(_Keys(), batch_size=3, sampler=s, progress=lambda: 2,
                                 collate_fn=lambda b: [i for _, i in b])
    s.set_epoch(2)
    full = [i for batch in loader for i in batch]
    state = loader.state_dict()
    assert state == {"epoch": 2, "batches": 2}
    fresh = ResumableDataLoader(_Keys(), batch_size=3, sampler=EpochSampler(10, True, drop_last=True),
                                collate_fn=lambda b: [i for _, i in b])
    fresh.load_state_dict(state)
    assert [i for batch in fresh for i in batch] == full[6:]


def _train_batches(root, workers: int, threads: int, n: int = 2, extra: tuple[str, ...] = (), epochs=(1,)):
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        cfg = compose("train", overrides=[f"data.root={root}", "paths.output_dir=/tmp/unused", "data.batch_size=2",
                                          f"data.num_workers={workers}", "bev.x_range=[0,25.6]",
                                          "bev.y_range=[-12.8,12.8]", "mask=road_map", *extra])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        dm = build_datamodule(cfg.data, cfg.mask, build_grid(cfg.bev), sparse=True)
        batches = []
        for epoch in epochs:
            loader = dm.train_dataloader()
            loader.sampler.set_epoch(epoch)
            batches += [b for b, _ in zip(loader, range(n), strict=False)]
        return batches
    finally:
        torch.set_num_threads(before)


def test_frame_cache_changes_no_training_batch(tiny_root):
    """The default training data from frames held in memory (data.cache_mb; the second epoch is served from it) is the
    data read from the files every time (cache_mb=0), augmentation and road-map mask included."""
    a = _train_batches(tiny_root, workers=0, threads=1, extra=("data.cache_mb=0",), epochs=(0, 1))
    b = _train_batches(tiny_root, workers=0, threads=1, extra=("data.cache_mb=64",), epochs=(0, 1))
    assert len(a) == len(b) == 4
    for x, y in zip(a, b, strict=True):
        assert [f.frame_id for f in x.frames] == [f.frame_id for f in y.frames]
        assert torch.equal(x.points, y.points) and torch.equal(x.mask, y.mask)
        assert all(torch.equal(p.tensor, q.tensor) for p, q in zip(x.gt_boxes, y.gt_boxes, strict=True))


def test_augmented_batches_do_not_depend_on_workers_or_threads(tiny_root):
    """The default training data (GT sampling, noise, flip, rotation, scaling) with mask=road_map (its mask
    computed in the loader) is the same in the main process with 1 thread and in 2 worker processes with 2 threads."""
    a = _train_batches(tiny_root, workers=0, threads=1)
    b = _train_batches(tiny_root, workers=2, threads=2)
    assert len(a) == len(b) == 2
    for x, y in zip(a, b, strict=True):
        assert [f.frame_id for f in x.frames] == [f.frame_id for f in y.frames]
        assert torch.equal(x.points, y.points)
        assert torch.equal(x.gt_boxes[0].tensor, y.gt_boxes[0].tensor)
        assert x.mask is not None and torch.equal(x.mask, y.mask)
        assert all(f.road_map is not None and f.road_map.to_raster is not None for f in x.frames)  # augmented
