"""Speed/accuracy curve of one trained checkpoint: sweep the computation mask, measure AP, mask quality and time.

    python scripts/bench_tradeoff.py ckpt_path=PATH [root=data/sim_kitti] [bev=] [thresholds=0.1,0.2,0.3,0.5]
                                     [dilations=0,1,2] [frames=0] [batch=4] [out=benchmarks/tradeoff_cpu.json]
                                     [tb=outputs/tradeoff_tb] [note=]

The checkpoint's own detector and mask: with a mask network, every (threshold, dilation) pair (dilation in
the network's low-resolution cells); with a data-side mask (road map, ground), every ``dilations`` value as
``dilation_m`` metres (thresholds unused). Per setting, on the val split (the first ``frames`` frames; 0 =
all): Car BEV and 3D AP R40 moderate, the mask's box recall and boxes fully covered, the active 16-px tiles per
stride 1-16, ms/frame of the sparse detector (the plan the checkpoint was trained with) and of its dense twin
(the same weights, no mask) timed on the same batch right after it (a shared machine's load then hits both
alike), and the speedup. A setting whose mask is empty still runs (zero features where
masked) and is reported. ``bev=kitti|small`` evaluates on another grid (the same channels are needed).
Writes ``out`` (JSON), the markdown table beside it (with ``note``), a PNG plot (AP vs speedup) and
TensorBoard scalars (``tb``)).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import open_dict

from detector.build import decode_kwargs, load_detector
from detector.cli import parse_args
from detector.eval.kitti_metric import evaluate
from detector.machine import allocator_env, cpu_model
from detector.models.mask_quality import TILE_STRIDES, box_recall, class_boxes, tile_activity
from detector.module import frame_records
from detector.tasks import build_datamodule

REPO = Path(__file__).resolve().parents[2]


def dense_twin(model, on: bool) -> None:
    """Switch ``model`` to its dense twin (the same weights, no mask) or back."""
    if on:
        model._sparse_mask = (model.mask_net, model.use_data_mask)
        model.mask_net, model.use_data_mask = None, False
    else:
        model.mask_net, model.use_data_mask = model._sparse_mask


@torch.no_grad()
def run_setting(model, loader, classes, decode, paired: bool) -> dict:
    """One pass over the loader: AP, mask quality, ms/frame (model forward + decode; data loading excluded);
    ``paired``: the dense twin timed on each batch right after the model (``dense_ms_per_frame``)."""
    gts, dts, recalls, tiles, wall, wall_dense, n = [], [], [], [], 0.0, 0.0, 0
    for batch in loader:
        t0 = time.perf_counter()
        out = model(batch)
        dets = model.decode(out, **decode)
        wall += time.perf_counter() - t0
        if paired:
            dense_twin(model, True)
            t0 = time.perf_counter()
            model.decode(model(batch), **decode)
            wall_dense += time.perf_counter() - t0
            dense_twin(model, False)
        n += batch.size
        if out.mask is not None:
            recalls.append(box_recall(out.mask, class_boxes(batch.gt_boxes, batch.gt_names, classes), model.grid))
            tiles.append(np.asarray(tile_activity(out.mask)) * batch.size)
        for r in frame_records(batch, dets, classes, model.grid):
            if r.gt is not None:
                gts.append(r.gt)
                dts.append(r.dt)
    m = evaluate(gts, dts, classes=["Car"]).to_json()["Car"]
    row = {"ap_bev_moderate": m["bev"]["R40"]["moderate"], "ap_3d_moderate": m["3d"]["R40"]["moderate"],
           "ms_per_frame": 1000 * wall / max(n, 1), "frames": n}
    if paired:
        row["dense_ms_per_frame"] = 1000 * wall_dense / max(n, 1)
    if recalls:
        r = torch.cat(recalls)
        row.update(mask_recall=float(r.mean()) if len(r) else None,
                   mask_boxes_covered=float((r >= 1).double().mean()) if len(r) else None)
        row["tiles"] = {str(s): float(a) for s, a in zip(TILE_STRIDES, np.sum(tiles, axis=0) / n, strict=True)}
    return row


def plot(rows: list[dict], path: Path) -> None:
    """AP (BEV moderate) against speedup over the dense twin, one labelled point per setting (PIL only)."""
    from PIL import Image, ImageDraw

    W, H, L, B = 720, 480, 70, 50
    img = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(img)
    xs = [r["speedup_vs_dense"] for r in rows]
    ys = [r["ap_bev_moderate"] for r in rows]
    x0, x1 = min(xs + [1.0]) * 0.9, max(xs + [1.0]) * 1.1
    y0, y1 = max(0.0, min(ys) - 5), min(100.0, max(ys) + 5) if max(ys) + 5 > min(ys) - 5 else 100.0
    px = lambda v: L + (v - x0) / (x1 - x0) * (W - L - 20)  # noqa: E731
    py = lambda v: H - B - (v - y0) / max(y1 - y0, 1e-9) * (H - B - 30)  # noqa: E731
    d.line([(L, 30), (L, H - B), (W - 20, H - B)], fill="black")
    for k in range(6):
        vx, vy = x0 + k * (x1 - x0) / 5, y0 + k * (y1 - y0) / 5
        d.text((px(vx) - 10, H - B + 5), f"{vx:.2f}x", fill="black")
        d.text((5, py(vy) - 5), f"{vy:.1f}", fill="black")
    d.text((W // 2 - 120, H - 20), "speedup over the dense twin (ms/frame ratio)", fill="black")
    d.text((L, 8), "Car BEV AP R40 moderate vs speed, one point per mask setting", fill="black")
    for r, x, y in zip(rows, xs, ys, strict=True):
        c = "red" if r["setting"] == "dense" else "blue"
        d.ellipse([px(x) - 4, py(y) - 4, px(x) + 4, py(y) + 4], fill=c)
        d.text((px(x) + 6, py(y) - 6), r["setting"], fill=c)
    img.save(path)


def main(argv=None) -> int:
    args = parse_args(argv, {"ckpt_path": "", "root": "data/sim_kitti", "bev": "", "thresholds": "0.1,0.2,0.3,0.5",
                             "dilations": "0,1,2", "frames": 0, "batch": 4, "tb": "outputs/tradeoff_tb",
                             "note": "", "out": "benchmarks/tradeoff_cpu.json"}, __doc__)
    if not args["ckpt_path"] or not Path(args["ckpt_path"]).is_file():
        raise SystemExit(f"error: ckpt_path={args['ckpt_path']!r}: no such checkpoint (see --help)")
    thresholds = [float(t) for t in args["thresholds"].split(",") if t]
    if any(not 0 < t < 1 for t in thresholds):
        raise SystemExit(f"error: thresholds={args['thresholds']}: each must lie in (0, 1)")
    dilations = [float(v) for v in args["dilations"].split(",") if v]
    model, cfg = load_detector(args["ckpt_path"])
    if args["bev"]:
        from hydra import compose, initialize_config_dir

        from detector.build import build_grid, build_model
        with initialize_config_dir(str(REPO / "configs"), version_base="1.3"):
            cfg.bev = compose("train", overrides=[f"bev={args['bev']}"]).bev
        state = model.state_dict()
        model = build_model(cfg.model, cfg.mask, build_grid(cfg.bev))
        model.load_state_dict(state)
    model.eval()
    data = cfg.data.copy()
    with open_dict(data):
        data.root, data.augment, data.batch_size, data.num_workers = args["root"], None, args["batch"], 0
    classes, decode = list(cfg.model.classes), decode_kwargs(cfg.model)

    def loader(mask_cfg):
        dm = build_datamodule(data, mask_cfg, model.grid, True)
        if args["frames"]:
            ds = dm.dataset("val")
            ds.ids = ds.ids[: args["frames"]]
        return dm.val_dataloader()

    net, settings = model.mask_net, []
    if net is not None:
        settings = [(f"t{t:g}/d{int(dv)}", {"threshold": t, "dilation": int(dv)})
                    for t in thresholds for dv in dilations]
    elif cfg.mask.get("provider") is not None:
        settings = [(f"dil{dv:g}m", {"dilation_m": dv}) for dv in dilations]
    else:
        raise SystemExit(f"error: {args['ckpt_path']} was trained without a mask (mask=none): nothing to sweep")
    print(f"bench_tradeoff: {args['ckpt_path']} grid {model.grid.H}x{model.grid.W} threads={torch.get_num_threads()} "
          f"allocator {allocator_env()}", flush=True)
    val = loader(None)
    with torch.no_grad():  # untimed, both ways: first-call costs (allocator pages, kernels) would land in the dense row
        first = next(iter(val))
        model.decode(model(first), **decode)
        dense_twin(model, True)
        model.decode(model(first), **decode)
    dense = run_setting(model, val, classes, decode, paired=False)
    dense_twin(model, False)
    rows = [{"setting": "dense", **dense, "speedup_vs_dense": 1.0}]
    for name, s in settings:
        mask_cfg = cfg.mask.copy()
        if net is not None:
            net.threshold, net.dilation = s["threshold"], s["dilation"]
        else:
            with open_dict(mask_cfg):
                mask_cfg.provider.dilation_m = s["dilation_m"]
        r = run_setting(model, loader(None if net is not None else mask_cfg), classes, decode, paired=True)
        rows.append({"setting": name, **s, **r, "speedup_vs_dense": r["dense_ms_per_frame"] / r["ms_per_frame"]})
        t = r.get("tiles", {})
        print(f"  {name:<10} BEV {r['ap_bev_moderate']:6.2f} 3D {r['ap_3d_moderate']:6.2f}  recall "
              f"{r.get('mask_recall') or 0:.3f}  tiles {[round(v, 2) for v in t.values()]}  {r['ms_per_frame']:.1f} "
              f"ms/frame  {rows[-1]['speedup_vs_dense']:.2f}x", flush=True)
    meta = {"machine": f"{platform.machine()}, {cpu_model()}, {os.cpu_count()} CPUs",
            "torch": torch.__version__, "threads": torch.get_num_threads(), "load_avg": os.getloadavg(),
            "env": allocator_env(),
            "checkpoint": str(args["ckpt_path"]), "note": args["note"], "grid": [model.grid.H, model.grid.W],
            "command": "python scripts/bench_tradeoff.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    out = Path(args["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = ["| setting | BEV AP mod | 3D AP mod | box recall | boxes covered | active tiles s1/2/4/8/16 | ms/frame | "
          "dense twin ms/frame (same batches, right after) | speedup |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tiles = " / ".join(f"{v:.2f}" for v in r.get("tiles", {}).values()) or "1 (dense)"
        rec = f"{r['mask_recall']:.3f}" if r.get("mask_recall") is not None else "-"
        cov = f"{r['mask_boxes_covered']:.3f}" if r.get("mask_boxes_covered") is not None else "-"
        md.append(f"| {r['setting']} | {r['ap_bev_moderate']:.2f} | {r['ap_3d_moderate']:.2f} | {rec} | {cov} | "
                  f"{tiles} | {r['ms_per_frame']:.1f} | {r.get('dense_ms_per_frame', r['ms_per_frame']):.1f} | "
                  f"{r['speedup_vs_dense']:.2f}x |")
    out.with_suffix(".md").write_text(f"# Speed/accuracy of one checkpoint (CPU)\n\n`{meta['command']}` - "
                                      f"{meta['machine']}, torch {meta['torch']}, {meta['threads']} threads, load "
                                      f"{meta['load_avg']}, allocator {meta['env']}.\n\n"
                                      + (f"{args['note']}\n\n" if args["note"] else "") + "\n".join(md) + "\n")
    plot(rows, out.with_suffix(".png"))
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(args["tb"]) as tb:
        for i, r in enumerate(rows):
            for k in ("ap_bev_moderate", "ap_3d_moderate", "speedup_vs_dense", "ms_per_frame", "mask_recall"):
                if r.get(k) is not None:
                    tb.add_scalar(f"tradeoff/{k}", r[k], i)
        tb.add_text("tradeoff/table", "\n".join(md), 0)
    print(f"wrote {out}, {out.with_suffix('.md')}, {out.with_suffix('.png')}, {args['tb']}")
    return 0
