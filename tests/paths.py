"""Paths the tests share, wherever their module lies under tests/: the repository root and its parts."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
# real KITTI frames, when the machine has them, beside the checkout (../shared/kitti_real)
KITTI_REAL = REPO.parent / "shared" / "kitti_real"
