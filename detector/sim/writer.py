"""A simulated frame (:func:`simulate_frame`) and a whole KITTI-format dataset written by a pool of
processes (:func:`generate_dataset`)."""

from __future__ import annotations

import json
import os
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from detector.data.kitti import write_imageset, write_points
from detector.data.kitti_calib import Calibration
from detector.data.kitti_labels import write_label
from detector.data.road_map import RoadMap, write_road_map
from detector.errors import ConfigError
from detector.sim.labels import FrameLabels, label_frame
from detector.sim.scene import Scene, generate_scene
from detector.sim.sensor import LidarSpec, Scan, make_calibration, scan

DEFAULT_SPEC = LidarSpec()
ROAD_MAP_GRID = dict(x_range=(0.0, 70.4), y_range=(-40.0, 40.0), resolution=0.1)
# Raised whenever the simulator's output changes; recorded in sim.json so a sample written by another simulator
# version is recognised. 2: the sim-to-real scenes and sensor (e9f5e81, 34d9539, ef0caf2): clutter between road and
# buildings (shrubs, garden walls, fences, hedges, bins), KITTI's Car sizes, fewer vehicles and pedestrians, tilted
# ground, weak and glossy returns reading reflectance 0, asphalt albedo and intensity noise, the ego car's roof
# blocking the low beams behind the sensor. A sim.json without a version reads as 1 (a sample written after
# ef0caf2 but before the version was recorded is warned about too, though its frames are version 2's).
SIM_VERSION = 2


def stale_sample(root: str | Path) -> str | None:
    """A one-line warning when ``root`` was written by another version of the simulator than this one (older, or
    different: a newer one or an unknown version), else None; None too for a root the simulator did not write."""
    marker = Path(root) / "sim.json"
    if not marker.is_file():
        return None  # not a simulated dataset
    try:
        version = json.loads(marker.read_text()).get("version", 1)
    except (json.JSONDecodeError, AttributeError):
        return f"{marker}: unreadable; regenerate the sample (rm -rf {root} && make data DATA={root})"
    if version == SIM_VERSION:
        return None
    older = isinstance(version, int) and not isinstance(version, bool) and version < SIM_VERSION
    return (f"{root} was written by {'an older' if older else 'a different'} simulator (version {version}; this one "
            f"is version {SIM_VERSION}): its frames differ from the ones this simulator writes and the benchmarks "
            f"were measured on; regenerate it with `rm -rf {root} && make data DATA={root}`")


# --------------------------------------------------------------------------------------------------
# Frames and datasets
# --------------------------------------------------------------------------------------------------
@dataclass
class FrameTimings:
    """Wall-clock seconds of the stages of :func:`simulate_frame`."""

    scene_s: float  # calibration and scene
    scan_s: float
    labels_s: float  # labels and road map


@dataclass
class SimFrame:
    """Everything about one simulated frame (what is written, and the ground truth behind it)."""

    index: int
    calib: Calibration
    scene: Scene
    scan: Scan
    labels: FrameLabels
    road_map: RoadMap
    timings: FrameTimings


def frame_rng(seed: int, index: int) -> np.random.Generator:
    """The random generator of frame ``index`` of a dataset with ``seed`` (independent of other frames)."""
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(index,)))


def simulate_frame(seed: int, index: int, spec: LidarSpec = DEFAULT_SPEC) -> SimFrame:
    """Simulate frame ``index`` of the dataset with ``seed`` (see module doc)."""
    t0 = time.perf_counter()
    rng = frame_rng(seed, index)
    calib = make_calibration(rng)
    scene = generate_scene(rng, calib)
    t1 = time.perf_counter()
    sweep = scan(scene, spec, rng)
    t2 = time.perf_counter()
    labels = label_frame(scene, sweep, calib, rng)
    road = scene.street.road_map(**ROAD_MAP_GRID)
    t3 = time.perf_counter()
    return SimFrame(index, calib, scene, sweep, labels, road, FrameTimings(t1 - t0, t2 - t1, t3 - t2))


FRAME_DIRS = ("velodyne", "label_2", "calib", "road_map")


def write_frame(root: str | Path, frame: SimFrame) -> None:
    """Write the frame's velodyne/label_2/calib/road_map files under ``root/training``."""
    base = Path(root) / "training"
    for sub in FRAME_DIRS:
        (base / sub).mkdir(parents=True, exist_ok=True)
    fid = f"{frame.index:06d}"
    write_points(base / "velodyne" / f"{fid}.bin", frame.scan.points)
    write_label(base / "label_2" / f"{fid}.txt", frame.labels.labels)
    frame.calib.to_file(base / "calib" / f"{fid}.txt")
    write_road_map(base / "road_map" / f"{fid}.png", frame.road_map)


@dataclass
class FrameStats:
    """What :func:`generate_dataset` reports per frame."""

    index: int
    points: int
    rays: int
    objects: dict[str, int]  # labeled objects per class (DontCare included)
    scene_s: float
    scan_s: float
    labels_s: float
    write_s: float
    cpu_s: float  # CPU time of the whole frame (simulation and writing) in its process


def _make_one(args: tuple[str, int, int, LidarSpec]) -> FrameStats:
    root, seed, index, spec = args
    cpu0 = time.process_time()
    frame = simulate_frame(seed, index, spec)
    t0 = time.perf_counter()
    write_frame(root, frame)
    write_s = time.perf_counter() - t0
    counts = Counter(frame.labels.labels.name.tolist())
    tm = frame.timings
    return FrameStats(
        index,
        len(frame.scan.points),
        frame.scan.rays,
        dict(counts),
        tm.scene_s,
        tm.scan_s,
        tm.labels_s,
        write_s,
        time.process_time() - cpu0,
    )


def _init_worker() -> None:
    import torch

    torch.set_num_threads(1)


@dataclass
class DatasetSummary:
    root: Path
    frames: list[FrameStats]
    seconds: float
    workers: int

    def table(self) -> str:
        n = len(self.frames)
        pts = np.array([f.points for f in self.frames])
        per_class = Counter()
        for f in self.frames:
            per_class.update(f.objects)
        cars = np.array([f.objects.get("Car", 0) for f in self.frames])
        lines = [
            f"{n} frames in {self.seconds:.1f} s with {self.workers} worker(s): "
            f"{n / self.seconds:.2f} frames/s",
            f"points per frame: mean {pts.mean():.0f}, min {pts.min()}, max {pts.max()}",
            f"labeled cars per frame: mean {cars.mean():.1f}, median {np.median(cars):.0f}, "
            f"10th-90th pct {np.percentile(cars, 10):.0f}-{np.percentile(cars, 90):.0f}",
            "objects: " + ", ".join(f"{k} {v}" for k, v in sorted(per_class.items())),
        ]
        return "\n".join(lines)


_FRAME_FILE = re.compile(r"^\d{6}\.(bin|txt|png)$")


def _prepare_root(root: Path, frames: int) -> None:
    marker = root / "sim.json"
    if root.exists() and not root.is_dir():
        raise ConfigError(f"{root}: exists and is not a directory; choose another out=DIR")
    if root.exists() and any(root.iterdir()) and not marker.is_file():
        raise ConfigError(
            f"{root}: folder is not empty and was not written by the simulator (no sim.json): it is left as it is; "
            "choose another out=DIR"
        )
    for sub in FRAME_DIRS:
        d = root / "training" / sub
        d.mkdir(parents=True, exist_ok=True)
        for p in d.iterdir():  # frames left over from an earlier, larger run
            if _FRAME_FILE.match(p.name) and int(p.name[:6]) >= frames:
                p.unlink()
    (root / "ImageSets").mkdir(exist_ok=True)
    # The road maps' shared grid description, written once here so the workers only compare it.
    rows = int(
        round((ROAD_MAP_GRID["y_range"][1] - ROAD_MAP_GRID["y_range"][0]) / ROAD_MAP_GRID["resolution"])
    )
    cols = int(
        round((ROAD_MAP_GRID["x_range"][1] - ROAD_MAP_GRID["x_range"][0]) / ROAD_MAP_GRID["resolution"])
    )
    grid = RoadMap(
        np.zeros((rows, cols), bool),
        ROAD_MAP_GRID["x_range"][0],
        ROAD_MAP_GRID["y_range"][0],
        ROAD_MAP_GRID["resolution"],
    ).grid()
    (root / "training" / "road_map" / "grid.json").write_text(json.dumps(grid, indent=1))


def generate_dataset(
    root: str | Path,
    frames: int,
    seed: int = 0,
    workers: int | None = None,
    spec: LidarSpec = DEFAULT_SPEC,
    progress: bool = True,
    val_every: int = 5,
    on_frame: Callable[[FrameStats], None] | None = None,
) -> DatasetSummary:
    """Write a KITTI-format dataset of ``frames`` simulated frames to ``root``.

    Frames are simulated in a pool of ``workers`` forked processes (default: one per CPU core this process
    may use), each writing its own files; a progress bar shows on stderr. ``ImageSets/val.txt`` gets every
    ``val_every``-th frame (ids 4, 9, … for 5, i.e. 20 %), ``train.txt`` the others; they are written last,
    so their presence marks a complete dataset. ``root/sim.json`` records the generation parameters.
    """
    if not isinstance(frames, int) or frames < 1:
        raise ConfigError(f"frames must be a positive integer, got {frames!r}")
    if not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"seed must be a non-negative integer, got {seed!r}")
    if val_every < 2:
        raise ConfigError(f"val_every must be >= 2, got {val_every}")
    workers = min(workers or len(os.sched_getaffinity(0)), frames)
    if workers < 1:
        raise ConfigError(f"workers must be >= 1, got {workers}")
    root = Path(root)
    _prepare_root(root, frames)
    imagesets = [root / "ImageSets" / f"{s}.txt" for s in ("train", "val")]
    for p in imagesets:
        p.unlink(missing_ok=True)
    meta = {
        "generator": "detector.sim",
        "version": SIM_VERSION,
        "seed": seed,
        "frames": frames,
        "lidar": asdict(spec),
        "val_every": val_every,
        "road_map_grid": {k: list(v) if isinstance(v, tuple) else v for k, v in ROAD_MAP_GRID.items()},
    }
    (root / "sim.json").write_text(json.dumps(meta, indent=1) + "\n")
    jobs = [(str(root), seed, i, spec) for i in range(frames)]
    from tqdm import tqdm

    stats: list[FrameStats] = []
    pool = None
    t0 = time.perf_counter()
    bar = tqdm(
        total=frames, desc=f"simulating {root}", unit="frame", disable=not progress, dynamic_ncols=True
    )
    try:
        if workers == 1:
            _init_worker()
            results = map(_make_one, jobs)
        else:
            import multiprocessing as mp

            import open3d  # noqa: F401  (imported once here, inherited by the forked workers)

            pool = mp.get_context("fork").Pool(workers, initializer=_init_worker)
            results = pool.imap_unordered(_make_one, jobs)
        for s in results:
            stats.append(s)
            bar.update(1)
            if on_frame is not None:
                on_frame(s)
        if pool is not None:
            pool.close()
            pool.join()
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
    seconds = time.perf_counter() - t0
    ids = [f"{i:06d}" for i in range(frames)]
    val = [fid for i, fid in enumerate(ids) if i % val_every == val_every - 1]
    write_imageset(imagesets[1], val)
    write_imageset(imagesets[0], [fid for fid in ids if fid not in set(val)])
    stats.sort(key=lambda s: s.index)
    return DatasetSummary(root, stats, seconds, workers)
