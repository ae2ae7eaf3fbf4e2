"""One checkpoint on both sparse paths, taking turns step by step: is the capacity path (the one a GPU runs) as fast
as the exact path on this machine, in a training step and in inference?

    python scripts/bench_paths.py ckpt_path=PATH [root=data/sim_kitti] [steps=16] [out=benchmarks/paths_cpu.json]

Two copies of the checkpoint's detector, one per path (``train_path`` and ``inference_path`` set), time ``steps``
training steps (after two warm-up steps; AdamW at a small learning rate) on the same batches of the training loader,
then ``steps`` inference batches of the val loader (eval mode, no autograd), the paths taking turns batch by batch so
that a drift of the machine's speed meets both alike (:func:`detector.bench.train.step_breakdown`). Per path: median
ms per part (voxelize, mask, plan, the network - ``backbone`` and ``head`` on the exact path, ``network`` on the
capacity one - forward, loss, backward, optimizer, step) and the capacity path's ratio to the exact one. The two
compute the same function (benchmarks/invariance_cpu.md); only the time is measured here. Writes ``out`` (JSON) and
the markdown table beside it.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

import torch

from detector.bench.train import step_breakdown
from detector.cli import parse_args
from detector.machine import allocator_env, cpu_model

USAGE = __doc__
REPO = Path(__file__).resolve().parents[2]
PATHS = ("exact", "capacity")


def _table(title: str, ms: dict[str, dict[str, float]]) -> list[str]:
    parts = list(dict.fromkeys(k for p in PATHS for k in ms[p]))
    rows = [f"### {title}", "", "| part (median ms) | exact | capacity | capacity / exact |", "|---|---|---|---|"]
    for part in parts:
        a, b = ms["exact"].get(part), ms["capacity"].get(part)
        ratio = f"{b / a:.2f}" if a and b is not None else "-"
        rows.append(f"| {part} | {'-' if a is None else f'{a:.1f}'} | {'-' if b is None else f'{b:.1f}'} | {ratio} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, {"ckpt_path": None, "root": "data/sim_kitti", "steps": 16,
                             "out": str(REPO / "benchmarks" / "paths_cpu.json")}, USAGE)
    if not args["ckpt_path"]:
        raise SystemExit("error: ckpt_path=PATH is required (see --help)")
    ckpts = {p: args["ckpt_path"] for p in PATHS}
    settings = {p: {"train_path": p, "inference_path": p} for p in PATHS}
    train = step_breakdown(ckpts, args["root"], int(args["steps"]), settings, train=True)
    infer = step_breakdown(ckpts, args["root"], int(args["steps"]), settings, train=False)
    meta = {"checkpoint": str(args["ckpt_path"]), "root": str(args["root"]), "steps": int(args["steps"]),
            "machine": f"{platform.machine()}, {cpu_model()}, {len(os.sched_getaffinity(0))} usable CPUs",
            "threads": torch.get_num_threads(), "torch": torch.__version__, "allocator": allocator_env(),
            "load_average": os.getloadavg(), "command": "python scripts/bench_paths.py " + " ".join(sys.argv[1:])}
    ratios = {"train_step": round(train["capacity"]["step"] / train["exact"]["step"], 3),
              "inference_batch": round(infer["capacity"]["step"] / infer["exact"]["step"], 3)}
    out = Path(args["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "train_ms": train, "inference_ms": infer, "capacity_over_exact": ratios},
                              indent=1))
    md = ["# The two sparse paths on one checkpoint", "",
          f"`{meta['command']}` on {meta['machine']}, {meta['threads']} threads, torch {meta['torch']}, allocator "
          f"{meta['allocator']}, load average {meta['load_average'][0]:.1f}; {meta['steps']} batches each, the paths "
          "taking turns batch by batch.", "",
          f"Capacity path over exact path: training step **{ratios['train_step']:.2f}x**, inference batch "
          f"**{ratios['inference_batch']:.2f}x** (below 1: the capacity path is faster).", "",
          *_table("Training step (batches of the training loader)", train), "",
          *_table("Inference (batches of the val loader, eval mode, no autograd)", infer), "",
          "Both paths compute the same function (benchmarks/invariance_cpu.md). Off CUDA the capacity path's block "
          "lists hold exactly the active blocks (no padding rows: nothing is captured or replayed there); on CUDA "
          "they hold a bucket's rows, so that captured graphs replay."]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0
