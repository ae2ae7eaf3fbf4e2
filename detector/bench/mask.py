"""Mask network settings screened without training a detector: recall of the Car boxes against the MACs it costs.

    python scripts/bench_mask.py [variants=c3,c5,c7,c5w32] [thresholds=0.3,0.4,0.45,0.5] [steps=960]
                                 [batches=15] [reps=25] [root=data/sim_kitti] [out=benchmarks/mask_screen_cpu.json]
                                 [extra="hydra overrides"]

The mask network learns from its own loss only (its output is detached where the detector uses it), so one
trained alone on make train's batch stream (the default config: its data, augmentation, seed, optimizer and
schedule) is the one make train trains with the detector, up to rounding. Each variant (``c<convs>``, ``w<channels>``:
``c5w32`` = 5 convolutions of 32 channels; ``m<metres>``: the target's margin, ``model.mask_dilation_m``) is
trained that way for ``steps`` steps on the same batches, then for each threshold, on ``batches`` training
batches (augmented, batch norm in training mode: what training pays) and on the val frames (what inference pays);
``extra``: Hydra overrides of that config (another grid, data root, plan):

- ``macs``: the execution plan's multiply-accumulates over the dense run's (detector/nn/plan.py; make train's
  plan settings), i.e. what the sparse layers convolve under that mask;
- ``recall`` / ``covered``: the mean share of each Car box's cells inside the mask, and the share of boxes with
  every cell inside (detector/models/mask_quality.py);

and ``ms``: the network's forward + backward on one training batch (median of ``reps``, after 5 warm-up runs; 2
threads). A setting that keeps more of the boxes at the same MACs is a better mask; which one trains the better
detector takes ``scripts/bench_train.py`` (docs/speed.md, the default mask).
"""

from __future__ import annotations

import json
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from detector.build import build_grid, build_model
from detector.cli import parse_args
from detector.machine import allocator_env, cpu_model
from detector.models.detector import masks_at_strides
from detector.models.losses import mask_loss
from detector.models.mask_net import MaskNet
from detector.models.mask_quality import class_boxes, mask_quality
from detector.tasks import build_datamodule

USAGE = __doc__
REPO = Path(__file__).resolve().parents[2]
VARIANT = re.compile(r"^c(\d+)(?:w(\d+))?(?:m(\d+(?:\.\d+)?))?$")


def parse_variant(name: str, defaults: dict) -> dict:
    """``c<convs>[w<channels>][m<margin>]`` -> MaskNet keyword arguments plus ``margin`` (defaults: the config's)."""
    m = VARIANT.match(name)
    if m is None:
        raise SystemExit(f"error: variants: {name!r} is not c<convs>[w<channels>][m<margin metres>] (e.g. c5w32)")
    convs, width, margin = m.groups()
    return {"num_convs": int(convs), "channels": int(width) if width else defaults["channels"],
            "margin": float(margin) if margin else defaults["margin"]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, {"variants": "c3,c5,c7,c5w32", "thresholds": "0.3,0.4,0.45,0.5", "steps": 960,
                             "batches": 15, "reps": 25, "root": "data/sim_kitti",
                             "out": "benchmarks/mask_screen_cpu.json", "extra": ""},
                      USAGE)
    if int(args["reps"]) < 1:
        raise SystemExit(f"error: reps={args['reps']}: must be >= 1")
    torch.set_num_threads(2)
    with initialize_config_dir(str(REPO / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=[f"data.root={args['root']}", *str(args["extra"]).split()])
    grid = build_grid(cfg.bev)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, cfg.mask, grid)  # its planner and voxelizer; its own mask net is not used
    base = dict(cfg.mask.net)
    defaults = {"channels": base["channels"], "margin": float(cfg.model.mask_dilation_m)}
    thresholds = [float(t) for t in str(args["thresholds"]).split(",")]
    variants = {v: parse_variant(v, defaults) for v in str(args["variants"]).split(",")}
    steps = int(args["steps"])
    nets, opts, scheds = {}, {}, {}
    for name, v in variants.items():
        torch.manual_seed(cfg.seed)
        kw = {k: base[k] for k in ("downsample", "threshold", "dilation")}
        nets[name] = MaskNet(grid.C, channels=v["channels"], num_convs=v["num_convs"], **kw).train()
        opts[name] = instantiate(cfg.optimizer)(params=nets[name].parameters())
        scheds[name] = instantiate(cfg.scheduler)(optimizer=opts[name], total_steps=steps + 1)
    dm = build_datamodule(cfg.data, cfg.mask, grid, sparse=True)
    dm.setup("fit")
    loader = dm.train_dataloader()
    kind = model.mask_loss_kind
    t0, step, epoch = time.time(), 0, 0
    while step < steps:
        loader.sampler.set_epoch(epoch)
        for b in loader:
            with torch.no_grad():
                bev = model.voxelize(b)
            for name, net in nets.items():
                target = model.object_mask(b, net.downsample, dilation_m=variants[name]["margin"]).to(bev)
                loss = mask_loss(net(bev), target, kind)
                opts[name].zero_grad()
                loss.backward()
                opts[name].step()
                scheds[name].step()
            step += 1
            if step >= steps:
                break
        epoch += 1
    print(f"trained {len(nets)} mask networks {steps} steps in {time.time() - t0:.0f} s", flush=True)

    rows: dict[tuple[str, float], dict] = {}

    @torch.no_grad()
    def measure(split: str, loader, train_mode: bool) -> None:
        acc: dict[tuple[str, float], list] = {}
        model.train(train_mode)
        for k, b in enumerate(loader):
            if k >= int(args["batches"]):
                break
            bev = model.voxelize(b)
            cars = class_boxes(b.gt_boxes, b.gt_names, model.coder.classes)
            for name, net in nets.items():
                net.train(train_mode)
                logits = net(bev)
                for t in thresholds:
                    mask = net.computation_mask(logits, bev.shape[-2:], t)
                    # the planner's Plan whatever the settings (capacity_plan makes none without an 'auto' stage):
                    # its MACs are those of the configured tiles where they are fixed
                    inputs = model.plan_inputs(tuple(bev.shape), mask, masks_at_strides(mask, model.neck.strides))
                    plan = model.backbone.planner.decide(inputs, bev.device, bev.dtype, model.training)
                    q = mask_quality(mask, cars, grid)
                    acc.setdefault((name, t), []).append((plan.mac_ratio(), q["mask_recall"], q["mask_boxes_covered"]))
        for key, vals in acc.items():
            macs, recall, covered = np.nanmean(np.asarray(vals, dtype=float), axis=0)
            rows.setdefault(key, {})[split] = {"macs": float(macs), "recall": float(recall),
                                               "covered": float(covered)}

    measure("train", dm.train_dataloader(), True)
    measure("val", dm.val_dataloader(), False)
    b = next(iter(dm.train_dataloader()))
    bev = model.voxelize(b)
    target = model.object_mask(b, downsample=base["downsample"]).to(bev)
    ms = {}
    for name, net in nets.items():
        net.train()
        times = []
        for _ in range(5 + int(args["reps"])):
            t = time.perf_counter()
            mask_loss(net(bev), target, kind).backward()
            times.append(time.perf_counter() - t)
        ms[name] = 1000 * statistics.median(times[5:])
    result = {"machine": {"cpu": cpu_model(), "platform": platform.platform(), "torch": torch.__version__,
                          "threads": torch.get_num_threads(), "allocator": allocator_env()},
              "command": "python scripts/bench_mask.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "steps": steps,
              "rows": [{"variant": n, **variants[n], "threshold": t, "ms_fwd_bwd": ms[n], **rows[(n, t)]}
                       for n in variants for t in thresholds]}
    out = Path(args["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    lines = ["# Mask network settings screened (CPU)", "",
             f"`{result['command']}` - {result['machine']['cpu']}, torch {torch.__version__}, 2 threads, allocator "
             f"{result['machine']['allocator']}. Each network trained alone for {steps} steps on make train's batch "
             "stream (scripts/bench_mask.py's docstring); MACs: the plan's over dense; recall / covered: the Car "
             "boxes' cells inside the mask, boxes with every cell inside.", "",
             "| variant | convs | channels | margin m | threshold | fwd+bwd ms | train MACs | train recall | "
             "train covered | val MACs | val recall | val covered |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        tr, va = r["train"], r["val"]
        lines.append(f"| {r['variant']} | {r['num_convs']} | {r['channels']} | {r['margin']:g} | {r['threshold']:g} | "
                     f"{r['ms_fwd_bwd']:.1f} | {tr['macs']:.3f} | {tr['recall']:.3f} | {tr['covered']:.3f} | "
                     f"{va['macs']:.3f} | {va['recall']:.3f} | {va['covered']:.3f} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[6:]))
    print(f"wrote {out}, {out.with_suffix('.md')}")
    return 0
