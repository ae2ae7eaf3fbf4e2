"""Mask quality on hand-built boxes and masks: answers that follow from the definitions
(detector/models/mask_quality.py)."""

from __future__ import annotations

import math

import pytest
import torch

from detector.geometry.box_masks import boxes_mask
from detector.geometry.boxes import Boxes3D
from detector.geometry.voxelize import BevGrid
from detector.models.mask_quality import box_recall, mask_quality, tile_activity

# 1 m cells: columns x 0..10 (cell c covers [c, c+1)), rows y -5..5 (row r covers [-5 + r, -4 + r))
GRID = BevGrid(x_range=(0.0, 10.0), y_range=(-5.0, 5.0), z_range=(-2.0, 1.0), resolution=1.0, z_resolution=0.5)


def cell(x: float, y: float) -> tuple[int, int]:
    """(row, col) of the cell holding (x, y)."""
    return int(math.floor(y + 5)), int(math.floor(x))


def box(x, y, l, w, yaw=0.0):
    return [x, y, -1.0, l, w, 1.5, yaw]


def test_box_recall_and_covered_share():
    # box A: x in [2, 4], y in [-1, 1]: cell centres x 2.5, 3.5 and y -0.5, 0.5 -> 4 cells, 2 of them on
    # box B: x in [6, 8], y in [2, 4]: 4 cells, all on;  box C: 0.2 m, inside cell (x 8.5, y -3.5): that cell, on
    # box D: entirely outside the grid (x = 20): no cell, left out
    boxes = [Boxes3D(torch.tensor([box(3, 0, 2, 2), box(7, 3, 2, 2), box(8.5, -3.5, 0.2, 0.2), box(20, 0, 2, 2)]))]
    mask = torch.zeros(1, 1, GRID.H, GRID.W)
    for x, y in [(2.5, -0.5), (2.5, 0.5), (6.5, 2.5), (7.5, 2.5), (6.5, 3.5), (7.5, 3.5), (8.5, -3.5)]:
        mask[0, 0][cell(x, y)] = 1
    r = box_recall(mask, boxes, GRID)
    torch.testing.assert_close(r, torch.tensor([0.5, 1.0, 1.0], dtype=torch.float64))
    q = mask_quality(mask, boxes, GRID)
    assert q["mask_recall"] == pytest.approx(2.5 / 3) and q["mask_boxes_covered"] == pytest.approx(2 / 3)
    assert q["n_boxes"] == 3


def test_rotated_box_cells_and_frames():
    # a 2 x 2 box rotated 45 degrees around (5, 0) (a cell corner): the diamond |dx| + |dy| <= sqrt(2) holds the
    # 4 cell centres at (+-0.5, +-0.5) and none of the next ring (|1.5| + |0.5| = 2 > 1.41); one of 4 on -> 0.25
    boxes = [Boxes3D.empty(), Boxes3D(torch.tensor([box(5, 0, 2, 2, math.pi / 4)]))]
    mask = torch.zeros(2, 1, GRID.H, GRID.W)
    mask[0] = 1  # frame 0 has no box: its mask does not count
    mask[1, 0][cell(4.5, -0.5)] = 1
    torch.testing.assert_close(box_recall(mask, boxes, GRID), torch.tensor([0.25], dtype=torch.float64))


def test_box_cells_rule_matches_boxes_mask():
    """boxes_mask (the mask net's target) is the union of the cells box_recall counts: recall 1 on it."""
    g = torch.Generator().manual_seed(0)
    t = torch.cat([torch.rand(6, 1, generator=g) * 10, torch.rand(6, 1, generator=g) * 10 - 5,
                   torch.zeros(6, 1), torch.rand(6, 2, generator=g) * 3 + 0.3, torch.ones(6, 1),
                   torch.rand(6, 1, generator=g) * 6], dim=1)
    boxes = [Boxes3D(t)]
    full = boxes_mask(boxes, GRID, 0.0)
    assert (box_recall(full, boxes, GRID) == 1).all()
    assert box_recall(torch.zeros_like(full), boxes, GRID).sum() == 0


def test_no_boxes_gives_nan_recall_and_an_empty_mask_counts_no_tile():
    q = mask_quality(torch.zeros(1, 1, GRID.H, GRID.W), [Boxes3D.empty()], GRID)
    assert math.isnan(q["mask_recall"]) and math.isnan(q["mask_boxes_covered"])
    assert all(q[f"tiles_active_s{s}"] == 0 for s in (1, 2, 4, 8, 16))


def test_tile_activity_per_stride():
    m = torch.zeros(1, 1, 64, 64)
    m[0, 0, 40, 40] = 1  # one cell: 1 of 16 tiles at stride 1, 1 of 4 at stride 2, the one tile from stride 4
    assert tile_activity(m) == [1 / 16, 1 / 4, 1.0, 1.0, 1.0]
    m = torch.zeros(2, 1, 48, 48)  # 3 x 3 tiles per frame at stride 1; 24 x 24 at stride 2: 2 x 2 (ceil)
    m[1, 0, 0, 47] = 1
    assert tile_activity(m, strides=(1, 2)) == [1 / 18, 1 / 8]


def test_mask_must_fit_the_frames_and_grid():
    with pytest.raises(ValueError, match="does not fit"):
        box_recall(torch.zeros(1, 1, 5, 5), [Boxes3D.empty()], GRID)


def test_validation_logs_mask_quality_and_plan(tmp_path, tiny_root):
    """One epoch with validation: TensorBoard holds val/mask_recall, val/mask_boxes_covered, the tile shares
    per stride and the plan per stage (scalars and text)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from detector.tasks import train
    from tests.nn.test_plan import COST_OVERRIDE
    from tests.test_train import _cfg

    cfg = _cfg(tmp_path, tiny_root, "mask=road_map", "model.block_size=[auto,16,16,16,16]",
               "model.head_block_size=auto", COST_OVERRIDE, "trainer.check_val_every_n_epoch=1",
               "trainer.log_every_n_steps=1", "evaluate_after=false")
    train(cfg)
    acc = EventAccumulator(str(next((tmp_path / "tensorboard").rglob("events.out.tfevents.*")).parent)).Reload()
    tags = set(acc.Tags()["scalars"])
    want = {"val/mask_recall", "val/mask_boxes_covered", *(f"val/tiles_active_s{s}" for s in (1, 2, 4, 8, 16)),
            "plan/stem", "plan/head"}
    assert want <= tags, sorted(tags)
    assert 0 <= acc.Scalars("val/mask_recall")[-1].value <= 1
    assert acc.Tags()["tensors"] or acc.Tags().get("text"), acc.Tags()  # the plan as text


def test_plan_scalars_are_logged_at_the_steps_lightning_writes(tmp_path, tiny_root):
    """The per-step scalars (losses, the plan) are only logged on the steps Lightning writes (every
    log_every_n_steps): with 3 over 7 steps (0-6) they land at steps 2 and 5, where Lightning writes when every
    step logs (its rule: (step + 1) % 3 == 0) - none lost, none at other steps."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from detector.tasks import train
    from tests.nn.test_plan import COST_OVERRIDE
    from tests.test_train import _cfg

    cfg = _cfg(tmp_path, tiny_root, "mask=road_map", "model.block_size=auto", "model.head_block_size=auto",
               COST_OVERRIDE, "trainer.max_epochs=20", "trainer.max_steps=7", "trainer.limit_val_batches=0",
               "trainer.log_every_n_steps=3", "evaluate_after=false")
    train(cfg)
    acc = EventAccumulator(str(next((tmp_path / "tensorboard").rglob("events.out.tfevents.*")).parent)).Reload()
    assert "train/loss" in acc.Tags()["scalars"], sorted(acc.Tags()["scalars"])
    loss_steps = [e.step for e in acc.Scalars("train/loss")]
    assert loss_steps == [2, 5]
    assert [e.step for e in acc.Scalars("plan/stem")] == loss_steps
    assert [e.step for e in acc.Scalars("plan/mac_ratio")] == loss_steps
