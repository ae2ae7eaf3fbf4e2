"""Benchmark the KITTI evaluation on the CPU on a KITTI-val-sized synthetic set.

    python scripts/bench_eval.py [frames=3769] [dets=100] [repeats=3] [seed=0] [files=true]
                                 [stress=true] [out=benchmarks/eval_cpu]

Builds a realistic synthetic set (detector.eval.synthetic: KITTI's class mix and sizes, 2D boxes from
projecting the 3D boxes, truncation/occlusion, DontCare regions; detections = jittered GT with some
duplicates + false positives, ``dets`` per frame), then times ``evaluate()`` end to end (3 classes ×
2D/BEV/3D/AOS × easy/moderate/hard, R40 and R11), with and without AP by distance, ``repeats`` times,
and reports the share of overlap (IoU) computation vs matching. With files=true it also writes the set as
KITTI folders and times reading them (the CLI's extra work). With stress=true it also times a crowded set
(objects packed in clusters, all detections near objects: large matching components, many overlapping
pairs), a worst case rather than a realistic one. Prints a table and writes OUT.json and
OUT.md. The machine may be shared: the load average is recorded before and after.
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
from detector.data.kitti import write_label
from detector.eval.kitti_files import load_eval_inputs, write_results
from detector.eval.kitti_metric import EvalTimings, evaluate
from detector.eval.protocol import DISTANCE_RANGES
from detector.eval.synthetic import synthetic_set

USAGE = __doc__


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


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
            "files": True,
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

    files = None
    if args["files"]:
        with tempfile.TemporaryDirectory() as tmp:
            ids = [f"{i:06d}" for i in range(n_frames)]
            gdir = Path(tmp) / "label_2"
            gdir.mkdir()
            for i, g in zip(ids, gt, strict=True):
                write_label(gdir / f"{i}.txt", g)
            write_results(Path(tmp) / "results", ids, dt)
            t0 = time.perf_counter()
            inputs = load_eval_inputs(gdir, Path(tmp) / "results")
            read_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            evaluate(inputs.gt, inputs.dt, distance_ranges=None)
            eval_s = time.perf_counter() - t0
        files = {"read_s": read_s, "evaluate_s": eval_s, "total_s": read_s + eval_s}

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
            "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "load_avg_before": load_before,
            "load_avg_after": load_after,
        },
        "dataset": stats,
        "generate_s": gen_s,
        "evaluate_kitti": kitti,
        "evaluate_with_distance": full,
        "files": files,
        "stress_crowded": stress,
        "goal_s": 10.0,
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
        f"machine: {os.cpu_count()} CPUs, load average {load_before} before, {load_after} after "
        "(shared machine: timings are noisy)",
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
    if files:
        lines.append(
            f"| CLI path: read {2 * n_frames} KITTI files + evaluate() | {files['total_s']:.2f} | | | | "
            f"(read {files['read_s']:.2f} s) |"
        )
    lines += [
        "",
        f"Goal: full 2D+BEV+3D+AOS evaluation of {n_frames} frames in under 10 s: "
        f"{'met' if kitti['median_s'] < 10 else 'NOT met'} (median {kitti['median_s']:.2f} s over "
        f"{args['repeats']} runs).",
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


if __name__ == "__main__":
    raise SystemExit(main())
