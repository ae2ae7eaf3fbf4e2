"""Shared test fixtures."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

from detector.data.kitti_calib import Calibration
from tests.paths import KITTI_REAL


def make_calib(rot_deg: float = 0.0) -> Calibration:
    """A KITTI-like calibration: camera 0.27 m ahead of and 0.08 m below the LiDAR, optionally yawed."""
    f, cx, cy = 720.0, 610.0, 175.0
    K = np.array([[f, 0, cx], [0, f, cy], [0, 0, 1.0]])
    P = [np.hstack([K, K @ np.array([[tx], [0.0], [0.0]])]) for tx in (0.0, -0.54, 0.06, -0.47)]
    # LiDAR (x fwd, y left, z up) -> camera (x right, y down, z fwd)
    axes = np.array([[0, -1, 0], [0, 0, -1], [1, 0, 0]], dtype=np.float64)
    a = np.deg2rad(rot_deg)
    rz = np.array([[np.cos(a), -np.sin(a), 0], [np.sin(a), np.cos(a), 0], [0, 0, 1]])
    R = axes @ rz
    t = -R @ np.array([0.27, 0.0, -0.08])
    return Calibration(P0=P[0], P1=P[1], P2=P[2], P3=P[3], R0_rect=np.eye(3),
                       Tr_velo_to_cam=np.hstack([R, t[:, None]]),
                       Tr_imu_to_velo=np.hstack([np.eye(3), np.zeros((3, 1))]))


def _session_env(name: str, folder: Path):
    """``os.environ[name] = folder`` for the session (subprocesses inherit it), the previous value restored after."""
    before = os.environ.get(name)
    os.environ[name] = str(folder)
    yield
    if before is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = before


@pytest.fixture(scope="session", autouse=True)
def _own_project_root(tmp_path_factory):
    """``paths.root_dir`` (``PROJECT_ROOT``) is a folder of this test session: the runs, evaluations and the
    GT-sampling cache that tests leave under ``outputs/`` go there, never into the checkout."""
    yield from _session_env("PROJECT_ROOT", tmp_path_factory.mktemp("project_root"))


@pytest.fixture(scope="session", autouse=True)
def _own_plan_cost_cache(tmp_path_factory):
    """The plan's cost model is calibrated into a folder of this test session, never the user's
    ``~/.cache/detector``: a test at another thread count overwrote the user's calibration there, and the next
    ``make train`` recalibrated - uncached on a busy machine - and planned (and trained) differently."""
    yield from _session_env("DETECTOR_CACHE_DIR", tmp_path_factory.mktemp("detector_cache"))


@pytest.fixture
def calib() -> Calibration:
    return make_calib()


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    """Six simulated frames at a coarse azimuth step (5 train, 1 val), with road maps."""
    from detector.sim import LidarSpec, generate_dataset

    root = tmp_path_factory.mktemp("sim") / "kitti"
    generate_dataset(root, 6, seed=1, workers=1, spec=LidarSpec(columns=600), progress=False)
    return root


@pytest.fixture
def kitti_real() -> Path:
    if not (KITTI_REAL / "training" / "velodyne").is_dir():
        pytest.skip("../shared/kitti_real (real KITTI frames) not present")
    return KITTI_REAL


@contextlib.contextmanager
def gpu_lists(on: bool = True):
    """The block lists a GPU runs - a bucket's rows, padding rows past the count, the count never read inside the
    network - on the CPU, which stands in for the device (off CUDA the lists hold exactly the active blocks)."""
    from detector.nn import capacity, chain, plan
    from detector.ops import fused

    if not on:
        yield
        return
    with contextlib.ExitStack() as stack:
        for module in (capacity, chain, plan, fused):
            stack.enter_context(mock.patch.object(module, "uses_buckets", lambda device: True))
        yield


@pytest.fixture
def cuda_lists():
    """:func:`gpu_lists` for a whole test."""
    with gpu_lists():
        yield
