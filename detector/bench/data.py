"""Data benchmark: LiDAR simulator throughput and KITTI reader throughput on this machine.

    python scripts/bench_data.py [frames=40] [workers=2] [columns=2083] [read_passes=3]
                                 [out=benchmarks/data_cpu.json] [workdir=] [baseline=] [rounds=3]

Measures, in one run:
- simulator frames/s single-process and with a pool of ``workers`` processes (wall clock, from the call
  to the last file written, pool start-up included), and CPU seconds per frame;
- rays/s: of the whole scan stage (ray casting and sensor model), and of open3d's ray casting alone;
- points per frame and labeled cars per frame;
- reader: frames/s and ms per frame of ``KittiRoot.read_frame`` (velodyne .bin + label + calib), after one
  warm-up pass, over ``read_passes`` passes of the pool's frames; also with the road map.
- with ``baseline=DIR`` (another source tree of this project, e.g. ``git worktree add /tmp/base <commit>``):
  the simulator of that tree against this one's, each in a fresh single-process Python (imports outside the
  timing), ``frames`` frames per try, the trees alternating for ``rounds`` rounds; the best try of each
  (the least disturbed by other jobs) and their ratio, in frames per wall second and per CPU second.
Prints a table and writes JSON to ``out`` and a markdown table beside it (same name, ``.md``). The
machine's load average is recorded: timings on a shared machine are noisy, ratios within a run less so.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from detector.cli import parse_args
from detector.data.kitti import KittiRoot
from detector.sim import LidarSpec, generate_dataset, simulate_frame
from detector.sim.sensor import ray_directions

USAGE = __doc__
DEFAULTS = {
    "frames": 40,
    "workers": 2,
    "columns": LidarSpec.columns,
    "read_passes": 3,
    "out": "benchmarks/data_cpu.json",
    "workdir": "",
    "baseline": "",
    "rounds": 3,
}
REPO = Path(__file__).resolve().parents[2]
# One try of the simulator in a fresh interpreter of a given source tree: prints frames/s.
_TIME_ONE = """
import sys, tempfile, time
from detector.sim import LidarSpec, generate_dataset, simulate_frame
frames, columns = int(sys.argv[1]), int(sys.argv[2])
simulate_frame(0, 0, LidarSpec(columns=columns))  # warm-up: imports and caches
with tempfile.TemporaryDirectory(dir=sys.argv[3] or None) as tmp:
    t0, c0 = time.perf_counter(), time.process_time()
    generate_dataset(tmp + "/d", frames, seed=0, workers=1, spec=LidarSpec(columns=columns), progress=False)
    print(frames / (time.perf_counter() - t0), frames / (time.process_time() - c0))
"""


def _time_tree(tree: Path, frames: int, columns: int, workdir: str) -> tuple[float, float]:
    """(frames per wall second, frames per CPU second) of the simulator of source tree ``tree`` (single
    process, fresh interpreter)."""
    import subprocess

    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run(
        [sys.executable, "-c", _TIME_ONE, str(frames), str(columns), workdir],
        cwd=tree, env=env, capture_output=True, text=True, check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"error: baseline={tree}: the simulator failed there:\n{out.stderr[-2000:]}")
    wall, cpu = out.stdout.split()[-2:]
    return float(wall), float(cpu)


def compare_trees(baseline: Path, frames: int, columns: int, rounds: int, workdir: str) -> dict:
    """The simulator of ``baseline`` against this tree's, alternating (see module doc)."""
    import subprocess

    tries: dict[str, list[float]] = {"baseline": [], "this": []}
    cpu: dict[str, list[float]] = {"baseline": [], "this": []}
    load = os.getloadavg()
    for _ in range(rounds):
        for name, tree in (("baseline", baseline), ("this", REPO)):
            wall, per_cpu = _time_tree(tree, frames, columns, workdir)
            tries[name].append(wall)
            cpu[name].append(per_cpu)

    def commit(tree: Path) -> str:
        r = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        return r.stdout.strip() or "unknown"

    best = {k: max(v) for k, v in tries.items()}
    return {
        "baseline_tree": str(baseline),
        "baseline_commit": commit(baseline),
        "this_commit": commit(REPO) + (" + uncommitted changes" if _dirty(REPO) else ""),
        "frames_per_try": frames,
        "tries_frames_per_s": tries,
        "best_frames_per_s": best,
        "ratio_this_over_baseline": best["this"] / best["baseline"],
        # frames per CPU second (the process's CPU time): what a shared machine's load disturbs least
        "tries_frames_per_cpu_s": cpu,
        "ratio_cpu_this_over_baseline": max(cpu["this"]) / max(cpu["baseline"]),
        "loadavg_before": [round(x, 2) for x in load],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }


def _dirty(tree: Path) -> bool:
    import subprocess

    r = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                       capture_output=True, text=True)
    return bool(r.stdout.strip())
GOAL_FPS, GOAL_READ_MS = 5.0, 10.0


def _cast_only(spec: LidarSpec, repeats: int = 5) -> float:
    """Rays/s of the raycaster alone on a typical scene (median of ``repeats`` sweeps)."""
    frame = simulate_frame(0, 0, spec)
    dirs = ray_directions(spec.columns)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        frame.scene.cast(np.zeros(3), dirs)
        times.append(time.perf_counter() - t0)
    return len(dirs) / statistics.median(times)


def _read(root: Path, passes: int, road_map: bool) -> list[float]:
    kroot = KittiRoot(root)
    ids = kroot.imageset("train") + kroot.imageset("val")
    for i in ids:  # warm-up (file cache, imports)
        kroot.read_frame(i, road_map=road_map)
    times = []
    for _ in range(passes):
        for i in ids:
            t0 = time.perf_counter()
            kroot.read_frame(i, road_map=road_map)
            times.append(time.perf_counter() - t0)
    return times


def run(frames: int, workers: int, columns: int, read_passes: int, workdir: Path) -> dict:
    spec = LidarSpec(columns=columns)
    load_before = os.getloadavg()
    cast_rps = _cast_only(spec)  # also the warm-up: imports and caches, inherited by the forked workers
    single = generate_dataset(workdir / "single", frames, seed=0, workers=1, spec=spec, progress=False)
    pool = generate_dataset(workdir / "pool", frames, seed=0, workers=workers, spec=spec, progress=False)
    reads = _read(workdir / "pool", read_passes, road_map=False)
    reads_road = _read(workdir / "pool", read_passes, road_map=True)
    load_after = os.getloadavg()

    st = single.frames
    rays = st[0].rays
    scan_s = sum(f.scan_s for f in st)
    pts = np.array([f.points for f in st])
    cars = np.array([f.objects.get("Car", 0) for f in st])
    cpu = np.array([f.cpu_s for f in st])
    stage = {
        k: float(np.mean([getattr(f, k) for f in st])) for k in ("scene_s", "scan_s", "labels_s", "write_s")
    }
    ms = np.array(reads) * 1e3
    ms_road = np.array(reads_road) * 1e3
    return {
        "machine": {
            "cpus_usable": len(os.sched_getaffinity(0)),
            "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(),
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in load_after],
        },
        "config": {
            "frames": frames,
            "workers": workers,
            "columns": columns,
            "rays_per_frame": rays,
            "read_passes": read_passes,
        },
        "simulator": {
            "single_process_frames_per_s": frames / single.seconds,
            "pool_frames_per_s": frames / pool.seconds,
            "pool_workers": pool.workers,
            "pool_speedup": single.seconds / pool.seconds,
            "cpu_s_per_frame_mean": float(cpu.mean()),
            "frames_per_s_per_cpu_core_from_cpu_time": float(1.0 / cpu.mean()),
            "stage_wall_s_per_frame": stage,
            "scan_rays_per_s": rays * frames / scan_s,
            "raycast_only_rays_per_s": cast_rps,
            "points_per_frame_mean": float(pts.mean()),
            "points_per_frame_min": int(pts.min()),
            "points_per_frame_max": int(pts.max()),
            "labeled_cars_per_frame_mean": float(cars.mean()),
        },
        "reader": {
            "frames": len(reads) // read_passes,
            "frames_per_s": len(ms) / (ms.sum() / 1e3),
            "ms_per_frame_mean": float(ms.mean()),
            "ms_per_frame_median": float(np.median(ms)),
            "ms_per_frame_p95": float(np.percentile(ms, 95)),
            "with_road_map_ms_per_frame_median": float(np.median(ms_road)),
        },
        "goals": {
            "pool_frames_per_s>=5": frames / pool.seconds >= GOAL_FPS,
            "read_ms_per_frame<10": float(np.median(ms)) < GOAL_READ_MS,
        },
    }


def table(r: dict) -> str:
    s, rd, m, c = r["simulator"], r["reader"], r["machine"], r["config"]
    st = s["stage_wall_s_per_frame"]
    rows = [
        ("simulator, single process", f"{s['single_process_frames_per_s']:.2f} frames/s"),
        (
            f"simulator, pool of {s['pool_workers']} processes",
            f"{s['pool_frames_per_s']:.2f} frames/s (x{s['pool_speedup']:.2f}; goal >= {GOAL_FPS:g})",
        ),
        (
            "CPU time per frame",
            f"{s['cpu_s_per_frame_mean'] * 1e3:.0f} ms "
            f"(= {s['frames_per_s_per_cpu_core_from_cpu_time']:.2f} frames/s per fully available core)",
        ),
        (
            "stages per frame (wall, single process)",
            f"scene {st['scene_s'] * 1e3:.0f} ms, scan {st['scan_s'] * 1e3:.0f} "
            f"ms, labels {st['labels_s'] * 1e3:.0f} ms, write {st['write_s'] * 1e3:.0f} ms",
        ),
        ("rays per frame", f"{c['rays_per_frame']} (64 x {c['columns']} columns)"),
        ("scan stage rays/s", f"{s['scan_rays_per_s'] / 1e6:.2f} M"),
        ("ray casting alone rays/s (1 thread)", f"{s['raycast_only_rays_per_s'] / 1e6:.2f} M"),
        (
            "points per frame",
            f"{s['points_per_frame_mean']:.0f} (min {s['points_per_frame_min']}, "
            f"max {s['points_per_frame_max']})",
        ),
        ("labeled cars per frame", f"{s['labeled_cars_per_frame_mean']:.1f}"),
        (
            "reader (bin + label + calib)",
            f"{rd['frames_per_s']:.0f} frames/s, {rd['ms_per_frame_median']:.2f} ms "
            f"median, {rd['ms_per_frame_p95']:.2f} ms p95 (goal < {GOAL_READ_MS:g} ms)",
        ),
        ("reader with road map", f"{rd['with_road_map_ms_per_frame_median']:.2f} ms median"),
        (
            "load average before / after",
            f"{m['loadavg_before'][0]:.2f} / {m['loadavg_after'][0]:.2f} on {m['cpus_usable']} usable CPUs",
        ),
    ]
    if "simulator_vs_baseline" in r:
        b = r["simulator_vs_baseline"]
        t = b["tries_frames_per_s"]
        tries = " / ".join(f"{x:.2f} vs {y:.2f}" for x, y in zip(t["this"], t["baseline"], strict=True))
        rows.append((
            f"simulator vs baseline {b['baseline_commit']} (single process, best try)",
            f"{b['best_frames_per_s']['this']:.2f} vs {b['best_frames_per_s']['baseline']:.2f} frames/s = "
            f"x{b['ratio_this_over_baseline']:.3f} (tries, this vs baseline: {tries}; load "
            f"{b['loadavg_before'][0]:.2f} / {b['loadavg_after'][0]:.2f})",
        ))
        c = b["tries_frames_per_cpu_s"]
        rows.append((
            "same, frames per CPU second (best try)",
            f"{max(c['this']):.2f} vs {max(c['baseline']):.2f} = x{b['ratio_cpu_this_over_baseline']:.3f}",
        ))
    w = max(len(a) for a, _ in rows)
    lines = [f"| {'measure':<{w}} | value |", f"|{'-' * (w + 2)}|-------|"]
    lines += [f"| {a:<{w}} | {b} |" for a, b in rows]
    return "\n".join(lines)


def markdown(result: dict, text: str) -> str:
    m = result["machine"]
    note = ""
    if m["loadavg_before"][0] > 0.5 * m["cpus_usable"]:
        note = (
            f"\nThe machine was shared: load average {m['loadavg_before'][0]:.1f} → "
            f"{m['loadavg_after'][0]:.1f} on {m['cpus_usable']} CPUs while this ran, so the wall-clock "
            "rates are what other jobs left to this benchmark, and the pool could not get cores of its "
            "own. CPU time per frame depends much less on the load "
            "(shared caches still inflate it): frames/s on N free cores ≈ N / (CPU time per frame).\n"
        )
    return f"# Data benchmark (`{result['command'].strip()}`)\n\n{text}\n{note}"


def main(argv=None) -> int:
    args = parse_args(argv, DEFAULTS, USAGE)
    for key, lo in (("frames", 1), ("workers", 1), ("columns", 8), ("read_passes", 1), ("rounds", 1)):
        if args[key] < lo:
            raise SystemExit(f"error: {key}={args[key]}: must be >= {lo}\n{USAGE}")
    with tempfile.TemporaryDirectory(prefix="bench_data_", dir=args["workdir"] or None) as tmp:
        result = run(args["frames"], args["workers"], args["columns"], args["read_passes"], Path(tmp))
    result["command"] = "python scripts/bench_data.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args["baseline"]:
        base = Path(args["baseline"])
        if not (base / "detector" / "sim").is_dir():
            raise SystemExit(f"error: baseline={base}: not a source tree of this project (no detector/sim)")
        result["simulator_vs_baseline"] = compare_trees(
            base, args["frames"], args["columns"], args["rounds"], args["workdir"]
        )
    text = table(result)
    print(text)
    out = Path(args["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(result, text))
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0
