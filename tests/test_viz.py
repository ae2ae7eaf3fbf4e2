"""The bird's-eye-view pictures (detector/viz.py): readable size, boxes in their class colours at their places, GT and
prediction told apart, scores beside the boxes, the mask, range rings, the legend and its scale bar; the old keyword
arguments; and the private XDG_RUNTIME_DIR around open3d's window."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from detector.geometry.boxes import Boxes3D
from detector.geometry.voxelize import BevGrid
from detector.viz import (
    BACKGROUND,
    DET_COLOR,
    GT_COLOR,
    LEGEND_BACKGROUND,
    MASK_COLOR,
    RING_COLOR,
    TEXT_COLOR,
    bev_image,
    class_color,
    gt_color,
    private_runtime_dir,
    text_mask,
)

SMALL = BevGrid((0.0, 51.2), (-19.2, 19.2), (-2.5, 1.0), 0.2, 0.35)  # configs/bev/small.yaml
KITTI = BevGrid((0.0, 70.4), (-40.0, 40.0), (-2.5, 1.0), 0.1, 0.1)  # configs/bev/kitti.yaml


def _px(grid: BevGrid, size: int, x: float, y: float) -> tuple[int, int]:
    """The rule: x up, y left, the map's long side ``size`` pixels: (row, col) of LiDAR (x, y)."""
    s = size / max(grid.x_range[1] - grid.x_range[0], grid.y_range[1] - grid.y_range[0])
    return int((grid.x_range[1] - x) * s), int((grid.y_range[1] - y) * s)


def _near(img: np.ndarray, row: int, col: int, color, r: int = 2) -> bool:
    """Whether ``color`` is among the pixels within ``r`` of (row, col)."""
    win = img[max(row - r, 0):row + r + 1, max(col - r, 0):col + r + 1]
    return bool((win == np.asarray(color, np.uint8)).all(-1).any())


def _count(img: np.ndarray, color) -> int:
    return int((img == np.asarray(color, np.uint8)).all(-1).sum())


@pytest.mark.parametrize(("grid", "rows", "cols"), [(SMALL, 1000, 750), (KITTI, 880, 1000)])
def test_the_map_is_readable_size_whatever_the_cell(grid, rows, cols):
    """1000 px on the map's long side by default (bev=small is 256 x 192 cells, bev=kitti 704 x 800), the legend
    strip under it; ``size`` chooses another."""
    img = bev_image(np.zeros((0, 4), np.float32), grid)
    assert img.dtype == np.uint8 and img.shape[1] == cols and img.shape[0] > rows  # the map, then the legend
    assert max(img.shape[:2]) >= 800
    assert (img[:rows] == BACKGROUND).all(-1).mean() > 0.9  # the map: mostly empty background
    big = bev_image(np.zeros((0, 4), np.float32), grid, size=1600)
    assert big.shape[1] == cols * 1.6


def test_boxes_in_class_colours_at_their_places_with_scores():
    """A labelled Car and a Car and a Pedestrian predicted: each outline in its class's colour at the place the rule
    gives, ground truth in another colour than predictions, each score written right of its box, a prediction scored
    under the threshold not drawn."""
    gt = Boxes3D(torch.tensor([[20.0, 5.0, -1.0, 4.0, 2.0, 1.5, 0.0]]))
    det = Boxes3D(torch.tensor([[30.0, -5.0, -1.0, 4.0, 2.0, 1.5, 0.0], [15.0, -10.0, -1.0, 1.0, 1.0, 1.7, 0.0],
                                [40.0, 10.0, -1.0, 4.0, 2.0, 1.5, 0.0]]))
    img = bev_image(np.zeros((0, 4), np.float32), SMALL, gt_boxes=gt, gt_names=["Car"], det_boxes=det,
                    det_scores=torch.tensor([0.9, 0.8, 0.1]), det_names=["Car", "Pedestrian", "Car"])
    car, ped, car_gt = class_color("Car"), class_color("Pedestrian"), gt_color("Car")
    assert len({car, ped, car_gt}) == 3
    # each box's right edge (y = centre - w/2), half way along it (0.5 m off the middle: the heading line is there too)
    assert _near(img, *_px(SMALL, 1000, 31.0, -6.0), car)
    assert _near(img, *_px(SMALL, 1000, 15.25, -10.5), ped)
    assert _near(img, *_px(SMALL, 1000, 21.0, 4.0), car_gt)
    assert not _near(img, *_px(SMALL, 1000, 21.0, 4.0), car) and not _near(img, *_px(SMALL, 1000, 31.0, -6.0), car_gt)
    # the score below the threshold: no outline there
    assert not _near(img, *_px(SMALL, 1000, 41.0, 9.0), car, r=4)
    # the scores: text of the box's colour right of it (within 60 px), none right of the labelled box
    for (x, y), color in (((30.0, -6.0), car), ((15.0, -10.5), ped)):
        row, col = _px(SMALL, 1000, x, y)
        assert _count(img[row - 10:row + 10, col + 4:col + 60], color) >= 10
    row, col = _px(SMALL, 1000, 20.0, 4.0)
    assert _count(img[row - 10:row + 10, col + 4:col + 60], car) == 0


def test_mask_rings_and_legend():
    """The computation mask shades its cells (the left half here), a range ring every 10 m around the sensor, and the
    legend strip names what is drawn: class swatches, the mask's colour, a scale bar of a round number of metres."""
    mask = np.zeros((SMALL.H, SMALL.W))
    mask[SMALL.H // 2:] = 1  # y > 0: the left half of the picture
    det = Boxes3D(torch.tensor([[30.0, -5.0, -1.0, 4.0, 2.0, 1.5, 0.0]]))
    img = bev_image(np.zeros((0, 4), np.float32), SMALL, det_boxes=det, det_scores=torch.tensor([0.9]),
                    det_names=["Cyclist"], mask=mask)
    rows, cols = 1000, 750
    m, strip = img[:rows], img[rows:]
    assert (m[:, :cols // 2 - 2] == MASK_COLOR).all(-1).mean() > 0.9
    assert not (m[:, cols // 2 + 2:] == MASK_COLOR).all(-1).any()
    # the 10 m ring: most of its points (dotted) where the rule puts them, none at 15 m
    a = np.radians(np.arange(-60, 61, 0.25))
    ring = [_near(m, *_px(SMALL, 1000, 10 * np.cos(t), 10 * np.sin(t)), RING_COLOR, r=1) for t in a]
    off = [_near(m, *_px(SMALL, 1000, 15 * np.cos(t), 15 * np.sin(t)), RING_COLOR, r=0) for t in a]
    assert np.mean(ring) > 0.6 and np.mean(off) < 0.05
    # the legend: its background, the class's and the mask's swatches, text
    assert (strip == LEGEND_BACKGROUND).all(-1).mean() > 0.5
    assert _count(strip, class_color("Cyclist")) > 50 and _count(strip, MASK_COLOR) > 50
    assert _count(strip, TEXT_COLOR) > 200
    # the scale bar: the longest run of text colour along a row spans 1, 2 or 5 x 10^k metres
    runs = []
    for row in (strip == TEXT_COLOR).all(-1):
        padded = np.concatenate([[0], row.astype(int), [0]])
        d = np.flatnonzero(np.diff(padded))
        runs += list(d[1::2] - d[::2])
    metres = max(runs) / (1000 / 51.2)
    assert any(abs(metres - m) < 0.1 for m in (1, 2, 5, 10, 20, 50)), metres
    no_mask = bev_image(np.zeros((0, 4), np.float32), SMALL, det_boxes=det, det_scores=torch.tensor([0.9]),
                        det_names=["Cyclist"])
    assert _count(no_mask, MASK_COLOR) == 0  # no mask, no mask entry in the legend


def test_points_are_drawn_where_they_lie():
    pts = np.array([[25.0, 0.0, -1.0, 1.0], [10.0, 10.0, -1.0, 0.0]], np.float32)
    img = bev_image(pts, SMALL, rings=None)
    assert _near(img, *_px(SMALL, 1000, 25.0, 0.0), (255, 255, 255), r=1)  # bright: reflectance 1
    assert _near(img, *_px(SMALL, 1000, 10.0, 10.0), (120, 120, 120), r=1)  # dim: reflectance 0


def test_the_old_keyword_arguments_still_draw():
    """visualize's call (no class names): ground truth green, predictions red, the old one-pixel-per-cell picture
    with size=None."""
    box = Boxes3D(torch.tensor([[20.0, 5.0, -1.0, 4.0, 2.0, 1.5, 0.0]]))
    other = Boxes3D(torch.tensor([[30.0, -5.0, -1.0, 4.0, 2.0, 1.5, 0.0]]))
    img = bev_image(np.zeros((0, 4), np.float32), SMALL, gt_boxes=box, det_boxes=other, mask=None)
    assert _near(img, *_px(SMALL, 1000, 21.0, 4.0), GT_COLOR) and _near(img, *_px(SMALL, 1000, 31.0, -6.0), DET_COLOR)
    small = bev_image(np.zeros((0, 4), np.float32), SMALL, gt_boxes=box, size=None)
    assert small.shape == (SMALL.W, SMALL.H, 3) and _count(small, GT_COLOR) > 0


def test_font_draws_distinct_glyphs():
    assert text_mask("10 m").shape == (8, 6 * 4 - 1)
    assert text_mask("0", 2).shape == (16, 10)
    glyphs = {c: text_mask(c).tobytes() for c in "0123456789.m"}
    assert len(set(glyphs.values())) == len(glyphs)
    assert not text_mask(" ").any() and text_mask("?").any()


def test_private_runtime_dir(monkeypatch):
    """Unset (or pointing nowhere): a private folder of this user's (mode 0700) while the block runs, then the
    variable as it was and the folder gone; a valid one is left alone."""
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    with private_runtime_dir():
        d = os.environ["XDG_RUNTIME_DIR"]
        assert os.path.isdir(d) and os.stat(d).st_uid == os.getuid() and os.stat(d).st_mode & 0o777 == 0o700
    assert "XDG_RUNTIME_DIR" not in os.environ and not os.path.exists(d)
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/nonexistent/run")
    with private_runtime_dir():
        assert os.environ["XDG_RUNTIME_DIR"] != "/nonexistent/run"
    assert os.environ["XDG_RUNTIME_DIR"] == "/nonexistent/run"
    own = os.path.expanduser("~")
    if os.stat(own).st_uid == os.getuid():
        monkeypatch.setenv("XDG_RUNTIME_DIR", own)
        with private_runtime_dir():
            assert os.environ["XDG_RUNTIME_DIR"] == own
