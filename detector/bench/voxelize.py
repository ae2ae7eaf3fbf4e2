"""Voxelizer and computation-mask benchmark on this machine.

    python scripts/bench_voxelize.py [root=] [repeats=10] [threads=0] [device=cpu]
                                     [out=benchmarks/voxelize_masks_cpu.json]

Frames: the KITTI-format dataset at ``root`` (its train split; road maps used when present), else the
real KITTI frames in ../shared/kitti_real when present. Measures, in one run, the median wall and
process-CPU time (after one warm-up) of:
- ``voxelize`` at bev=kitti and bev=small for batch 1 and 4 (each frame ~120k points), and of
  allocating the zero BEV tensor alone (the floor of any dense voxelizer: ratio = voxelize / zeros);
- per frame: GroundMask, RoadMapMask (if the frames have road maps), boxes_mask of the labels.
``threads=0`` keeps torch's default thread count. Prints a table and writes JSON to ``out`` and a
markdown table beside it. The load average is recorded: timings on a shared machine are noisy.
Allocator settings matter for the dense BEV tensor (tens of MB per frame at bev=kitti): glibc returns a
freed heap top to the kernel, and the next allocation pays page faults; MALLOC_TRIM_THRESHOLD_ (large)
keeps it. Both are recorded.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from detector.cli import parse_args
from detector.data.kitti import KittiRoot
from detector.data.masks import GroundMask, RoadMapMask
from detector.data.structures import collate_frames
from detector.geometry.box_masks import boxes_mask
from detector.geometry.voxelize import voxelize
from detector.machine import allocator_env

USAGE = __doc__
DEFAULTS = {"root": "", "repeats": 10, "threads": 0, "device": "cpu",
            "out": "benchmarks/voxelize_masks_cpu.json"}
REPO = Path(__file__).resolve().parents[2]
KITTI_REAL = REPO.parent / "shared" / "kitti_real"


def _median_ms(fn, repeats: int, sync: bool) -> tuple[float, float]:
    """(median wall ms, median process CPU ms: all threads of this process, so on a shared machine
    it is closer than the wall time to what an idle machine would show)."""
    fn()
    wall, cpu = [], []
    for _ in range(repeats):
        if sync:
            torch.cuda.synchronize()
        t, c = time.perf_counter(), time.process_time()
        fn()
        if sync:
            torch.cuda.synchronize()
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return 1e3 * statistics.median(wall), 1e3 * statistics.median(cpu)


def load_frames(root: str):
    if root:
        kr = KittiRoot(root)
        ids = kr.imageset("train")[:8]
        return [kr.read_frame(i, road_map=kr.has_road_maps()) for i in ids], root
    if (KITTI_REAL / "training" / "velodyne").is_dir():
        kr = KittiRoot(KITTI_REAL)
        return [kr.read_frame(f"{i:06d}") for i in range(4)], str(KITTI_REAL)
    raise SystemExit("error: no frames: pass root=DIR (a KITTI-format dataset, e.g. `make data`)")


def run(root: str, repeats: int, device: str) -> dict:
    frames, source = load_frames(root)
    sync = device.startswith("cuda")
    grids = {name: instantiate(OmegaConf.load(REPO / "configs" / "bev" / f"{name}.yaml"))
             for name in ("kitti", "small")}
    rows = []
    for name, grid in grids.items():
        for b in (1, 4):
            batch = collate_frames([frames[i % len(frames)] for i in range(b)])
            pts = batch.points.to(device)
            n = pts.shape[0]
            vox, vox_cpu = _median_ms(lambda pts=pts, b=b, grid=grid: voxelize(pts, b, grid), repeats, sync)
            shape = (b, grid.C, grid.H, grid.W)
            zeros, _ = _median_ms(lambda shape=shape: torch.zeros(shape, device=device), repeats, sync)
            rows.append({"op": "voxelize", "bev": name, "batch": b, "points": n, "ms": round(vox, 2),
                         "cpu_ms": round(vox_cpu, 2), "zeros_ms": round(zeros, 2),
                         "ratio_to_zeros": round(vox / max(zeros, 1e-9), 2)})
        per_frame: dict[str, list[tuple[float, float]]] = {"GroundMask": [], "RoadMapMask": [],
                                                           "boxes_mask": []}
        has_road = all(f.road_map is not None for f in frames)
        for f in frames:
            batch = collate_frames([f])
            per_frame["GroundMask"].append(
                _median_ms(lambda batch=batch, grid=grid: GroundMask()(batch, grid), repeats, False))
            if has_road:
                per_frame["RoadMapMask"].append(
                    _median_ms(lambda batch=batch, grid=grid: RoadMapMask(2.0)(batch, grid), repeats, False))
            per_frame["boxes_mask"].append(_median_ms(
                lambda f=f, grid=grid: boxes_mask([f.gt_boxes], grid, 1.0, downsample=1), repeats, False))
        for op, ms in per_frame.items():
            if ms:
                wall, cpu = [m[0] for m in ms], [m[1] for m in ms]
                rows.append({"op": f"{op} (per frame)", "bev": name, "batch": 1,
                             "ms": round(statistics.median(wall), 2),
                             "cpu_ms": round(statistics.median(cpu), 2),
                             "ms_max": round(max(wall), 2)})
    return {"source": source, "frames": len(frames), "rows": rows}


def table(r: dict) -> str:
    lines = ["| op | bev | batch | points | median wall ms | median CPU ms | zeros ms | wall / zeros "
             "| max wall over frames ms |", "|---|---|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        lines.append(
            f"| {row['op']} | {row['bev']} | {row['batch']} | {row.get('points', '')} | {row['ms']:.2f} | "
            f"{row['cpu_ms']:.2f} | {row.get('zeros_ms', '')} | {row.get('ratio_to_zeros', '')} "
            f"| {row.get('ms_max', '')} |")
    m = r["machine"]
    lines.append("")
    lines.append(f"frames: {r['frames']} from {r['source']}; torch threads {m['torch_threads']}; "
                 f"device {m['device']}; "
                 f"load average before / after {m['loadavg_before'][0]:.2f} / {m['loadavg_after'][0]:.2f} "
                 f"on {m['cpus']} CPUs; allocator {m['allocator']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv, DEFAULTS, USAGE)
    if args["threads"] > 0:
        torch.set_num_threads(args["threads"])
    load_before = os.getloadavg()
    result = run(args["root"], args["repeats"], args["device"])
    result["machine"] = {
        "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "device": args["device"],
        "torch": torch.__version__, "python": platform.python_version(),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "allocator": allocator_env(),
    }
    result["command"] = "python scripts/bench_voxelize.py " + " ".join(sys.argv[1:] if argv is None else argv)
    text = table(result)
    print(text)
    out = Path(args["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    title = f"# Voxelizer and mask benchmark (`{result['command'].strip()}`)"
    out.with_suffix(".md").write_text(f"{title}\n\n{text}\n")
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0
