"""Benchmark the KITTI evaluation on the CPU on a KITTI-val-sized synthetic set.

    python scripts/bench_eval.py [frames=3769] [dets=100] [repeats=3] [seed=0] [cli_frames=7480]
                                 [cli_repeats=2] [stress=true] [out=benchmarks/eval_cpu]

Builds a realistic synthetic set (detector.eval.synthetic: KITTI's class mix and sizes, 2D boxes from
projecting the 3D boxes, truncation/occlusion, DontCare regions; detections = jittered GT with some
duplicates + false positives, ``dets`` per frame), then times ``evaluate()`` end to end (3 classes ×
2D/BEV/3D/AOS × easy/moderate/hard, R40 and R11), with and without AP by distance, ``repeats`` times,
and reports the share of overlap (IoU) computation vs matching. With cli_frames > 0 it writes a set of that
many frames (7,480: KITTI's training set) as label and result folders and times the command a user runs,
``python scripts/kitti_eval.py gt=... results=...`` (a fresh process: start-up, imports, reading 2 x
cli_frames files, the metric with AP by distance, printing), and reading the folders in-process. Run it
with the Makefile's allocator settings (MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=4000000000), recorded
with the CPU model and the thread settings. With stress=true it also times a crowded set
(objects packed in clusters, all detections near objects: large matching components, many overlapping
pairs), a worst case rather than a realistic one. Prints a table and writes OUT.json and
OUT.md. The machine may be shared: the load average is recorded before and after.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from detector.cli import parse_args
from detector.data.kitti_labels import write_label
from detector.eval.kitti_files import load_eval_inputs, write_results
from detector.eval.kitti_metric import EvalTimings, evaluate
from detector.eval.protocol import DISTANCE_RANGES
from detector.eval.synthetic import synthetic_set
from detector.machine import allocator_env, cpu_model

USAGE = __doc__
REPO = Path(__file__).resolve().parents[2]


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _cli(n_frames: int, dets: int, seed: int, repeats: int) -> dict:
    """Write n_frames label + result files, time scripts/kitti_eval.py on them (fresh processes)."""
    gt, dt = synthetic_set(n_frames, dets, seed=seed)
    ids = [f"{i:06d}" for i in range(n_frames)]
    script = REPO / "scripts" / "kitti_eval.py"
    with tempfile.TemporaryDirectory() as tmp:
        gdir, rdir = Path(tmp) / "label_2", Path(tmp) / "results"
        gdir.mkdir()
        for i, g in zip(ids, gt, strict=True):
            write_label(gdir / f"{i}.txt", g)
        write_results(rdir, ids, dt)
        walls = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, str(script), f"gt={gdir}", f"results={rdir}",
                                f"out={Path(tmp) / 'ap.json'}"], capture_output=True, text=True)
            walls.append(time.perf_counter() - t0)
            if r.returncode != 0:
                raise RuntimeError(f"kitti_eval.py failed: {r.stderr[-2000:]}")
        ap = json.loads((Path(tmp) / "ap.json").read_text())["Car"]["3d"]["R40"]["moderate"]
        t0 = time.perf_counter()
        load_eval_inputs(gdir, rdir)
        read_s = time.perf_counter() - t0
    return {"frames": n_frames, "files": 2 * n_frames, "detections_per_frame": dets, "runs_s": walls,
            "min_s": min(walls), "read_in_process_s": read_s, "ap_car_3d_moderate_r40": ap}


def _run(gt, dt, repeats: int, distance) -> dict:
    runs = []
    for _ in range(repeats):
        t = EvalTimings()
        t0 = time.perf_counter()
        result = evaluate(gt, dt, distance_ranges=distance, timings=t)
        result.to_json()
        wall = time.perf_counter() - t0
        runs.append(
            {"wall_s": wall, "prepare_s": t.prepare_s, "overlap_s": t.overlap_s, "matching_s": t.matching_s}
        )
    walls = [r["wall_s"] for r in runs]
    med = sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2]
    return {
        "runs": runs,
        "min_s": min(walls),
        "median_s": statistics.median(walls),
        "median_run_share": {k: med[f"{k}_s"] / med["wall_s"] for k in ("prepare", "overlap", "matching")},
        "result": result,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(
        argv,
        {
            "frames": 3769,
            "dets": 100,
            "repeats": 3,
            "seed": 0,
            "cli_frames": 7480,
            "cli_repeats": 2,
            "stress": True,
            "out": "benchmarks/eval_cpu",
        },
        USAGE,
    )
    load_before = _load()
    t0 = time.perf_counter()
    gt, dt = synthetic_set(args["frames"], args["dets"], seed=args["seed"])
    gen_s = time.perf_counter() - t0
    names = np.concatenate([g.name for g in gt])
    n_frames = len(gt)
    stats = {
        "frames": n_frames,
        "gt_objects_per_frame": float((names != "DontCare").sum() / n_frames),
        "dontcare_per_frame": float((names == "DontCare").sum() / n_frames),
        "gt_per_class": {c: int((names == c).sum()) for c in np.unique(names)},
        "detections_per_frame": float(sum(len(d) for d in dt) / n_frames),
    }

    kitti = _run(gt, dt, args["repeats"], None)
    full = _run(gt, dt, args["repeats"], DISTANCE_RANGES)
    res = kitti.pop("result")
    full.pop("result")

    cli = _cli(args["cli_frames"], args["dets"], args["seed"] + 2, args["cli_repeats"]) if args["cli_frames"] else None

    stress = None
    if args["stress"]:
        sgt, sdt = synthetic_set(args["frames"], args["dets"], seed=args["seed"] + 1, crowded=True)
        stress = _run(sgt, sdt, 1, None)
        stress.pop("result")
        stress["gt_objects_per_frame"] = float(sum((g.name != "DontCare").sum() for g in sgt) / len(sgt))

    load_after = _load()
    report = {
        "task": "KITTI evaluation (3 classes x 2D/BEV/3D/AOS x easy/moderate/hard, R40 + R11), CPU, NumPy",
        "command": " ".join(["python scripts/bench_eval.py", *(sys.argv[1:] if argv is None else argv)]),
        "machine": {
            "cpus": os.cpu_count(),
            "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "processor": cpu_model(),
            "env": {**allocator_env(),
                    **{k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")}},
            "threads": "NumPy only, single-threaded (no BLAS in the metric)",
            "python": platform.python_version(),
            "numpy": np.__version__,
            "load_avg_before": load_before,
            "load_avg_after": load_after,
        },
        "dataset": stats,
        "generate_s": gen_s,
        "evaluate_kitti": kitti,
        "evaluate_with_distance": full,
        "cli": cli,
        "stress_crowded": stress,
        "goal_s": {"evaluate_3769": 1.5, "cli_7480": 10.0},
        "synthetic_ap_car_3d_moderate_r40": res.ap("Car", "3d", "moderate"),
    }

    rows = [
        ("evaluate(): KITTI metrics", kitti),
        ("evaluate(): + AP by distance (3 ranges)", full),
    ]
    lines = [
        f"KITTI evaluation on the CPU: {n_frames} frames, {stats['gt_objects_per_frame']:.2f} GT objects + "
        f"{stats['dontcare_per_frame']:.2f} DontCare / frame, "
        f"{stats['detections_per_frame']:.0f} detections / frame",
        f"machine: {cpu_model()}, {os.cpu_count()} CPUs, load average {load_before} before, {load_after} after "
        "(shared machine: timings are noisy); "
        f"MALLOC_MMAP_MAX_={os.environ.get('MALLOC_MMAP_MAX_')} "
        f"MALLOC_TRIM_THRESHOLD_={os.environ.get('MALLOC_TRIM_THRESHOLD_')}; the metric is single-threaded NumPy",
        "",
        "| run | min (s) | median (s) | overlaps (IoU) | matching | prepare |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, r in rows:
        sh = r["median_run_share"]
        lines.append(
            f"| {label} | {r['min_s']:.2f} | {r['median_s']:.2f} | {sh['overlap']:.0%} | "
            f"{sh['matching']:.0%} | {sh['prepare']:.0%} |"
        )
    if stress:
        sh = stress["median_run_share"]
        lines.append(
            f"| stress: crowded set ({stress['gt_objects_per_frame']:.1f} GT / frame in clusters), "
            f"KITTI metrics | {stress['min_s']:.2f} | | {sh['overlap']:.0%} | {sh['matching']:.0%} | "
            f"{sh['prepare']:.0%} |"
        )
    if cli:
        lines.append(
            f"| CLI: `scripts/kitti_eval.py` on {cli['files']} files ({cli['frames']} frames, "
            f"{cli['detections_per_frame']} detections / frame), fresh process, with AP by distance | "
            f"{cli['min_s']:.2f} | "
            f"{statistics.median(cli['runs_s']):.2f} | | | (reading in-process {cli['read_in_process_s']:.2f} s) |"
        )
    lines += [
        "",
        f"Goals: evaluate() on {n_frames} frames (2D+BEV+3D+AOS) <= 1.5 s: "
        f"{'met' if kitti['median_s'] <= 1.5 else 'NOT met'} (median {kitti['median_s']:.2f} s over "
        f"{args['repeats']} runs)"
        + (f"; the CLI on {cli['files']} files <= 10 s: {'met' if cli['min_s'] <= 10 else 'NOT met'} "
           f"(best of {len(cli['runs_s'])}: {cli['min_s']:.2f} s)." if cli else "."),
        "Shares are of the median run; 'prepare' = flattening, input checks and candidate pairs. "
        f"Generating the synthetic set took {gen_s:.1f} s (not timed above).",
    ]
    text = "\n".join(lines)
    print(text)
    out = Path(args["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(
        "# KITTI evaluation benchmark (CPU)\n\n`" + report["command"] + "`\n\n" + text + "\n"
    )
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    return 0
