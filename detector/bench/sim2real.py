"""Sim-to-real: a detector trained on our simulator only, evaluated on the real KITTI frames.

    python scripts/bench_sim2real.py [ckpt_path=PATH] [predicted_ckpt_path=PATH] [real=../shared/kitti_real]
                                     [train_root=data/sim_kitti] [masks=none,ground,predicted] [extra="..."]
                                     [images=3] [baseline=PREVIOUS.json]
                                     [out=benchmarks/sim2real_cpu.json] [images_dir=benchmarks/sim2real]

Without ``ckpt_path`` it first trains one: ``scripts/train.py data.root=TRAIN_ROOT`` (the default config,
plus ``extra`` Hydra overrides) in a subprocess, and takes its best checkpoint. ``predicted_ckpt_path``: a
second checkpoint (one trained with ``mask=predicted``, e.g. bench_train's) that ``mask=predicted`` is
evaluated with instead of ``ckpt_path``, whose mask net may be missing (one trained with ``mask=road_map`` or
``mask=ground``): one run then writes all three masks under their names. ``real`` (relative to the
repository root) is a KITTI-format folder with ``training/{velodyne,label_2,calib}``; every frame of its
velodyne/ is evaluated (it needs no ImageSets: a temporary root links its training/ and lists them).

Per mask (``mask=none`` dense, ``mask=ground`` RANSAC ground, ``mask=predicted`` the checkpoint's mask net;
real KITTI has no road maps) the evaluation is :func:`detector.tasks.evaluate_checkpoint` (the same code as
``scripts/evaluate.py ... mask=...``): its KITTI table, metrics.json and the KITTI files of what it scored.
A mask the checkpoint cannot run (``predicted`` without a trained mask net) is reported as not available,
with the reason. From the scored files (``label_2`` = ground truth inside the BEV grid, ``data`` = every
detection above the decode threshold), recall of Car at BEV IoU > 0.5 and > 0.7 (the protocol's "overlap
must exceed"; exact rotated IoU, detector.geometry.iou) per distance band of the ground truth (sqrt(x² + z²)
in the camera frame, the metric's distance): 0-20, 20-40, 40+ m and within 40 m. Every labeled Car counts
(no difficulty filter); a Car is found when any detection of class Car overlaps it that much.

Writes OUT (``{mask: <metrics.json of that evaluation> + "recall": {...}}`` plus the run's description) and
a markdown table beside it, and a few bird's-eye-view images (``scripts/visualize.py``'s code: detections
scored >= 0.3 red, ground truth green, computation mask blue) into ``images_dir``. The description holds
where the issue's moonshot stands (``meta.moonshot``: real Car BEV AP R40 moderate >= 50 and recall at BEV
IoU 0.5 >= 0.8 within 40 m, with the checkpoint's simulated val >= 90) and, given ``baseline`` (the JSON
of a previous run), each mask's figures before (the baseline's) and after (this run's) in ``meta.baseline``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from detector.cli import parse_args
from detector.resources import outputs_dir

REPO = Path(__file__).resolve().parents[2]
BANDS = (("0-20", 0.0, 20.0), ("20-40", 20.0, 40.0), ("40+", 40.0, np.inf), ("within 40", 0.0, 40.0))
IOUS = (0.5, 0.7)
IMAGE_SCORE = 0.3
# Issue 15's goal (a moonshot): on the real frames, with simulated val kept.
GOAL = {"real_bev_moderate": 50.0, "recall_within_40_0.5": 0.8, "sim_val_bev_moderate": 90.0}
MASKS = ("none", "ground", "predicted")


def real_view(real: Path, tmp: Path) -> tuple[Path, list[str]]:
    """A KITTI root in ``tmp`` whose training/ links ``real``/training and whose ImageSets/real.txt lists every
    point cloud of it (the real frames are read where they are, never copied)."""
    from detector.data.kitti import write_imageset

    ids = sorted(p.stem for p in (real / "training" / "velodyne").glob("*.bin"))
    (tmp / "training").symlink_to((real / "training").resolve(), target_is_directory=True)
    (tmp / "ImageSets").mkdir()
    write_imageset(tmp / "ImageSets" / "real.txt", ids)
    return tmp, ids


def recall_by_distance(gt_dir: Path, res_dir: Path, cls: str = "Car") -> dict:
    """{band: {"gt": n, "recall_bev_0.5": r, "recall_bev_0.7": r}} over the label files of ``gt_dir`` and the
    result files of the same names in ``res_dir`` (the files an evaluation scored); see the module doc."""
    from detector.data.kitti_labels import read_label
    from detector.eval.overlap import camera_bev
    from detector.geometry.iou import bev_iou

    dist, best = [], []
    for path in sorted(gt_dir.glob("*.txt")):
        gt = read_label(path, with_score=False)
        gt = gt.select(gt.name == cls)
        dt = read_label(res_dir / path.name, with_score=True)
        dt = dt.select(dt.name == cls)
        if len(gt) == 0:
            continue
        iou = bev_iou(camera_bev(gt.location, gt.dimensions, gt.rotation_y),
                      camera_bev(dt.location, dt.dimensions, dt.rotation_y))
        best.append(iou.max(axis=1) if len(dt) else np.zeros(len(gt)))
        dist.append(np.hypot(gt.location[:, 0], gt.location[:, 2]))
    dist = np.concatenate(dist) if dist else np.zeros(0)
    best = np.concatenate(best) if best else np.zeros(0)
    out = {}
    for name, lo, hi in BANDS:
        sel = (dist >= lo) & (dist < hi)
        n = int(sel.sum())
        out[name] = {"gt": n, **{f"recall_bev_{t}": (float((best[sel] > t).mean()) if n else None) for t in IOUS}}
    return out


def train_checkpoint(train_root: str, extra: str, out_dir: Path) -> tuple[str, str]:
    """``scripts/train.py`` with the default config on ``train_root``; returns (best checkpoint, command)."""
    cmd = [sys.executable, "scripts/train.py", f"data.root={train_root}", f"paths.output_dir={out_dir}",
           *extra.split()]
    print(" ".join(cmd), flush=True)
    if subprocess.run(cmd, cwd=REPO).returncode:  # the run printed its error line
        raise SystemExit(1)
    run = json.loads((out_dir / "run.json").read_text())
    if not run.get("best_ckpt"):
        raise SystemExit(f"error: {out_dir}: training wrote no checkpoint")
    return run["best_ckpt"], " ".join(["python", *cmd[1:]])


def sim_val(ckpt: str | Path) -> dict | None:
    """{"bev": {easy, moderate, hard}, "3d": ...} Car AP R40 of the training run's own evaluation (simulated val
    split, its run.json beside the checkpoints folder), or None where there is none."""
    run_json = Path(ckpt).parent.parent / "run.json"
    if not run_json.is_file():
        return None
    car = (json.loads(run_json.read_text()).get("metrics") or {}).get("Car")
    return {m: car[m]["R40"] for m in ("bev", "3d")} if car else None


def in_real_terms(text: str, view: Path, real: Path) -> str:
    """``text`` (an error message) with the temporary view's paths replaced by the user's real root: the view's
    training/ is a link to ``real``/training, so a file named under it is that file of ``real``."""
    return text.replace(str(view / "training"), str(real / "training")).replace(str(view), str(real))


def figures(r: dict) -> dict:
    """The few figures a run is judged by, from one mask's entry of the result."""
    return {"bev_moderate": r["Car"]["bev"]["R40"]["moderate"], "3d_moderate": r["Car"]["3d"]["R40"]["moderate"],
            **{f"recall_within_40_{t}": r["recall"]["within 40"][f"recall_bev_{t}"] for t in IOUS}}


def _available(result: dict, mask: str) -> bool:
    return mask in result and result[mask].get("available", True)


def moonshot(result: dict, masks: list[str], sim_vals: dict[str, dict | None]) -> dict:
    """Where issue 15's goal stands per evaluated mask (``sim_vals``: the simulated val of the checkpoint each mask
    ran with); ``met`` when any mask meets all three parts."""
    per_mask = {}
    for mask in masks:
        if not _available(result, mask):
            continue
        f = figures(result[mask])
        sv = (sim_vals.get(mask) or {}).get("bev", {}).get("moderate")
        rec = f["recall_within_40_0.5"]
        per_mask[mask] = {
            "real_bev_moderate": f["bev_moderate"], "recall_within_40_0.5": rec, "sim_val_bev_moderate": sv,
            "met": bool(f["bev_moderate"] >= GOAL["real_bev_moderate"] and rec is not None
                        and rec >= GOAL["recall_within_40_0.5"] and sv is not None
                        and sv >= GOAL["sim_val_bev_moderate"])}
    return {"goal": GOAL, "masks": per_mask, "met": any(v["met"] for v in per_mask.values())}


def load_baseline(path: str) -> dict:
    """A previous run's JSON (what ``baseline=`` names); one error line when it is not one."""
    p = Path(path)
    try:
        base = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"error: baseline={path}: not a readable JSON file ({e.__class__.__name__})") from None
    if not isinstance(base, dict) or not isinstance(base.get("meta"), dict):
        raise SystemExit(f"error: baseline={path}: not a bench_sim2real JSON (no meta)")
    return base


def compare_baseline(result: dict, masks: list[str], base: dict, path: str) -> dict:
    """Per mask evaluated in both runs: {"before": figures of ``base``, "after": figures of ``result``}; masks the
    baseline did not evaluate (or could not run) are listed in ``missing``."""
    both, missing = {}, []
    for mask in masks:
        if not _available(result, mask):
            continue
        if not _available(base, mask):
            missing.append(mask)
            continue
        both[mask] = {"before": figures(base[mask]), "after": figures(result[mask])}
    bm = base["meta"]
    return {"path": path, "checkpoint": bm.get("checkpoint"), "predicted_checkpoint": bm.get("predicted_checkpoint"),
            "frames": bm.get("frames"), "masks": both, "missing": missing}


def _fmt(v) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def _delta(before, after) -> str:
    return "n/a" if before is None or after is None else f"{after - before:+.2f}"


def _moonshot_line(ms: dict) -> str:
    g = ms["goal"]
    head = (f"Moonshot (issue 15: real Car BEV AP R40 moderate >= {g['real_bev_moderate']:.0f} and recall at BEV IoU "
            f"0.5 >= {g['recall_within_40_0.5']:.2f} within 40 m, simulated val >= {g['sim_val_bev_moderate']:.0f}): ")
    if not ms["masks"]:
        return head + "no mask evaluated."
    parts = []
    for mask, v in ms["masks"].items():
        missed = [name for name, ok in (
            ("AP", v["real_bev_moderate"] >= g["real_bev_moderate"]),
            ("recall", v["recall_within_40_0.5"] is not None
             and v["recall_within_40_0.5"] >= g["recall_within_40_0.5"]),
            ("simulated val", v["sim_val_bev_moderate"] is not None
             and v["sim_val_bev_moderate"] >= g["sim_val_bev_moderate"])) if not ok]
        verdict = "met" if not missed else "short of: " + ", ".join(missed)
        parts.append(f"{mask} {v['real_bev_moderate']:.2f} AP, recall {_fmt(v['recall_within_40_0.5'])}, simulated "
                     f"val {_fmt(v['sim_val_bev_moderate'])} ({verdict})")
    return head + ("**met**" if ms["met"] else "**not met**") + " - " + "; ".join(parts) + "."


def markdown(result: dict, argv: list[str]) -> str:
    m = result["meta"]
    pred = m.get("predicted_checkpoint")
    lines = [
        "# Sim-to-real: trained on the simulator only, evaluated on real KITTI frames (CPU)", "",
        f"`python scripts/bench_sim2real.py {' '.join(argv)}` - {m['machine']}, torch {m['torch']}, "
        f"{m['threads']} threads, allocator {m['env']} (load before {m['load_avg_before']}, after "
        f"{m['load_avg_after']})", "",
        f"Checkpoint: `{m['checkpoint']}`" + (f", trained by `{m['train_command']}`" if m.get("train_command") else "")
        + (f"; mask=predicted: `{pred}` (a second checkpoint, trained with mask=predicted)" if pred else ""),
        f"Real frames: {m['frames']} of `{m['real']}` ({', '.join(m['frame_ids'])}); scored: {m.get('scope', '-')}",
        "",
    ]
    if m.get("moonshot"):
        lines += [_moonshot_line(m["moonshot"]), ""]
    lines += [
        "| mask | Car BEV AP R40 easy | moderate | Car 3D AP R40 easy | moderate | mean sparsity | ms/frame |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, sv in (("(simulated val split: the training run's evaluation, its own mask)", m.get("sim_val")),
                      ("(simulated val split of the mask=predicted checkpoint)", m.get("predicted_sim_val"))):
        if sv:
            cells = [f"{sv[metric][lvl]:.2f}" for metric in ("bev", "3d") for lvl in ("easy", "moderate")]
            lines.append(f"| {label} | " + " | ".join(cells) + " | | |")
    for mask in m["masks"]:
        r = result[mask]
        if not r.get("available", True):
            lines.append(f"| {mask} | not available: {r['reason']} | | | | | |")
            continue
        bev, d3 = r["Car"]["bev"]["R40"], r["Car"]["3d"]["R40"]
        lines.append(f"| {mask} | {bev['easy']:.2f} | {bev['moderate']:.2f} | {d3['easy']:.2f} | {d3['moderate']:.2f} "
                     f"| {r['_run']['mean_sparsity']:.3f} | {r['_run']['ms_per_frame']:.0f} |")
    lines += ["", "Recall of every labeled Car inside the BEV grid by a Car detection (score >= the decode "
              "threshold) at BEV IoU > 0.5 / > 0.7, by distance (m, camera frame):", "",
              "| mask | " + " | ".join(f"{b} (#GT) | @0.5 | @0.7" for b, *_ in BANDS) + " |",
              "|---|" + "---|---|---|" * len(BANDS)]
    for mask in m["masks"]:
        r = result[mask]
        if not r.get("available", True):
            continue
        cells = [f"{r['recall'][b]['gt']} | {_fmt(r['recall'][b]['recall_bev_0.5'])} | "
                 f"{_fmt(r['recall'][b]['recall_bev_0.7'])}" for b, *_ in BANDS]
        lines.append(f"| {mask} | " + " | ".join(cells) + " |")
    if m.get("baseline"):
        b = m["baseline"]
        lines += ["", f"Before / after: before = `{b['path']}` (checkpoint `{b['checkpoint']}`"
                  + (f", mask=predicted `{b['predicted_checkpoint']}`" if b.get("predicted_checkpoint") else "")
                  + f"; {b['frames']} real frames), after = this run.", "",
                  "| mask | Car BEV AP R40 moderate before | after | change | Car 3D AP R40 moderate before | after "
                  "| change | recall @0.5 within 40 m before | after | recall @0.7 within 40 m before | after |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for mask, v in b["masks"].items():
            be, af = v["before"], v["after"]
            lines.append(f"| {mask} | {_fmt(be['bev_moderate'])} | {_fmt(af['bev_moderate'])} | "
                         f"{_delta(be['bev_moderate'], af['bev_moderate'])} | {_fmt(be['3d_moderate'])} | "
                         f"{_fmt(af['3d_moderate'])} | {_delta(be['3d_moderate'], af['3d_moderate'])} | "
                         f"{_fmt(be['recall_within_40_0.5'])} | {_fmt(af['recall_within_40_0.5'])} | "
                         f"{_fmt(be['recall_within_40_0.7'])} | {_fmt(af['recall_within_40_0.7'])} |")
        if b["missing"]:
            lines.append(f"\nNot in the baseline: {', '.join(b['missing'])}.")
    first = next((result[k] for k in m["masks"] if result[k].get("available", True)), None)
    if first is not None:
        og = first["_run"].get("outside_grid", {"count": 0, "objects": []})
        lines += ["", f"Labeled objects outside the BEV grid (not scored): {og['count']}"
                  + (f" ({'; '.join(og['objects'][:12])}{' ...' if og['count'] > 12 else ''})" if og["count"] else "")]
    if m["images"]:
        lines += ["", f"Bird's-eye views (detections scored >= {IMAGE_SCORE} red, ground truth green, computation "
                  "mask blue; x forward is up):", ""]
        lines += [f"![{Path(p).stem}]({os.path.relpath(p, Path(m['out']).parent)})" for p in m["images"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv, {"ckpt_path": "", "predicted_ckpt_path": "", "real": "../shared/kitti_real",
                             "train_root": "data/sim_kitti", "masks": ",".join(MASKS), "extra": "", "images": 3,
                             "baseline": "", "out": "benchmarks/sim2real_cpu.json",
                             "images_dir": "benchmarks/sim2real"}, __doc__)
    real = Path(args["real"]) if Path(args["real"]).is_absolute() else REPO / args["real"]
    if not (real / "training" / "velodyne").is_dir():
        raise SystemExit(f"error: {real}: no real KITTI frames there (expected training/velodyne, label_2, calib)")
    masks = [m for m in args["masks"].split(",") if m]
    bad = [m for m in masks if m not in MASKS]
    if bad:
        raise SystemExit(f"error: masks={args['masks']}: unknown mask {bad[0]!r} (none, ground, predicted)")
    pred_ckpt = args["predicted_ckpt_path"]
    if pred_ckpt and "predicted" not in masks:
        raise SystemExit(f"error: predicted_ckpt_path={pred_ckpt} but masks={args['masks']} has no predicted")
    if pred_ckpt and not Path(pred_ckpt).is_file():
        raise SystemExit(f"error: predicted_ckpt_path={pred_ckpt}: no such checkpoint")
    baseline = load_baseline(args["baseline"]) if args["baseline"] else None
    import platform

    import torch
    from hydra import compose, initialize_config_dir

    from detector.commands import visualize
    from detector.errors import USER_ERRORS, ConfigError, one_line
    from detector.machine import allocator_env, cpu_model
    from detector.resources import config_dir
    from detector.tasks import evaluate_checkpoint

    run_dir = outputs_dir() / "bench_sim2real" / time.strftime("%Y-%m-%d_%H-%M-%S")
    meta: dict = {"load_avg_before": [round(v, 2) for v in os.getloadavg()],
                  "machine": f"{platform.machine()}, {cpu_model()}, {os.cpu_count()} CPUs",
                  "threads": torch.get_num_threads(), "torch": torch.__version__,
                  "env": allocator_env(),
                  "real": args["real"], "masks": masks, "output_dir": str(run_dir)}
    ckpt = args["ckpt_path"]
    if not ckpt:
        t0 = time.time()
        ckpt, meta["train_command"] = train_checkpoint(args["train_root"], args["extra"], run_dir / "train")
        meta["train_wall_s"] = round(time.time() - t0, 1)
    meta["checkpoint"] = str(ckpt)
    if sv := sim_val(ckpt):
        meta["sim_val"] = sv
    ckpt_of = {mask: ckpt for mask in masks}
    if pred_ckpt:
        ckpt_of["predicted"] = pred_ckpt
        meta["predicted_checkpoint"] = str(pred_ckpt)
        if sv := sim_val(pred_ckpt):
            meta["predicted_sim_val"] = sv
    out = Path(args["out"])
    images_dir = Path(args["images_dir"])
    result: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        view, ids = real_view(real, Path(tmp))
        meta["frames"], meta["frame_ids"] = len(ids), ids
        try:
            with initialize_config_dir(str(config_dir()), version_base="1.3"):
                data_cfg = compose("eval", overrides=["data=kitti", f"data.root={view}", "ckpt_path=unused"]).data
            for mask in masks:
                try:
                    metrics = evaluate_checkpoint(ckpt_of[mask], data_cfg, run_dir / mask, split="real",
                                                  mask_override=mask)
                except ConfigError as e:  # e.g. mask=predicted on a checkpoint without a mask net
                    result[mask] = {"available": False, "reason": str(e)}
                    print(f"mask={mask}: not available: {e}")
                    continue
                run = json.loads((run_dir / mask / "metrics.json").read_text())["_run"]
                meta["scope"] = run["scope"]
                result[mask] = {**metrics, "_run": run,
                                "recall": recall_by_distance(run_dir / mask / "label_2", run_dir / mask / "data")}
        except USER_ERRORS as e:  # a bad real frame: named under the user's real root, not the temporary view
            raise SystemExit(in_real_terms(one_line(e), Path(tmp), real)) from None
        images = []
        drawn = [m for m in masks if result[m].get("available", True)][:2]
        if args["images"] > 0 and drawn:
            images_dir.mkdir(parents=True, exist_ok=True)
            for fid in ids[:args["images"]]:
                for mask in drawn:
                    png = images_dir / f"{fid}_{mask}.png"
                    code = visualize.main([f"root={view}", f"frame={fid}", f"ckpt_path={ckpt_of[mask]}",
                                           f"mask={mask}", "mode=bev", f"out={png}", f"score_threshold={IMAGE_SCORE}"])
                    if code:
                        return code
                    images.append(str(png))
    meta["images"] = images
    meta["out"] = str(out)
    sim_vals = {mask: meta.get("sim_val") for mask in masks}  # each mask's checkpoint's own simulated val
    if pred_ckpt:
        sim_vals["predicted"] = meta.get("predicted_sim_val")
    meta["moonshot"] = moonshot(result, masks, sim_vals)
    if baseline is not None:
        meta["baseline"] = compare_baseline(result, masks, baseline, args["baseline"])
    meta["load_avg_after"] = [round(v, 2) for v in os.getloadavg()]
    result["meta"] = meta
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    md = markdown(result, argv)
    out.with_suffix(".md").write_text(md)
    print(md)
    return 0
