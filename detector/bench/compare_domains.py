"""Domain report: the statistics that decide sim-to-real transfer, simulated vs real, side by side.

    python scripts/compare_domains.py sim=ROOT [real=../shared/kitti_real] [baseline=ROOT] [split=all]
                                      [real_split=all] [max_frames=0] [bev=small]
                                      [out=benchmarks] [note=]

sim         a KITTI-format root (our simulator's output)
real        the reference root (real KITTI frames)
            (a relative root not found from the current directory is taken from the repository root)
baseline    optional second simulated root (e.g. written by the simulator before a change): its distances
            to ``real`` are reported beside ``sim``'s as "before"
split       ImageSets/{split}.txt of the simulated roots, or ``all`` (every velodyne file)
real_split  the same for ``real``
bev         the BEV grid config (configs/bev/{bev}.yaml) the occupancy and channel statistics use
note        a line for the report (e.g. how the roots were made)

out         the folder the report goes to: OUT/domains_cpu.json, OUT/domains_cpu.md and the PNG histograms
            OUT/domains/{points,objects,scene}.png. The default (benchmarks) rewrites the committed report;
            give another folder for a run of your own

The statistics (detector/data/domains.py) are measured on each root; every 1-D statistic is compared to
``real`` with W1 (1-D Wasserstein distance), W1 / std of the real samples, and the KS statistic.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from detector.cli import parse_args
from detector.data.domains import DISTANCE_BANDS, STATISTICS, DomainStats, band_name, collect, compare
from detector.errors import KittiFormatError
from detector.machine import allocator_env, cpu_model
from detector.resources import config_dir

REPO = Path(__file__).resolve().parents[2]
USAGE = __doc__
DEFAULTS = {
    "sim": "",
    "real": "../shared/kitti_real",
    "baseline": "",
    "split": "all",
    "real_split": "all",
    "max_frames": 0,
    "bev": "small",
    "out": "benchmarks",
    "note": "",
}
# The report's files inside ``out`` (the default ``out=benchmarks`` gives the committed report's paths).
REPORT_JSON = "domains_cpu.json"
REPORT_MD = "domains_cpu.md"
PLOTS_DIR = "domains"
COLORS = {"real": (0, 0, 0), "sim": (31, 119, 180), "before": (230, 120, 20)}


# --------------------------------------------------------------------------------------------------
# Plots (PIL only: matplotlib is not a dependency)
# --------------------------------------------------------------------------------------------------
def _histograms(domains: dict[str, DomainStats], key: str, bins: int = 40, log: bool = False):
    """Common bin edges and each domain's density over them for statistic ``key``."""
    vals = [d.samples[key] for d in domains.values() if len(d.samples[key])]
    if not vals:
        return None
    allv = np.concatenate(vals)
    if log:
        allv = np.log10(1.0 + allv)
    lo, hi = np.percentile(allv, [0.5, 99.5])
    if hi <= lo:
        lo, hi = lo - 0.5, hi + 0.5
    edges = np.linspace(lo, hi, bins + 1)
    curves = {}
    for name, d in domains.items():
        v = np.log10(1.0 + d.samples[key]) if log else d.samples[key]
        if len(v):
            curves[name] = np.histogram(np.clip(v, lo, hi), edges, density=True)[0]
    return edges, curves


def _panel(draw, box, title: str, edges, curves: dict[str, np.ndarray], xlabel: str = "") -> None:
    """Step curves (one per domain) over ``edges`` inside ``box`` = (x0, y0, x1, y1)."""
    x0, y0, x1, y1 = box
    px0, py0, px1, py1 = x0 + 38, y0 + 16, x1 - 8, y1 - 26
    draw.rectangle([px0, py0, px1, py1], outline=(120, 120, 120))
    draw.text((x0 + 40, y0 + 2), title, fill=(0, 0, 0))
    ymax = max(float(np.max(c)) for c in curves.values()) or 1.0
    lo, hi = float(edges[0]), float(edges[-1])
    fx = lambda v: px0 + (v - lo) / (hi - lo) * (px1 - px0)  # noqa: E731
    fy = lambda v: py1 - v / ymax * (py1 - py0)  # noqa: E731
    for name, c in reversed(curves.items()):  # the reference (first) drawn last, on top
        pts = []
        for k, v in enumerate(c):
            pts += [(fx(edges[k]), fy(v)), (fx(edges[k + 1]), fy(v))]
        draw.line(pts, fill=COLORS[name], width=2 if name != "real" else 1)
    draw.text((px0, py1 + 3), f"{lo:.3g}", fill=(0, 0, 0))
    draw.text((px1 - 30, py1 + 3), f"{hi:.3g}", fill=(0, 0, 0))
    if xlabel:
        draw.text(((px0 + px1) // 2 - 3 * len(xlabel), py1 + 12), xlabel, fill=(60, 60, 60))
    draw.text((x0 + 2, py0), f"{ymax:.2g}", fill=(0, 0, 0))


def _figure(path: Path, title: str, panels: list, domains) -> None:
    from PIL import Image, ImageDraw

    cols, pw, ph = 3, 300, 190
    rows = math.ceil(len(panels) / cols)
    img = Image.new("RGB", (cols * pw, rows * ph + 24), "white")
    d = ImageDraw.Draw(img)
    d.text((8, 6), title, fill=(0, 0, 0))
    for k, (ptitle, edges, curves, xlabel) in enumerate(panels):
        r, c = divmod(k, cols)
        _panel(d, (c * pw, 24 + r * ph, (c + 1) * pw, 24 + (r + 1) * ph), ptitle, edges, curves, xlabel)
    legend = "   ".join(f"{n}: {'black' if n == 'real' else 'blue' if n == 'sim' else 'orange'}" for n in domains)
    d.text((cols * pw - 7 * len(legend) - 8, 6), legend, fill=(0, 0, 0))
    img.convert("P", palette=Image.ADAPTIVE, colors=16).save(path, optimize=True)


def plot(domains: dict[str, DomainStats], grid, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    # Points: elevation (points per frame per bin), range, intensities, points per frame.
    e = next(iter(domains.values())).elevation_edges
    used = np.flatnonzero(sum(d.elevation_hist for d in domains.values()) > 0)
    sl = slice(max(used.min() - 2, 0), min(used.max() + 3, len(e) - 1))
    panels = [("beam elevation: points/frame per 0.1 deg", e[sl.start: sl.stop + 1],
               {n: d.elevation_hist[sl] for n, d in domains.items()}, "deg")]
    for key, title, log in (
        ("range_m", "range |xyz| (FOV)", False),
        ("intensity", "reflectance, all points (FOV)", False),
        ("intensity_car", "reflectance, points in Car boxes", False),
        ("intensity_ground", "reflectance, ground points", False),
        ("points_per_frame_fov", "points per frame (FOV)", False),
    ):
        h = _histograms(domains, key, log=log)
        if h:
            panels.append((title, h[0], h[1], STATISTICS[key][0]))
    paths.append(out_dir / "points.png")
    _figure(paths[-1], "Points: density per bin (area 1), sim vs real", panels, domains)
    # Objects.
    panels = []
    for key, title, log in (
        ("car_length_m", "Car length", False),
        ("car_width_m", "Car width", False),
        ("car_height_m", "Car height", False),
        ("car_yaw_deg", "Car yaw folded to [-90, 90)", False),
        ("car_distance_m", "Car distance", False),
        (f"car_points_{band_name(*DISTANCE_BANDS[1])}", "log10(1+points) per Car 20-40 m", True),
    ):
        h = _histograms(domains, key, bins=20, log=log)
        if h:
            panels.append((title, h[0], h[1], "log10" if log else STATISTICS[key][0]))
    paths.append(out_dir / "objects.png")
    _figure(paths[-1], "Cars: density per bin (area 1), sim vs real", panels, domains)
    # Scene: ground, BEV occupancy per height slice.
    panels = []
    for key, title in (("ground_height_m", "ground height at the sensor"), ("ground_slope_deg", "ground slope")):
        h = _histograms(domains, key, bins=15)
        if h:
            panels.append((title, h[0], h[1], STATISTICS[key][0]))
    z = np.linspace(grid.z_range[0], grid.z_range[1], grid.n_slices + 1)
    panels.append(("BEV cells occupied per height slice", z, {n: d.bev_occupancy for n, d in domains.items()}, "z m"))
    paths.append(out_dir / "scene.png")
    _figure(paths[-1], "Ground and BEV occupancy, sim vs real", panels, domains)
    return paths


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------
def _fmt(v: float, digits: int = 3) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}g}"


def report(domains: dict[str, DomainStats], distances: dict[str, list], meta: dict, grid) -> str:
    after = distances["sim"]
    before = {d.name: d for d in distances.get("before", [])}
    lines = [
        "# Domain report: simulated vs real KITTI frames",
        "",
        f"`{meta['command']}`",
        "",
        *([meta["note"], ""] if meta.get("note") else []),
        f"{meta['machine']}; {meta['seconds']:.0f} s. Frames: "
        + ", ".join(f"{n} {d.frames} ({d.root})" for n, d in domains.items())
        + ". Points in the left camera's field of view (FOV) unless stated; Car statistics over labeled Cars.",
        "",
        "Distances to the real frames per statistic: W1 (1-D Wasserstein, in the statistic's unit), "
        "W1/σ (divided by the real samples' std: comparable across rows) and KS (largest CDF gap, 0..1)"
        + ("; `before`: the baseline root (the simulator before the change)." if before else "."),
        f"With {domains['real'].frames} real frames the per-frame and per-Car rows rest on few samples "
        "(column n real).",
        "",
    ]
    head = "| statistic | unit | mean sim | mean real | n sim | n real | W1 | W1/σ | KS |"
    sep = "|---|---|---|---|---|---|---|---|---|"
    if before:
        head += " mean before | W1/σ before | KS before |"
        sep += "---|---|---|"
    lines += [head, sep]
    for d in after:
        unit = STATISTICS.get(d.name, ("share",))[0]
        row = (f"| {d.name} | {unit} | {_fmt(d.mean, 4)} | {_fmt(d.mean_ref, 4)} | {d.n} | {d.n_ref} | {_fmt(d.w1)} | "
               f"{_fmt(d.w1_norm)} | {_fmt(d.ks, 2)} |")
        if before:
            b = before[d.name]
            row += f" {_fmt(b.mean, 4)} | {_fmt(b.w1_norm)} | {_fmt(b.ks, 2)} |"
        lines.append(row)
    ranked = sorted((d for d in after if not math.isnan(d.w1_norm)), key=lambda d: -d.w1_norm)[:8]
    lines += ["", "Largest W1/σ: " + ", ".join(f"{d.name} {d.w1_norm:.2f}" for d in ranked), ""]
    # Objects per frame.
    classes = sorted({c for d in domains.values() for c in d.objects})
    bands = ["all"] + [band_name(lo, hi) for lo, hi in DISTANCE_BANDS]
    lines += ["## Labeled objects per frame (by class; distance bands of the box centre)", "",
              "| class | " + " | ".join(f"{n} {b}" for n in domains for b in bands) + " |",
              "|---|" + "---|" * (len(domains) * len(bands))]
    for c in classes:
        cells = [_fmt(d.objects.get(c, {}).get(b, 0.0), 2) for d in domains.values() for b in bands]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    # BEV channels.
    z = np.linspace(grid.z_range[0], grid.z_range[1], grid.n_slices + 1)
    lines += ["", f"## BEV input channels (grid bev={meta['bev']}: {grid.H}x{grid.W} cells of {grid.resolution} m, "
              f"{grid.n_slices} slices of {grid.z_resolution} m from z {grid.z_range[0]} m), over all cells", "",
              "| channel | " + " | ".join(f"{n} mean | {n} std" for n in domains) + " |",
              "|---|" + "---|---|" * len(domains)]
    for k in range(grid.C):
        name = f"slice {k} (z {z[k]:.2f}..{z[k + 1]:.2f})" if k < grid.n_slices else "intensity (max)"
        cells = [f"{d.bev_mean[k]:.4f} | {d.bev_std[k]:.4f}" for d in domains.values()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Ground-plane fits that failed (frames): "
              + ", ".join(f"{n} {d.ground_fit_failures}" for n, d in domains.items()), ""]
    lines += ["Plots: " + ", ".join(f"`{p}`" for p in meta["plots"]), ""]
    return "\n".join(lines)


def _summary(d: DomainStats) -> dict:
    return {
        "root": d.root,
        "frames": d.frames,
        "means": {k: (float(v.mean()) if len(v) else None) for k, v in d.samples.items()},
        "objects_per_frame": d.objects,
        "bev_occupancy": d.bev_occupancy.tolist(),
        "bev_mean": d.bev_mean.tolist(),
        "bev_std": d.bev_std.tolist(),
        "ground_fit_failures": d.ground_fit_failures,
        "elevation_hist_edges": [float(d.elevation_edges[0]), float(d.elevation_edges[-1]), len(d.elevation_hist)],
        "elevation_points_per_frame": np.round(d.elevation_hist, 2).tolist(),
    }


def _root(path: str) -> Path:
    """A relative root is taken from the current directory, or else from the repository root (so the
    default ``../shared/kitti_real`` works from anywhere)."""
    p = Path(path)
    return p if p.is_absolute() or p.exists() else REPO / p


def main(argv=None) -> int:
    args = parse_args(argv, DEFAULTS, USAGE)
    if not args["sim"]:
        raise SystemExit("error: sim=ROOT is required (see --help)")
    out_dir = Path(args["out"])
    if not args["out"] or out_dir.suffix in (".json", ".md") or out_dir.is_file():
        raise SystemExit(f"error: out={args['out']}: a folder is expected (the report is written to "
                         f"OUT/{REPORT_JSON}, OUT/{REPORT_MD} and OUT/{PLOTS_DIR}/*.png)")
    roots = {"sim": (_root(args["sim"]), args["split"]), "real": (_root(args["real"]), args["real_split"])}
    if args["baseline"]:
        roots["before"] = (_root(args["baseline"]), args["split"])
    cfg_path = config_dir() / "bev" / f"{args['bev']}.yaml"
    if not cfg_path.is_file():
        raise SystemExit(f"error: bev={args['bev']}: no config {cfg_path}")
    grid = instantiate(OmegaConf.load(cfg_path))
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    domains: dict[str, DomainStats] = {}
    for name, (root, split) in roots.items():
        try:
            domains[name] = collect(root, grid, split=split, max_frames=args["max_frames"])
        except (KittiFormatError, ValueError) as e:
            print(f"error: {name}={root}: {e}", file=sys.stderr)
            return 1
        print(f"{name}: {domains[name].frames} frames from {root}", flush=True)
    distances = {"sim": compare(domains["sim"], domains["real"])}
    if "before" in domains:
        distances["before"] = compare(domains["before"], domains["real"])
    seconds = time.perf_counter() - t0
    out = out_dir / REPORT_JSON
    md_path = out_dir / REPORT_MD
    out_dir.mkdir(parents=True, exist_ok=True)
    order = {n: domains[n] for n in ("real", "sim", "before") if n in domains}
    plots = plot(order, grid, out_dir / PLOTS_DIR)
    command = "python scripts/compare_domains.py " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = {
        "command": command,
        "machine": f"{platform.machine()}, {cpu_model()}, {len(os.sched_getaffinity(0))} usable CPUs, torch "
        f"{torch.__version__}, 1 thread, load {[round(x, 2) for x in os.getloadavg()]}, allocator "
        f"{allocator_env()}",
        "seconds": seconds,
        "bev": args["bev"],
        "note": args["note"],
        "plots": [str(p) for p in plots],
    }
    text = report(order, distances, meta, grid)
    result = {
        "meta": meta,
        "domains": {n: _summary(d) for n, d in order.items()},
        "distances": {k: [vars(d) for d in v] for k, v in distances.items()},
    }
    out.write_text(json.dumps(result, indent=1, default=float) + "\n")
    md_path.write_text(text)
    print(text)
    print(f"wrote {out}, {md_path} and {', '.join(map(str, plots))}")
    return 0
