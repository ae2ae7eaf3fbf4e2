"""Bird's-eye-view pictures of a frame: points, computation mask, ground-truth and predicted boxes, to be looked at.

One drawing, :func:`bev_image`, for every caller (``detector-predict``, ``detector-visualize``, TensorBoard's
validation images). The map is drawn at ``size`` pixels on its long side (whatever the grid's cell size): x
(forward) points up, y (left) points left, like a driver's map, with range rings around the sensor every ``rings``
metres (labelled). Each class has its colour (:func:`class_color`): ground truth is filled with it (translucent) and
outlined in a light tint of it, a prediction is a thicker outline in the colour itself with its score written beside
it; a line from the centre to the front edge shows the heading. The computation mask shades the cells the sparse
network computes. A strip under the map holds the legend (classes, ground truth vs prediction, mask) and a metre
scale bar.

Drawn with numpy only (text with a built-in 5x8 bitmap font); :func:`write_png` writes it with open3d.
:func:`private_runtime_dir` keeps a graphics library's complaint about ``XDG_RUNTIME_DIR`` off the console while
open3d opens its offscreen window.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from detector.geometry.boxes import Boxes3D
from detector.geometry.voxelize import BevGrid

DEFAULT_SIZE = 1000  # pixels on the map's long side
BACKGROUND = (14, 14, 18)
MASK_COLOR = (40, 70, 140)  # the cells the computation mask keeps (drawn exactly this colour where no point lies)
RING_COLOR = (95, 95, 95)
TEXT_COLOR = (230, 230, 230)
LEGEND_BACKGROUND = (32, 32, 38)
STYLE_COLOR = (170, 170, 170)  # the legend's ground-truth and prediction entries where each class has its colour
# The classes of KITTI and the simulator keep these colours; any other class gets one of EXTRA_COLORS by its name.
CLASS_COLORS = {"Car": (255, 90, 60), "Pedestrian": (60, 200, 255), "Cyclist": (255, 215, 0)}
EXTRA_COLORS = ((190, 110, 255), (80, 230, 120), (255, 120, 200), (0, 210, 190), (255, 160, 90), (150, 170, 255))
GT_TINT = 0.55  # ground truth: outlined in the class colour mixed this much with white,
GT_FILL = 0.35  # and filled with the class colour at this opacity
# Kept for callers of the old drawing: ground truth green, predictions red where no class is given.
GT_COLOR = (60, 220, 60)
DET_COLOR = (255, 60, 60)


def class_color(name: str) -> tuple[int, int, int]:
    """The colour of a class's predictions (the same for every picture and run)."""
    if name in CLASS_COLORS:
        return CLASS_COLORS[name]
    return EXTRA_COLORS[zlib.crc32(str(name).encode()) % len(EXTRA_COLORS)]


def gt_color(name: str) -> tuple[int, int, int]:
    """The outline colour of a class's ground truth: a light tint of :func:`class_color`."""
    return _tint(class_color(name))


def _tint(color) -> tuple[int, int, int]:
    c = np.asarray(color, float)
    return tuple(int(round(v)) for v in c + GT_TINT * (255 - c))


# --- the font --------------------------------------------------------------------------------------------------
# 5x8 glyphs as 5 column bytes (bit 0 the top row; row 7 for descenders), the classic LCD font's shapes.
_GLYPHS = {
    " ": "0000000000", "!": "00005f0000", "#": "147f147f14", "%": "2313086462", "'": "0000070000",
    "(": "001c224100", ")": "0041221c00", "*": "14083e0814", "+": "08083e0808", ",": "0080600000",
    "-": "0808080808", ".": "0060600000", "/": "2010080402", ":": "0036360000", "<": "0814224100",
    "=": "1414141414", ">": "0041221408", "?": "0201510906", "[": "007f414100", "]": "0041417f00",
    "_": "4040404040", "|": "00007f0000",
    "0": "3e5149453e", "1": "00427f4000", "2": "4261514946", "3": "2141454b31", "4": "1814127f10",
    "5": "2745454539", "6": "3c4a494930", "7": "0171090503", "8": "3649494936", "9": "064949291e",
    "A": "7e1111117e", "B": "7f49494936", "C": "3e41414122", "D": "7f4141221c", "E": "7f49494941",
    "F": "7f09090901", "G": "3e4149497a", "H": "7f0808087f", "I": "00417f4100", "J": "2040413f01",
    "K": "7f08142241", "L": "7f40404040", "M": "7f020c027f", "N": "7f0408107f", "O": "3e4141413e",
    "P": "7f09090906", "Q": "3e4151215e", "R": "7f09192946", "S": "4649494931", "T": "01017f0101",
    "U": "3f4040403f", "V": "1f2040201f", "W": "3f4038403f", "X": "6314081463", "Y": "0708700807",
    "Z": "6151494543",
    "a": "2054545478", "b": "7f48444438", "c": "3844444420", "d": "384444487f", "e": "3854545418",
    "f": "087e090102", "g": "18a4a4a47c", "h": "7f08040478", "i": "00447d4000", "j": "4080847d00",
    "k": "7f10284400", "l": "00417f4000", "m": "7c04180478", "n": "7c08040478", "o": "3844444438",
    "p": "fc24242418", "q": "18242418fc", "r": "7c08040408", "s": "4854545420", "t": "043f444020",
    "u": "3c4040207c", "v": "1c2040201c", "w": "3c4030403c", "x": "4428102844", "y": "1ca0a0a07c",
    "z": "4464544c44",
}
GLYPH_W, GLYPH_H = 5, 8


def _glyph(ch: str) -> np.ndarray:
    code = bytes.fromhex(_GLYPHS.get(ch, _GLYPHS["?"]))
    return (np.asarray(list(code), np.uint8)[None, :] >> np.arange(GLYPH_H)[:, None] & 1).astype(bool)  # [7, 5]


_FONT = {ch: _glyph(ch) for ch in _GLYPHS}


def text_mask(text: str, scale: int = 1) -> np.ndarray:
    """[8 * scale, 6 * scale * len(text) - scale] bool: ``text`` in the built-in font (one blank column between
    letters), each font pixel ``scale`` x ``scale``; characters it lacks are drawn as '?'."""
    if not text:
        return np.zeros((GLYPH_H * scale, 0), bool)
    cols = []
    for i, ch in enumerate(text):
        if i:
            cols.append(np.zeros((GLYPH_H, 1), bool))
        cols.append(_FONT.get(ch, _FONT["?"]))
    m = np.concatenate(cols, axis=1)
    return np.kron(m, np.ones((scale, scale), bool)) if scale > 1 else m


def text_size(text: str, scale: int = 1) -> tuple[int, int]:
    """(height, width) in pixels of :func:`text_mask`."""
    return GLYPH_H * scale, max(0, (GLYPH_W + 1) * scale * len(text) - scale)


def draw_text(img: np.ndarray, text: str, row: int, col: int, color, scale: int = 1, outline: bool = True) -> None:
    """Draw ``text`` with its top-left corner at (row, col), clipped to the image; ``outline``: a dark 1-px border
    keeps it readable over points."""
    m = text_mask(text, scale)
    if outline:
        big = np.pad(m, 2)
        h, w = m.shape[0] + 2, m.shape[1] + 2
        grown = np.zeros((h, w), bool)
        for dr in range(3):
            for dc in range(3):
                grown |= big[dr:dr + h, dc:dc + w]
        _paint(img, grown & ~np.pad(m, 1), row - 1, col - 1, (0, 0, 0))
    _paint(img, m, row, col, color)


def _paint(img: np.ndarray, m: np.ndarray, row: int, col: int, color) -> None:
    """Set the pixels of bool mask ``m`` placed with its top-left at (row, col) to ``color`` (clipped)."""
    h, w = img.shape[:2]
    r0, c0 = max(row, 0), max(col, 0)
    r1, c1 = min(row + m.shape[0], h), min(col + m.shape[1], w)
    if r0 >= r1 or c0 >= c1:
        return
    sub = m[r0 - row:r1 - row, c0 - col:c1 - col]
    img[r0:r1, c0:c1][sub] = color


# --- geometry: metres to pixels --------------------------------------------------------------------------------
@dataclass(frozen=True)
class BevView:
    """Where the grid's metres land in the map: ``scale`` pixels per metre, row 0 at x_max, column 0 at y_max."""

    grid: BevGrid
    scale: float
    rows: int
    cols: int

    @classmethod
    def of(cls, grid: BevGrid, size: int | None) -> BevView:
        """The view with ``size`` pixels on its long side (None: one pixel per grid cell)."""
        x_ext = grid.x_range[1] - grid.x_range[0]
        y_ext = grid.y_range[1] - grid.y_range[0]
        scale = 1.0 / grid.resolution if size is None else float(size) / max(x_ext, y_ext)
        return cls(grid, scale, int(round(x_ext * scale)), int(round(y_ext * scale)))

    def pixels(self, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Image (row, col) as floats of LiDAR (x, y)."""
        return (self.grid.x_range[1] - x) * self.scale, (self.grid.y_range[1] - y) * self.scale


def _stamp(img: np.ndarray, r: np.ndarray, c: np.ndarray, color, width: int = 1) -> None:
    """Set the pixels (floor(r), floor(c)) (each grown to ``width`` x ``width``) to ``color``, clipped."""
    r, c = np.floor(r).astype(np.int64), np.floor(c).astype(np.int64)
    if width > 1:
        d = np.arange(width) - (width - 1) // 2
        r = (r[:, None, None] + d[None, :, None]).repeat(width, 2).ravel()
        c = (c[:, None, None] + d[None, None, :]).repeat(width, 1).ravel()
    h, w = img.shape[:2]
    ok = (r >= 0) & (r < h) & (c >= 0) & (c < w)
    img[r[ok], c[ok]] = color


def _segments(img: np.ndarray, a: np.ndarray, b: np.ndarray, color, width: int = 1) -> None:
    """Lines from pixel points a[k] to b[k] ([K, 2] (row, col) floats), ``width`` pixels wide."""
    if len(a) == 0:
        return
    length = np.hypot(*(b - a).T)
    n = int(np.ceil(length.max() * 2)) + 2  # two samples a pixel
    t = np.linspace(0.0, 1.0, n)
    p = a[:, None, :] + t[None, :, None] * (b - a)[:, None, :]  # [K, n, 2]
    _stamp(img, p[..., 0].ravel() + 0.5, p[..., 1].ravel() + 0.5, color, width)


def _box_pixels(view: BevView, boxes: Boxes3D) -> np.ndarray:
    """[N, 4, 2] (row, col) of the boxes' BEV corners (front-left, rear-left, rear-right, front-right)."""
    corners = boxes.bev_corners().detach().cpu().double().numpy()
    r, c = view.pixels(corners[..., 0], corners[..., 1])
    return np.stack([r, c], axis=-1)


def _draw_boxes(img: np.ndarray, px: np.ndarray, color, width: int, heading: bool = True) -> None:
    """Outline and heading line (centre to the front edge's middle) of boxes given by their corner pixels."""
    for i in range(4):
        _segments(img, px[:, i], px[:, (i + 1) % 4], color, width)
    if heading:
        _segments(img, px.mean(axis=1), (px[:, 0] + px[:, 3]) / 2, color, width)


def _fill_boxes(img: np.ndarray, px: np.ndarray, color, alpha: float) -> None:
    """Blend ``color`` at opacity ``alpha`` into the pixels whose centres lie inside the boxes (corner pixels
    [N, 4, 2], counter-clockwise in the LiDAR frame)."""
    h, w = img.shape[:2]
    tint = np.asarray(color, np.float32)
    for quad in px:
        r0, c0 = np.maximum(np.floor(quad.min(axis=0)).astype(int), 0)
        r1, c1 = np.minimum(np.ceil(quad.max(axis=0)).astype(int) + 1, (h, w))
        if r0 >= r1 or c0 >= c1:
            continue
        rr, cc = np.meshgrid(np.arange(r0, r1) + 0.5, np.arange(c0, c1) + 0.5, indexing="ij")
        side = [(quad[(i + 1) % 4, 0] - quad[i, 0]) * (cc - quad[i, 1]) - (quad[(i + 1) % 4, 1] - quad[i, 1])
                * (rr - quad[i, 0]) for i in range(4)]
        inside = np.all([s >= 0 for s in side], axis=0) | np.all([s <= 0 for s in side], axis=0)
        sub = img[r0:r1, c0:c1]
        sub[inside] = (sub[inside] * (1 - alpha) + tint * alpha).astype(np.uint8)


def _circle(img: np.ndarray, view: BevView, radius_m: float, color) -> None:
    n = int(2 * np.pi * radius_m * view.scale * 2) + 8
    a = np.linspace(-np.pi, np.pi, n, endpoint=False)
    r, c = view.pixels(radius_m * np.cos(a), radius_m * np.sin(a))
    dotted = (np.arange(n) // 6) % 2 == 0  # 3-px dots, 3-px gaps
    _stamp(img, r[dotted], c[dotted], color)


def _ring_label_spot(view: BevView, radius_m: float, text_hw: tuple[int, int]) -> tuple[int, int] | None:
    """Top-left pixel of a ring's label: at the ring's point furthest to the left (the largest angle up to 50 degrees
    from forward) whose label fits in the map; None when none does."""
    for deg in range(50, -51, -2):
        a = np.radians(deg)
        r, c = view.pixels(np.array([radius_m * np.cos(a)]), np.array([radius_m * np.sin(a)]))
        row, col = int(r[0]) - text_hw[0] - 2, int(c[0]) + 3
        if 0 <= row and row + text_hw[0] < view.rows and 0 <= col and col + text_hw[1] < view.cols:
            return row, col
    return None


def _nice_length(target_m: float) -> float:
    """The largest of 1, 2, 5 x 10^k metres not above ``target_m`` (at least 1 m)."""
    best = 1.0
    for k in range(0, 4):
        for m in (1, 2, 5):
            if m * 10**k <= target_m:
                best = float(m * 10**k)
    return best


def _as_numpy(x) -> np.ndarray:
    return np.asarray(x.detach().cpu() if isinstance(x, torch.Tensor) else x)


def _names(names, n: int, fallback: str) -> list[str]:
    if names is None:
        return [fallback] * n
    names = [str(s) for s in names]
    if len(names) != n:
        raise ValueError(f"{len(names)} class names for {n} boxes")
    return names


# --- the picture -------------------------------------------------------------------------------------------------
def bev_image(
    points: np.ndarray | torch.Tensor,
    grid: BevGrid,
    gt_boxes: Boxes3D | None = None,
    det_boxes: Boxes3D | None = None,
    det_scores: torch.Tensor | np.ndarray | None = None,
    mask: torch.Tensor | np.ndarray | None = None,
    score_threshold: float = 0.3,
    *,
    gt_names: Sequence[str] | None = None,
    det_names: Sequence[str] | None = None,
    size: int | None = DEFAULT_SIZE,
    rings: float | None = 10.0,
    legend: bool = True,
    title: str | None = None,
) -> np.ndarray:
    """The bird's-eye view of one frame as an [rows, cols, 3] uint8 image (x up, y left).

    Args:
        points: [N, >=4] LiDAR points (x, y, z, reflectance), drawn grey by reflectance.
        grid: the BEV grid: the map covers its x and y ranges.
        gt_boxes: ground truth, filled with its class colour; ``gt_names`` their classes (None: green outlines).
        det_boxes: predictions, outlined in their class colour (``det_names`` None: red), ``det_scores`` their scores
            (written beside each box; only those scored at least ``score_threshold`` are drawn).
        mask: the computation mask [H, W] (y, x cells over the grid, any resolution; > 0.5 computed), shaded.
        size: pixels on the map's long side (None: one pixel per grid cell, no text).
        rings: range rings around the sensor every this many metres, labelled (None: none).
        legend: a strip under the map: classes, ground truth vs prediction, mask, scale bar, ``title``.
    """
    view = BevView.of(grid, size)
    img = np.empty((view.rows, view.cols, 3), np.uint8)
    img[:] = BACKGROUND
    if mask is not None:
        _draw_mask(img, view, _as_numpy(mask))
    text_scale = 0 if size is None else max(1, int(round(max(view.rows, view.cols) / 560)))
    if rings and text_scale:
        _draw_rings(img, view, float(rings), text_scale)
    _draw_points(img, view, _as_numpy(points))
    drawn_classes: dict[str, None] = {}
    if gt_boxes is not None and len(gt_boxes):
        names = _names(gt_names, len(gt_boxes), "")
        px = _box_pixels(view, gt_boxes)
        for name in dict.fromkeys(names):
            sel = np.asarray([n == name for n in names])
            if gt_names is None:  # no classes: the old green outline
                _draw_boxes(img, px[sel], GT_COLOR, 1)
                continue
            _fill_boxes(img, px[sel], class_color(name), GT_FILL)
            _draw_boxes(img, px[sel], gt_color(name), 1)
            drawn_classes[name] = None
    if det_boxes is not None and len(det_boxes):
        scores = None if det_scores is None else _as_numpy(det_scores).astype(np.float64).reshape(-1)
        names = _names(det_names, len(det_boxes), "")
        keep = np.ones(len(det_boxes), bool) if scores is None else scores >= score_threshold
        idx = np.flatnonzero(keep)
        px = _box_pixels(view, det_boxes[torch.as_tensor(keep)]) if len(idx) else np.zeros((0, 4, 2))
        kept_names = [names[i] for i in idx]
        for name in dict.fromkeys(kept_names):
            sel = np.asarray([n == name for n in kept_names])
            color = DET_COLOR if det_names is None else class_color(name)
            _draw_boxes(img, px[sel], color, 2 if text_scale else 1)
            if det_names is not None:
                drawn_classes[name] = None
        if scores is not None and text_scale:
            for k, i in enumerate(idx):
                color = DET_COLOR if det_names is None else class_color(names[i])
                _draw_score(img, px[k], f"{scores[i]:.2f}", color, text_scale)
    if not (legend and text_scale):
        return img
    strip = _legend(view.cols, text_scale, list(drawn_classes), gt_boxes is not None, det_boxes is not None,
                    None if det_scores is None or det_boxes is None else score_threshold, mask is not None,
                    view.scale, title)
    return np.concatenate([img, strip], axis=0)


def _draw_mask(img: np.ndarray, view: BevView, m: np.ndarray) -> None:
    m = np.asarray(m).reshape(m.shape[-2:]) > 0.5  # [H (y), W (x)] over the grid
    g = view.grid
    x = g.x_range[1] - (np.arange(view.rows) + 0.5) / view.scale
    y = g.y_range[1] - (np.arange(view.cols) + 0.5) / view.scale
    ix = np.clip(((x - g.x_range[0]) / (g.x_range[1] - g.x_range[0]) * m.shape[1]).astype(np.int64), 0, m.shape[1] - 1)
    iy = np.clip(((y - g.y_range[0]) / (g.y_range[1] - g.y_range[0]) * m.shape[0]).astype(np.int64), 0, m.shape[0] - 1)
    img[m[iy[None, :], ix[:, None]]] = MASK_COLOR


def _draw_rings(img: np.ndarray, view: BevView, every: float, text_scale: int) -> None:
    g = view.grid
    far = max(np.hypot(x, y) for x in g.x_range for y in g.y_range)
    for k in range(1, int(far // every) + 1):
        radius = k * every
        _circle(img, view, radius, RING_COLOR)
        label = f"{radius:g} m"
        spot = _ring_label_spot(view, radius, text_size(label, text_scale))
        if spot is not None:
            draw_text(img, label, *spot, RING_COLOR, text_scale, outline=False)
    r, c = view.pixels(np.zeros(1), np.zeros(1))  # the sensor: a small triangle pointing forward, tip at it
    if -0.5 <= r[0] <= view.rows + 0.5 and 0 <= c[0] < view.cols:  # (on the edge where x starts at 0)
        n = 4 * text_scale + 2
        for k in range(n):
            row = int(round(r[0])) - n + k
            if 0 <= row < view.rows:
                img[row, max(int(c[0]) - k // 2, 0):int(c[0]) + k // 2 + 1] = TEXT_COLOR


def _draw_points(img: np.ndarray, view: BevView, pts: np.ndarray) -> None:
    if len(pts) == 0:
        return
    r, c = view.pixels(pts[:, 0], pts[:, 1])
    inside = (r >= 0) & (r < view.rows) & (c >= 0) & (c < view.cols)
    shade = np.clip(120 + 400 * pts[inside, 3], 120, 255).astype(np.uint8) if pts.shape[1] > 3 else \
        np.full(int(inside.sum()), 180, np.uint8)
    width = max(1, int(round(0.08 * view.scale)))
    rr, cc = np.floor(r[inside]).astype(np.int64), np.floor(c[inside]).astype(np.int64)
    for dr in range(width):
        for dc in range(width):
            ok = (rr + dr < view.rows) & (cc + dc < view.cols)
            img[rr[ok] + dr, cc[ok] + dc] = shade[ok, None]


def _draw_score(img: np.ndarray, px: np.ndarray, text: str, color, scale: int) -> None:
    """``text`` beside a box given by its corner pixels: right of it, or left where the right has no room."""
    h, w = text_size(text, scale)
    row = int(round(px[:, 0].mean())) - h // 2
    col = int(np.ceil(px[:, 1].max())) + 3
    if col + w > img.shape[1]:
        col = int(np.floor(px[:, 1].min())) - 3 - w
    draw_text(img, text, row, col, color, scale)


def _legend(cols: int, scale: int, classes: list[str], has_gt: bool, has_det: bool, threshold: float | None,
            has_mask: bool, px_per_m: float, title: str | None) -> np.ndarray:
    """The strip under the map: entries laid out left to right in as many lines as they need."""
    line_h = (GLYPH_H + 6) * scale
    pad = 4 * scale
    swatch = 18 * scale
    entries: list[tuple[str, tuple | None]] = []  # (text, (kind, class name or colour) of its swatch)
    if title:
        entries.append((title, None))
    for name in classes:
        entries.append((name, ("class", name)))
    if has_gt:  # the styles in a neutral colour where the classes have theirs, else in the one colour used
        entries.append(("ground truth", ("gt", STYLE_COLOR if classes else GT_COLOR)))
    if has_det:
        entries.append(("prediction" + (f" (score >= {threshold:.2f})" if threshold is not None else ""),
                        ("det", STYLE_COLOR if classes else DET_COLOR)))
    if has_mask:
        entries.append(("computation mask", ("mask", None)))
    bar_m = _nice_length(0.2 * cols / px_per_m)
    bar_text = f"{bar_m:g} m"
    widths = [(text_size(t, scale)[1] + (swatch + pad if s is not None else 0)) for t, s in entries]
    bar_w = int(round(bar_m * px_per_m)) + pad + text_size(bar_text, scale)[1]
    lines, x = 1, pad
    places = []
    for w in [*widths, bar_w]:
        if x + w > cols - pad and x > pad:
            lines, x = lines + 1, pad
        places.append((lines - 1, x))
        x += w + 3 * pad
    strip = np.empty((lines * line_h + 2 * pad, cols, 3), np.uint8)
    strip[:] = LEGEND_BACKGROUND
    for (text, sw), (ln, x0) in zip(entries, places[:-1], strict=True):
        top = pad + ln * line_h
        mid = top + line_h // 2
        x = x0
        if sw is not None:
            kind, name = sw
            if kind == "mask":
                strip[mid - 4 * scale:mid + 4 * scale, x:x + swatch] = MASK_COLOR
            elif kind == "class":
                strip[mid - 4 * scale:mid + 4 * scale, x:x + swatch] = class_color(name)
            elif kind == "gt":
                box = np.array([[[mid - 4 * scale, x + swatch], [mid - 4 * scale, x], [mid + 4 * scale, x],
                                 [mid + 4 * scale, x + swatch]]], float)
                if name == STYLE_COLOR:
                    _fill_boxes(strip, box, STYLE_COLOR, GT_FILL)
                _draw_boxes(strip, box, _tint(name) if name == STYLE_COLOR else name, 1, heading=False)
            else:
                box = np.array([[[mid - 4 * scale, x + swatch], [mid - 4 * scale, x], [mid + 4 * scale, x],
                                 [mid + 4 * scale, x + swatch]]], float)
                _draw_boxes(strip, box, name, 2, heading=False)
            x += swatch + pad
        draw_text(strip, text, mid - text_size(text, scale)[0] // 2, x, TEXT_COLOR, scale, outline=False)
    ln, x = places[-1]
    mid = pad + ln * line_h + line_h // 2
    length = int(round(bar_m * px_per_m))
    strip[mid - scale:mid + scale, x:x + length] = TEXT_COLOR
    for tick in (x, x + length - 1):
        strip[mid - 4 * scale:mid + 4 * scale, tick:tick + max(1, scale)] = TEXT_COLOR
    draw_text(strip, bar_text, mid - text_size(bar_text, scale)[0] // 2, x + length + pad, TEXT_COLOR, scale,
              outline=False)
    return strip


def write_png(path, img: np.ndarray) -> None:
    """Write an [H, W, 3] uint8 image as PNG (open3d's writer)."""
    import open3d as o3d

    if not o3d.io.write_image(str(path), o3d.geometry.Image(np.ascontiguousarray(img))):
        raise OSError(f"{path}: could not write PNG")


@contextlib.contextmanager
def private_runtime_dir() -> Iterator[None]:
    """While open3d opens a window: ``XDG_RUNTIME_DIR`` set to a private temporary folder when it is unset or not a
    folder of this user's, so the window system's probe (libwayland) does not print ``error: XDG_RUNTIME_DIR is
    invalid or not set`` on stderr, a line that reads as ours. Restored afterwards."""
    old = os.environ.get("XDG_RUNTIME_DIR")
    try:
        valid = old is not None and os.path.isdir(old) and os.stat(old).st_uid == os.getuid()
    except OSError:
        valid = False
    if valid:
        yield
        return
    tmp = tempfile.mkdtemp(prefix="detector-xdg-")  # mode 0700, as the variable's specification asks
    os.environ["XDG_RUNTIME_DIR"] = tmp
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("XDG_RUNTIME_DIR", None)
        else:
            os.environ["XDG_RUNTIME_DIR"] = old
        shutil.rmtree(tmp, ignore_errors=True)
