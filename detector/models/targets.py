"""PIXOR-style dense targets on the head's BEV grid, and their decoding back to boxes.

Every output cell whose centre lies inside a box shrunk to ``pos_scale`` (in length and width) is a
positive of the box's class (the cell holding the box centre always is); cells inside the box grown
to ``ignore_scale`` but not positive are ignored by the classification loss (PIXOR's ignore band), and
so are cells inside boxes of a neighbouring class (Van for Car, Person_sitting for Pedestrian), which
KITTI's evaluation ignores too. A cell claimed by several boxes goes to the one with the nearest centre.

Regression channels at a positive cell (centre px, py), normalized as (t - mean) / std:
    cos(yaw), sin(yaw), x - px, y - py, log(w / w_a), log(l / l_a), z - z_a, log(h / h_a)
where (l_a, w_a, h_a, z_a) is the class's anchor (typical size and centre height).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from detector.data.structures import Detections
from detector.errors import ConfigError
from detector.geometry.boxes import Boxes3D
from detector.geometry.voxelize import BevGrid

REG_CHANNELS = ("cos", "sin", "dx", "dy", "log_w", "log_l", "dz", "log_h")

# Typical (l, w, h, z of the centre in the LiDAR frame, sensor 1.73 m above the ground) per KITTI class.
DEFAULT_ANCHORS = {
    "Car": (3.9, 1.6, 1.56, -0.95),
    "Pedestrian": (0.8, 0.6, 1.73, -0.87),
    "Cyclist": (1.76, 0.6, 1.73, -0.87),
    "Van": (5.1, 1.9, 2.2, -0.63),
    "Truck": (10.0, 2.6, 3.4, -0.03),
    "Bus": (11.0, 2.6, 3.2, -0.13),
}
NEIGHBOURS = {"Car": ("Van",), "Pedestrian": ("Person_sitting",)}


def missing_anchors(classes: Sequence[str], anchors: Mapping[str, Sequence[float] | None] | None) -> list[str]:
    """The classes with an anchor neither in ``anchors`` (``model.coder.anchors``; a null value gives none) nor in
    :data:`DEFAULT_ANCHORS`."""
    anchors = anchors or {}
    return [c for c in classes if (anchors[c] is None if c in anchors else c not in DEFAULT_ANCHORS)]


def anchor_overrides(missing: Sequence[str], anchors: Mapping[str, Sequence[float] | None] | None) -> list[str]:
    """The command-line overrides that give each class of ``missing`` an anchor: with Hydra's ``+`` where the key
    is new to ``anchors`` (``model.coder.anchors``; without it Hydra refuses: "Could not override ... use +"),
    without where the config holds it (null)."""
    return [f"{'' if c in (anchors or {}) else '+'}model.coder.anchors.{c}=[l,w,h,z]" for c in missing]


@dataclass
class Targets:
    """Dense targets for a batch on the output grid (h rows, w columns)."""

    heatmap: torch.Tensor  # [B, K, h, w] float 0/1
    ignore: torch.Tensor  # [B, K, h, w] bool: excluded from the classification loss
    regression: torch.Tensor  # [B, 8, h, w] normalized, valid where ``positive``
    positive: torch.Tensor  # [B, h, w] bool


class BoxCoder:
    """Encodes boxes into :class:`Targets` and decodes regression maps back into boxes."""

    def __init__(
        self,
        classes: Sequence[str] = ("Car",),
        pos_scale: float = 0.6,
        ignore_scale: float = 1.3,
        anchors: Mapping[str, Sequence[float]] | None = None,
        reg_std: Sequence[float] = (0.7, 0.7, 0.5, 0.5, 0.12, 0.12, 0.25, 0.12),
    ):
        self.classes = tuple(classes)
        if not self.classes:
            raise ValueError("BoxCoder needs at least one class")
        if not 0 < pos_scale <= 1 <= ignore_scale:
            raise ValueError(f"need 0 < pos_scale <= 1 <= ignore_scale, got {pos_scale}, {ignore_scale}")
        if missing := missing_anchors(self.classes, anchors):
            fix = " ".join(anchor_overrides(missing, anchors))
            raise ConfigError(f"model.coder.anchors: no anchor size for class(es) {', '.join(missing)}: add {fix} "
                              "(typical length, width, height and centre height, m)")
        anchors = {**DEFAULT_ANCHORS, **(anchors or {})}
        self.pos_scale = float(pos_scale)
        self.ignore_scale = float(ignore_scale)
        self.anchors = torch.tensor([anchors[c] for c in self.classes], dtype=torch.float32)  # [K, 4]
        if len(reg_std) != len(REG_CHANNELS):
            raise ValueError(f"reg_std needs {len(REG_CHANNELS)} values")
        self.reg_std = torch.tensor(reg_std, dtype=torch.float32)
        self._ignored_as = {n: self.classes.index(c) for c, ns in NEIGHBOURS.items() if c in self.classes for n in ns}

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    # --- encoding ---------------------------------------------------------------------------------
    def encode(self, boxes: Sequence[Boxes3D], names: Sequence[np.ndarray], grid: BevGrid) -> Targets:
        """Targets on ``grid`` (the head's output grid) for a batch of frames (vectorized over all boxes
        of the batch: each box is rasterized in a window of cells around its centre)."""
        B, K, H, W = len(boxes), self.num_classes, grid.H, grid.W
        device = boxes[0].tensor.device if B else torch.device("cpu")
        heat = torch.zeros(B, K, H, W, device=device)
        ignore = torch.zeros(B, K, H, W, dtype=torch.bool, device=device)
        reg = torch.zeros(B, len(REG_CHANNELS), H, W, device=device)
        pos = torch.zeros(B, H, W, dtype=torch.bool, device=device)

        cls_of = {c: k for k, c in enumerate(self.classes)}
        rows_b, rows_box, rows_cls, rows_ign = [], [], [], []
        for b, (bx, nm) in enumerate(zip(boxes, names, strict=True)):
            if len(bx) == 0:
                continue
            cls = np.array([cls_of.get(n, -1) for n in nm], dtype=np.int64)
            ign = np.array([self._ignored_as.get(n, -1) for n in nm], dtype=np.int64)
            keep = (cls >= 0) | (ign >= 0)
            if keep.any():
                rows_b.append(np.full(int(keep.sum()), b))
                rows_box.append(bx.tensor[torch.from_numpy(keep).to(device)].float())
                rows_cls.append(cls[keep])
                rows_ign.append(ign[keep])
        if not rows_box:
            return Targets(heat, ignore, reg, pos)
        t = torch.cat(rows_box)  # [M, 7]
        bidx = torch.from_numpy(np.concatenate(rows_b)).to(device)
        cls = torch.from_numpy(np.concatenate(rows_cls)).to(device)
        ign_cls = torch.from_numpy(np.concatenate(rows_ign)).to(device)

        # Window of cells around each box centre, big enough for the grown box of the largest object.
        cell = grid.resolution
        radius = self.ignore_scale * torch.hypot(t[:, 3], t[:, 4]) / 2
        half = int(math.ceil(float(radius.max()) / cell)) + 1
        off = torch.arange(-half, half + 1, device=device)
        r0, c0 = grid.world_to_cell(t[:, 0], t[:, 1])
        rr = (r0[:, None, None] + off[None, :, None]).expand(-1, len(off), len(off))  # [M, n, n]
        cc = (c0[:, None, None] + off[None, None, :]).expand(-1, len(off), len(off))
        px, py = grid.cell_center(rr, cc)
        px, py = px.to(device), py.to(device)
        dx, dy = px - t[:, 0, None, None], py - t[:, 1, None, None]
        cos, sin = torch.cos(t[:, 6])[:, None, None], torch.sin(t[:, 6])[:, None, None]
        lx, ly = dx * cos + dy * sin, -dx * sin + dy * cos
        hl, hw = t[:, 3, None, None] / 2, t[:, 4, None, None] / 2
        centre = (rr == r0[:, None, None]) & (cc == c0[:, None, None])
        inside_pos = ((lx.abs() <= hl * self.pos_scale) & (ly.abs() <= hw * self.pos_scale)) | centre
        inside_out = (lx.abs() <= hl * self.ignore_scale) & (ly.abs() <= hw * self.ignore_scale)
        valid = grid.in_grid(rr, cc)
        bb = bidx[:, None, None].expand_as(rr)

        # Ignore bands: own class around trained boxes, neighbour class for e.g. Vans.
        band_cls = torch.where(cls >= 0, cls, ign_cls)[:, None, None].expand_as(rr)
        band = inside_out & valid & ~((cls >= 0)[:, None, None] & inside_pos)
        ignore[bb[band], band_cls[band], rr[band], cc[band]] = True

        # Positives: each claimed cell goes to the box with the nearest centre (then the lowest index).
        claim = inside_pos & valid & (cls >= 0)[:, None, None]
        m_idx = torch.arange(len(t), device=device)[:, None, None].expand_as(rr)[claim]
        flat = (bb[claim] * H + rr[claim]) * W + cc[claim]
        dist = torch.hypot(dx, dy)[claim]
        best = torch.full((B * H * W,), float("inf"), device=device).scatter_reduce(0, flat, dist, "amin")
        cand = dist <= best[flat]
        first = torch.full((B * H * W,), len(t), device=device, dtype=torch.long)
        first = first.scatter_reduce(0, flat[cand], m_idx[cand], "amin")
        win = cand & (m_idx == first[flat])
        m, f = m_idx[win], flat[win]
        b_w, r_w, c_w = f // (H * W), (f // W) % H, f % W
        heat[b_w, cls[m], r_w, c_w] = 1.0
        pos[b_w, r_w, c_w] = True
        reg[b_w, :, r_w, c_w] = self._encode_reg(t[m], cls[m], dx[claim][win], dy[claim][win])
        ignore &= heat == 0
        return Targets(heat, ignore, reg, pos)

    def _encode_reg(self, t: torch.Tensor, cls: torch.Tensor, dx: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
        """[P, 8] normalized targets; (dx, dy) = cell centre - box centre."""
        a = self.anchors.to(t.device)[cls]
        raw = torch.stack(
            [
                torch.cos(t[:, 6]), torch.sin(t[:, 6]), -dx, -dy,
                torch.log(t[:, 4] / a[:, 1]), torch.log(t[:, 3] / a[:, 0]),
                t[:, 2] - a[:, 3], torch.log(t[:, 5] / a[:, 2]),
            ],
            dim=1,
        )
        return raw / self.reg_std.to(t.device)

    # --- decoding ---------------------------------------------------------------------------------
    def decode_boxes(self, reg: torch.Tensor, cls: torch.Tensor, px: torch.Tensor, py: torch.Tensor) -> torch.Tensor:
        """[..., 7] LiDAR boxes from normalized regression [..., 8] at cells with centres (px, py) for
        classes ``cls``."""
        v = reg * self.reg_std.to(reg)
        a = self.anchors.to(reg)[cls]
        yaw = torch.atan2(v[..., 1], v[..., 0])
        return torch.stack(
            [
                px + v[..., 2], py + v[..., 3], v[..., 6] + a[..., 3],
                a[..., 0] * torch.exp(v[..., 5].clamp(max=4)), a[..., 1] * torch.exp(v[..., 4].clamp(max=4)),
                a[..., 2] * torch.exp(v[..., 7].clamp(max=4)), yaw,
            ],
            dim=-1,
        )

    def decode(
        self,
        heatmap_logits: torch.Tensor,
        regression: torch.Tensor,
        grid: BevGrid,
        score_threshold: float = 0.1,
        pre_nms_top_k: int = 300,
        nms_iou: float = 0.1,
        max_detections: int = 100,
    ) -> list[Detections]:
        """Per frame: the top-k cells over all classes (batched), their boxes, then rotated NMS in BEV
        (exact IoU) per class."""
        from detector.models.nms import rotated_nms

        B, K, H, W = heatmap_logits.shape
        scores = torch.sigmoid(heatmap_logits.detach().float()).reshape(B, -1)
        k = min(pre_nms_top_k, scores.shape[1])
        top, idx = scores.topk(k, dim=1)
        cls = idx // (H * W)
        cell = idx % (H * W)
        rows, cols = cell // W, cell % W
        px, py = grid.cell_center(rows, cols)
        reg = regression.detach().float().reshape(B, regression.shape[1], H * W)
        reg = torch.gather(reg, 2, cell[:, None, :].expand(-1, reg.shape[1], -1)).transpose(1, 2)  # [B, k, 8]
        boxes = self.decode_boxes(reg, cls, px.to(reg), py.to(reg))  # [B, k, 7]
        out = []
        for b in range(B):
            keep = top[b] > score_threshold
            bx, sc, cl = boxes[b][keep], top[b][keep], cls[b][keep]
            sel = rotated_nms(bx, sc, cl, nms_iou)[:max_detections]
            out.append(Detections(Boxes3D(bx[sel]), sc[sel], cl[sel]))
        return out
