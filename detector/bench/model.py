"""Inference time per frame of the whole detector, dense vs sparse, in one run.

    python scripts/bench_model.py [quick=false] [bev=kitti] [arch=pixor] [batches=1,4] [frames=8] [reps=3]
                                  [masks=none,road_map,predicted,ground] [block_size=16] [head_block_size=16]
                                  [mask_train_steps=1500] [root=data/sim_kitti] [out=benchmarks/model_cpu.json]
                                  [device=cpu] [dtype=float32|bfloat16|float16] [ckpt_path=...] [profile=false]

For each mask and batch size: wall time per frame of voxelize → mask → backbone → neck+head → decode
(eval mode, no autograd) on the simulated val frames, the mean mask sparsity, the time shares, and the
speedup over the dense run of the same batch size. The data-side masks (road map, ground) are timed
as part of the frame (they run in the loader during training).

``arch=pixor`` is PIXOR/SBNet's backbone (stem 32, [3, 6, 6, 3] bottleneck units, 96-384 channels), the
one ``experiment=kitti_full`` trains; ``arch=default`` is the CPU training config. Weights are random
except the predicted-mask network, which is first trained for ``mask_train_steps`` steps (batch 2) on the
whole train split: 1500 steps are 12.5 passes over the sample's 240 train frames, about as many frames as
make train's 16 epochs show it (150 steps on 64 frames before left it loose: its sparsity, not its weights,
sets the speed; the trained network's real sparsity and recall are reported).

Pixel sparsity is not what the sparse layers see: ``tiles`` reports, per stride 1, 2, 4, 8, 16 (stem,
stages 1-4), the fraction of 16 x 16 output tiles that the mask touches there (the mask max-pooled as the
backbone pools it). A tile at stride ``s`` covers ``16 s`` input cells, so a mask of car-sized blobs
activates a growing share of the deeper stages' tiles. ``mask_recall`` is the mean share of the Car boxes'
cells inside the mask (detector/models/mask_quality.py). ``block_size=auto`` (and ``head_block_size=auto``) runs
the execution plan (detector/nn/plan.py); the plan chosen at batch 1 and 4 is printed. ``device``/``dtype``: the
model and its BEV input on that device in that dtype (the GPU check runs ``device=cuda dtype=bfloat16``).

``profile=true``: also where each row's milliseconds go - ``torch.profiler``'s ops by region of the forward
(voxelize, mask, plan, each backbone stage, neck, head, decode), written beside ``out`` as ``<out>_profile``.json/.md.

``ckpt_path``: time a trained detector instead (its grid, architecture, plan settings and weights, the mask
network it trained included; ``bev``/``arch``/``block_size`` are then the checkpoint's). ``mask=predicted``
needs a checkpoint trained with it. Beside each speedup: ``MACs`` (the plan's multiply-accumulates over
dense, halos included) and ``bound`` (every stage at its fewest MACs: the speedup the active tiles and halos
allow the convolutions, ``1 / bound``), and the backbone's per-stage milliseconds (where the time goes).
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
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from detector.build import build_grid, build_model, load_detector
from detector.cli import parse_args
from detector.data.datamodule import collate
from detector.data.structures import collate_frames
from detector.machine import allocator_env, cpu_model
from detector.models.losses import mask_loss
from detector.models.mask_quality import TILE_STRIDES, box_recall, class_boxes, tile_activity
from detector.tasks import build_datamodule

USAGE = __doc__
REPO = Path(__file__).resolve().parents[2]
PIXOR = ["model.backbone.stem_channels=32", "model.backbone.stage_units=[3,6,6,3]",
         "model.backbone.stage_channels=[96,192,256,384]", "model.backbone.bottleneck=true",
         "model.neck_channels=128", "model.head_channels=96"]


def speedup(mac_share: float) -> str:
    """``1 / mac_share`` as a speedup (an empty mask runs no MACs: no bound)."""
    return f"{1 / mac_share:.2f}x" if mac_share > 0 else "unbounded (no MACs)"


def compose_cfg(args: dict, mask: str):
    over = [f"bev={args['bev']}", f"mask={mask}", f"data.root={args['root']}", "paths.output_dir=/tmp/bench_model",
            "data.num_workers=0", "data.augment=null", f"model.block_size={args['block_size']}",
            f"model.head_block_size={args['head_block_size']}"]
    if args["arch"] == "pixor":
        over += PIXOR
    with initialize_config_dir(str(REPO / "configs"), version_base="1.3"):
        return compose("train", overrides=over)


def train_mask_net(model, frames_train, steps: int, batch: int = 2) -> None:
    """Train only the mask network on its target, the detector's (:meth:`BevDetector.object_mask`: the
    dilated boxes of the detector's classes), with Adam."""
    net = model.mask_net
    net.train()
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    rng = np.random.default_rng(0)
    for _ in range(steps):
        idx = rng.choice(len(frames_train), size=batch, replace=False)
        b = collate_frames([frames_train[i] for i in idx])
        with torch.no_grad():
            bev = model.voxelize(b)
        logits = net(bev)
        target = model.object_mask(b, downsample=net.downsample)
        loss = mask_loss(logits, target, model.mask_loss_kind)
        opt.zero_grad()
        loss.backward()
        opt.step()
    net.eval()


@torch.no_grad()
def time_config(model, provider, frames, batch: int, reps: int, device: torch.device, dtype: torch.dtype) -> dict:
    model.eval()
    model.timing = True
    grid = model.grid
    batches = [frames[i:i + batch] for i in range(0, len(frames) - batch + 1, batch)]
    totals: dict[str, float] = {}
    sparsity, tiles, recalls, plans, n_frames, wall, macs = [], [], [], set(), 0, 0.0, []
    for rep in range(reps + 1):  # the first pass warms up (allocations, oneDNN primitives, the plan's calibration)
        for fr in batches:
            t0 = time.perf_counter()
            b = collate_frames(fr)
            tm = time.perf_counter()
            if provider is not None:
                b = collate(fr, provider, grid)
            b = b.to(device)
            t_mask = time.perf_counter() - tm
            out = model(b, model.voxelize(b).to(dtype))
            out.heatmap, out.regression = out.heatmap.float(), out.regression.float()
            model.decode(out)
            if device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            if rep == 0:
                continue
            wall += dt
            n_frames += len(fr)
            sparsity.append(out.sparsity)
            if out.plan is not None:
                plans.add(" ".join(f"{n}:{c}" for n, c in zip(out.plan.names, out.plan.choices, strict=True)))
                macs.append((out.plan.mac_ratio(), out.plan.mac_bound()))
            if out.mask is not None:
                tiles.append(tile_activity(out.mask))
                recalls.append(box_recall(out.mask, class_boxes(b.gt_boxes, b.gt_names, ["Car"]), grid))
            totals["mask"] = totals.get("mask", 0.0) + t_mask
            for k, v in out.times.items():
                if k != "start":
                    totals[k] = totals.get(k, 0.0) + v
    ms = 1000 * wall / n_frames
    shares = {k: v / wall for k, v in totals.items()}
    act = np.mean(tiles, axis=0).tolist() if tiles else [1.0] * len(TILE_STRIDES)
    rec = torch.cat(recalls) if recalls else torch.zeros(0)
    mac = np.mean(macs, axis=0).tolist() if macs else [1.0, 1.0]
    return {"ms_per_frame": ms, "sparsity": float(np.mean(sparsity)), "shares": shares, "tiles": act,
            "mask_recall": float(rec.mean()) if len(rec) else None, "plans": sorted(plans),
            "mac_ratio": mac[0], "mac_bound": mac[1],
            "stage_ms": {k.removeprefix("backbone/"): 1000 * v / n_frames for k, v in totals.items()
                         if k.startswith("backbone/")}}


REGIONS = ("load", "voxelize", "mask", "plan", "neck", "head", "decode")  # and backbone/<stage>


@torch.no_grad()
def profile_config(model, provider, frames, batch: int, device: torch.device, dtype: torch.dtype) -> dict:
    """Where a frame's milliseconds go: one pass over ``frames`` (after a warm-up pass) under ``torch.profiler``,
    each op's own time (self CPU) given to the region of the forward it ran in (``load``: collating the frames and
    a data-side mask; ``voxelize``; ``mask``; ``plan``; ``backbone/<stage>``; ``neck``; ``head``; ``decode``;
    ``other``: outside them). Per region its ms per frame and its heaviest ops; overall the heaviest ops."""
    from torch.profiler import ProfilerActivity, profile, record_function

    model.eval()
    model.timing = True
    batches = [frames[i:i + batch] for i in range(0, len(frames) - batch + 1, batch)]

    def run() -> None:
        for fr in batches:
            with record_function("load"):
                b = (collate(fr, provider, model.grid) if provider is not None else collate_frames(fr)).to(device)
            with record_function("voxelize"):
                bev = model.voxelize(b).to(dtype)
            out = model(b, bev)
            with record_function("decode"):
                out.heatmap, out.regression = out.heatmap.float(), out.regression.float()
                model.decode(out)

    run()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    n = sum(len(fr) for fr in batches)
    named = lambda e: e.name in REGIONS or e.name.startswith("backbone/")  # noqa: E731
    regions: dict[str, float] = {}
    ops: dict[str, float] = {}
    per: dict[tuple[str, str], float] = {}
    calls: dict[str, int] = {}
    for e in prof.events():
        if named(e):
            continue
        p = e.cpu_parent
        while p is not None and not named(p):
            p = p.cpu_parent
        where = "other" if p is None else p.name
        ms = e.self_cpu_time_total / 1000 / n
        regions[where] = regions.get(where, 0.0) + ms
        ops[e.name] = ops.get(e.name, 0.0) + ms
        calls[e.name] = calls.get(e.name, 0) + 1
        per[where, e.name] = per.get((where, e.name), 0.0) + ms
    top = lambda d, k: sorted(d.items(), key=lambda kv: -kv[1])[:k]  # noqa: E731
    return {"ms_per_frame": sum(regions.values()), "regions": dict(top(regions, 50)),
            "ops": [{"op": o, "ms": round(v, 3), "calls_per_frame": round(calls[o] / n, 1)} for o, v in top(ops, 25)],
            "region_ops": {r: [{"op": o, "ms": round(v, 3)} for (rr, o), v in top(per, 10 ** 6) if rr == r][:6]
                           for r in regions}}


def profile_markdown(meta: dict, profiles: list[dict]) -> str:
    lines = ["# Where a frame's milliseconds go (torch.profiler, CPU)", "",
             f"`{meta['command']}` — {meta['machine']}, torch {meta['torch']}, {meta['threads']} threads, allocator "
             f"{meta['env']}. One pass over the frames after a warm-up pass; each op's own time (self CPU, the "
             "calling thread's wall time) given to the region of the forward it ran in. The profiler's own overhead "
             "is in these figures (the timed rows are in model_cpu.md).", ""]
    for p in profiles:
        lines += [f"## mask={p['mask']}, batch {p['batch']}: {p['ms_per_frame']:.1f} ms/frame profiled", "",
                  "| region | ms/frame | share | heaviest ops (ms/frame) |", "|---|---|---|---|"]
        for r, v in p["regions"].items():
            heavy = ", ".join(f"{o['op']} {o['ms']:.2f}" for o in p["region_ops"][r])
            lines.append(f"| {r} | {v:.2f} | {100 * v / p['ms_per_frame']:.0f}% | {heavy} |")
        lines += ["", "| op | ms/frame | calls/frame |", "|---|---|---|"]
        lines += [f"| {o['op']} | {o['ms']:.2f} | {o['calls_per_frame']:.1f} |" for o in p["ops"]]
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv, {"quick": False, "bev": "kitti", "arch": "pixor", "batches": "1,4", "frames": 8,
                             "reps": 3, "masks": "none,road_map,predicted,ground", "block_size": "16",
                             "mask_train_steps": 1500, "root": "data/sim_kitti", "head_block_size": "16",
                             "out": "benchmarks/model_cpu.json", "device": "cpu", "dtype": "float32",
                             "ckpt_path": "", "profile": False}, USAGE)
    if args["dtype"] not in ("float32", "bfloat16", "float16"):
        raise SystemExit(f"error: dtype={args['dtype']}: expected float32, bfloat16 or float16")
    device, dtype = torch.device(args["device"]), getattr(torch, args["dtype"])
    if not (Path(args["root"]) / "ImageSets" / "val.txt").is_file():
        raise SystemExit(f"error: root={args['root']}: no KITTI-format dataset there; run `make data` first")
    if args["quick"]:
        args.update(bev="small", arch="default", batches="1", frames=4, reps=1, mask_train_steps=30)
    batches = [int(b) for b in args["batches"].split(",")]
    masks = args["masks"].split(",")
    torch.manual_seed(0)
    cfg0 = compose_cfg(args, "none")
    grid = build_grid(cfg0.bev)
    choices = dict(args)  # the config groups to compose (args' bev/arch/block sizes become labels with a checkpoint)
    if args["ckpt_path"]:
        grid = load_detector(args["ckpt_path"], "none")[0].grid
        args.update(bev=f"of {args['ckpt_path']}", arch="of the checkpoint", block_size="of the checkpoint",
                    head_block_size="of the checkpoint")
    dm = build_datamodule(cfg0.data, None, grid, sparse=False)
    val = dm.dataset("val")
    n = max(args["frames"], max(batches))
    frames = [val[i] for i in range(min(n, len(val)))]
    road_frames = None  # read only when timed: they need the road maps (open3d), which not every machine has
    if "road_map" in masks:
        road_cfg = compose_cfg(choices, "road_map")
        road_ds = build_datamodule(road_cfg.data, road_cfg.mask, grid, sparse=True).dataset("val")
        road_frames = [road_ds[i] for i in range(len(frames))]
    train_ds = dm.dataset("train")
    print(f"bench_model: bev={args['bev']} ({grid.H}x{grid.W}x{grid.C}) arch={args['arch']} "
          f"frames={len(frames)} threads={torch.get_num_threads()} "
          f"allocator {allocator_env()}")
    rows, profiles = [], []
    dense_ms = {}
    base_state = None
    for mask in ["none"] + [m for m in masks if m != "none"]:
        if args["ckpt_path"]:
            model, cfg = load_detector(args["ckpt_path"], mask)
        else:
            cfg = compose_cfg(args, mask)
            model = build_model(cfg.model, cfg.mask, grid)
            if base_state is None:
                base_state = model.state_dict()
            model.load_state_dict(base_state, strict=False)  # the same weights for every mask
        provider = instantiate(cfg.mask.provider) if cfg.mask.get("provider") else None
        if model.mask_net is not None and not args["ckpt_path"]:
            t = time.perf_counter()
            train_frames = [train_ds[i] for i in range(len(train_ds))]
            train_mask_net(model, train_frames, args["mask_train_steps"])
            print(f"  trained the mask network for {args['mask_train_steps']} steps ({time.perf_counter() - t:.0f} s)")
        model.to(device, dtype)
        fr = road_frames if mask == "road_map" else frames
        for b in batches:
            r = time_config(model, provider, fr, b, args["reps"], device, dtype)
            if mask == "none":
                dense_ms[b] = r["ms_per_frame"]
            row = {"bev": args["bev"], "arch": args["arch"], "mask": mask, "batch": b,
                   "ms_per_frame": round(r["ms_per_frame"], 2), "sparsity": round(r["sparsity"], 4),
                   "speedup_vs_dense": round(dense_ms[b] / r["ms_per_frame"], 3),
                   "shares": {k: round(v, 4) for k, v in r["shares"].items()}, "block_size": args["block_size"],
                   "tiles": {str(st): round(a, 3) for st, a in zip(TILE_STRIDES, r["tiles"], strict=True)},
                   "mask_recall": r["mask_recall"], "plans": r["plans"], "device": args["device"],
                   "dtype": args["dtype"], "head_block_size": args["head_block_size"],
                   "mac_ratio": round(r["mac_ratio"], 4), "mac_bound": round(r["mac_bound"], 4),
                   "stage_ms": {k: round(v, 2) for k, v in r["stage_ms"].items()}}
            rows.append(row)
            if args["profile"]:
                profiles.append({"mask": mask, "batch": b,
                                 **profile_config(model, provider, fr, b, device, dtype)})
            sh = " ".join(f"{k} {100 * v:.0f}%" for k, v in row["shares"].items())
            print(f"  mask={mask:<9} batch={b}  {row['ms_per_frame']:8.1f} ms/frame  sparsity {row['sparsity']:.3f}  "
                  f"speedup {row['speedup_vs_dense']:.2f}x   [{sh}]  tiles {list(row['tiles'].values())}  "
                  f"recall {row['mask_recall']}  MACs {row['mac_ratio']:.3f} bound {row['mac_bound']:.3f}  "
                  f"stages ms {row['stage_ms']}  plans {row['plans']}")
    cpu = cpu_model()
    meta = {"machine": f"{platform.machine()}, {cpu}, {os.cpu_count()} CPUs", "torch": torch.__version__,
            "device": args["device"], "dtype": args["dtype"],
            "threads": torch.get_num_threads(), "load_avg": os.getloadavg(),
            "env": allocator_env(),
            "command": "python scripts/bench_model.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    if args["out"] and not args["quick"]:
        out = Path(args["out"])
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        md = ["| mask | batch | ms/frame | sparsity | speedup vs dense | MACs (plan / dense) | MAC bound (speedup) "
              "| voxelize | mask | backbone | head | decode | backbone ms/frame per stage (stem, 1, 2, ...) "
              "| active 16-px tiles at stride 1 / 2 / 4 / 8 / 16 |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            s = r["shares"]
            cells = [f"{100 * s.get(k, 0):.0f}%" for k in ("voxelize", "mask", "backbone", "head", "decode")]
            if "network" in s:  # the capacity path (GPU): backbone, neck and head run as one captured graph
                cells[2:4] = [f"{100 * s['network']:.0f}% (with the head)", "-"]
            shares = " | ".join(cells)
            tiles = " / ".join(f"{a:.2f}" for a in r["tiles"].values())
            stages = " / ".join(f"{v:.1f}" for v in r["stage_ms"].values()) or "one graph"
            md.append(f"| {r['mask']} | {r['batch']} | {r['ms_per_frame']:.1f} | {r['sparsity']:.3f} | "
                      f"{r['speedup_vs_dense']:.2f}x | {r['mac_ratio']:.2f} | {r['mac_bound']:.2f} "
                      f"({speedup(r['mac_bound'])}) | {shares} | {stages} | {tiles} |")
        where = "GPU" if args["device"].startswith("cuda") else "CPU"
        out.with_suffix(".md").write_text(
            f"# Detector inference on the {where}\n\n`{meta['command']}` — bev={args['bev']}, arch={args['arch']}, "
            f"{meta['machine']}, torch {meta['torch']}, {meta['threads']} threads, load {meta['load_avg']}, "
            f"allocator {meta['env']}.\n\n" + "\n".join(md) + "\n")
        print(f"wrote {out} and {out.with_suffix('.md')}")
        if profiles:
            prof = out.with_name(out.stem + "_profile")
            prof.with_suffix(".json").write_text(json.dumps({"meta": meta, "profiles": profiles}, indent=1))
            prof.with_suffix(".md").write_text(profile_markdown(meta, profiles))
            print(f"wrote {prof.with_suffix('.json')} and {prof.with_suffix('.md')}")
    return 0
