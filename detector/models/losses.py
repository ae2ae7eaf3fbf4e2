"""Detection losses: focal loss on the class heatmap (with PIXOR's ignore band), smooth-L1 on the
regression of positive cells, BCE/focal for the predicted computation mask."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from detector.models.targets import Targets


def sigmoid_focal_loss(
    logits: torch.Tensor, target: torch.Tensor, alpha: float = 0.25, gamma: float = 2.0
) -> torch.Tensor:
    """Element-wise focal loss (Lin et al. 2017) of sigmoid logits against 0/1 targets."""
    p = torch.sigmoid(logits)
    ce = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
    p_t = p * target + (1 - p) * (1 - target)
    a_t = alpha * target + (1 - alpha) * (1 - target)
    return a_t * (1 - p_t).pow(gamma) * ce


@dataclass
class LossTerms:
    total: torch.Tensor
    cls: torch.Tensor
    reg: torch.Tensor
    num_positive: int


def detection_loss(
    heatmap_logits: torch.Tensor,
    regression: torch.Tensor,
    targets: Targets,
    alpha: float = 0.25,
    gamma: float = 2.0,
    reg_weight: float = 2.0,
    smooth_l1_beta: float = 1.0 / 9,
) -> LossTerms:
    """Focal loss over non-ignored cells, normalized by the number of positive cells; smooth-L1 over
    the positive cells' 8 regression channels, averaged over those cells."""
    logits = heatmap_logits.float()
    n_pos = int(targets.positive.sum())
    norm = max(n_pos, 1)
    fl = sigmoid_focal_loss(logits, targets.heatmap, alpha, gamma)
    cls = fl.masked_fill(targets.ignore, 0.0).sum() / norm
    if n_pos:
        pred = regression.float().permute(0, 2, 3, 1)[targets.positive]  # [P, 8]
        tgt = targets.regression.permute(0, 2, 3, 1)[targets.positive]
        reg = F.smooth_l1_loss(pred, tgt, beta=smooth_l1_beta, reduction="sum") / norm
    else:
        reg = regression.float().sum() * 0.0
    return LossTerms(cls + reg_weight * reg, cls, reg, n_pos)


def mask_loss(logits: torch.Tensor, target: torch.Tensor, kind: str = "focal") -> torch.Tensor:
    """Loss of the computation-mask network against the (dilated) ground-truth box mask."""
    if kind == "bce":
        pos = target.sum().clamp(min=1)
        weight = (target.numel() - pos) / pos  # balance the rare foreground cells
        return F.binary_cross_entropy_with_logits(logits, target, pos_weight=weight.clamp(max=50))
    if kind == "focal":
        return sigmoid_focal_loss(logits, target, alpha=0.5).sum() / target.sum().clamp(min=1)
    raise ValueError(f"mask loss must be 'focal' or 'bce', got {kind!r}")
