"""How training uses a mask network's mask: its source and its phases, one small typed object.

At evaluation the computation mask is always the mask network's prediction at its own threshold; in training it
may also hold the ground-truth boxes, and its first steps may run at another threshold. ``mask.schedule`` in
configs/mask/predicted.yaml builds it (``_target_``) and says why each value is what it is.
"""

from __future__ import annotations

from dataclasses import dataclass

from detector.errors import ConfigError

SOURCES = ("gt", "predicted", "union")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class MaskSchedule:
    """The computation mask in training, step by step, where a mask network predicts it.

    A value out of range is a :class:`~detector.errors.ConfigError` naming its key (``mask.schedule.<field>``).

    Args:
        train_source: the mask in training after any warm-up: ``gt`` (the ground-truth boxes), ``predicted`` (the
            network's, as at evaluation) or ``union`` (both).
        warmup_steps: the first optimizer steps train on the union whatever ``train_source`` says (0: no warm-up).
        train_threshold: the network's threshold during the first ``train_threshold_steps`` steps; None: its own.
        train_threshold_steps: how many steps ``train_threshold`` holds (0: none).
        union_dilation_m: how far the ground-truth part of the union reaches beyond each box, in metres; None: as
            far as the network's target (the detector's ``mask_dilation_m``).
    """

    train_source: str
    warmup_steps: int
    train_threshold: float | None
    train_threshold_steps: int
    union_dilation_m: float | None

    def __post_init__(self) -> None:
        if self.train_source not in SOURCES:
            raise ConfigError(f"mask.schedule.train_source must be gt, predicted or union, got {self.train_source!r}")
        for key in ("warmup_steps", "train_threshold_steps"):
            v = getattr(self, key)
            if not _is_int(v) or v < 0:
                raise ConfigError(f"mask.schedule.{key} must be an integer >= 0, got {v!r}")
        u = self.union_dilation_m
        if u is not None and (not _is_number(u) or not u >= 0):
            raise ConfigError(f"mask.schedule.union_dilation_m must be null or a number >= 0, got {u!r}")
        t = self.train_threshold
        if t is not None and (not _is_number(t) or not 0 < t < 1):
            raise ConfigError(f"mask.schedule.train_threshold must be null or a number in (0, 1), got {t!r}")

    def source_at(self, step: int | None) -> str:
        """The computation mask's source at training step ``step`` (None: past any warm-up): the union with the
        ground truth during the first ``warmup_steps`` - the network's first predictions are empty (its bias starts
        at p = 0.12, under any threshold), and until it finds the objects a detector trained on its prediction alone
        would see almost nothing - then ``train_source``."""
        if self.train_source == "predicted" and step is not None and step < self.warmup_steps:
            return "union"
        return self.train_source

    def threshold_at(self, step: int | None) -> float | None:
        """The network's threshold at training step ``step`` (None: its own, the inference one):
        ``train_threshold`` during the first ``train_threshold_steps`` steps - cheaper steps at a tighter mask while
        the detector learns - then the network's, so that the weights end trained at the coverage they are evaluated
        at (weights trained at a looser threshold lose AP evaluated at a tighter one: docs/speed.md)."""
        if self.train_threshold is not None and step is not None and step < self.train_threshold_steps:
            return self.train_threshold
        return None
