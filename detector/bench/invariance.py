"""One checkpoint evaluated every way its sparse network can run: the same detections and AP, only the time differs.

    python scripts/bench_invariance.py ckpt_path=PATH [ways=8;16;32;dense;auto] [out=benchmarks/invariance_cpu.json]

Each way is a ``block_size`` (8, 16, 32, dense, auto: the tile of every sparse stage), ``;``-separated. Per way: the
KITTI evaluation of the checkpoint's val split through :func:`detector.tasks.evaluate_checkpoint` (the code
``scripts/evaluate.py`` runs), Car BEV / 3D AP R40 moderate, ms per frame, and whether its result files are
byte-identical to the first way's. Writes ``out`` (JSON) and the markdown table beside it.
"""

from __future__ import annotations

import filecmp
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from detector.build import load_detector
from detector.cli import parse_args
from detector.machine import allocator_env, cpu_model
from detector.resources import config_dir
from detector.tasks import CHECKPOINT_DATA, evaluate_checkpoint

USAGE = __doc__
REPO = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, {"ckpt_path": None, "ways": "8;16;32;dense;auto",
                             "out": str(REPO / "benchmarks" / "invariance_cpu.json")}, USAGE)
    if not args["ckpt_path"]:
        raise SystemExit("error: ckpt_path=PATH is required (see --help)")
    _, cfg = load_detector(args["ckpt_path"])
    with initialize_config_dir(str(config_dir()), version_base="1.3"):  # eval.yaml's data, the checkpoint's settings
        data = OmegaConf.to_container(compose("eval", [f"ckpt_path={args['ckpt_path']}"]).data, resolve=True)
    data.update({k: v for k, v in OmegaConf.to_container(cfg.data).items() if k in CHECKPOINT_DATA})
    data_cfg = OmegaConf.create(data)
    rows, first = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for text in str(args["ways"]).split(";"):
            block = text.strip()
            out = Path(tmp) / block
            metrics = evaluate_checkpoint(args["ckpt_path"], data_cfg, out, split=cfg.data.val_split,
                                          block_size=block)
            files = sorted(p.name for p in (out / "data").glob("*.txt"))
            same = None if first is None else (files == first[1] and all(
                filecmp.cmp(out / "data" / f, first[0] / "data" / f, shallow=False) for f in files))
            if first is None:
                first = (out, files)
            rows.append({"block_size": block,
                         "bev_moderate": metrics["Car"]["bev"]["R40"]["moderate"],
                         "3d_moderate": metrics["Car"]["3d"]["R40"]["moderate"],
                         "ms_per_frame": json.loads((out / "metrics.json").read_text())["_run"]["ms_per_frame"],
                         "files_identical_to_first": same})
    meta = {"checkpoint": str(args["ckpt_path"]), "machine": f"{platform.machine()}, {cpu_model()}, "
            f"{len(os.sched_getaffinity(0))} usable CPUs", "threads": torch.get_num_threads(),
            "torch": torch.__version__, "allocator": allocator_env(), "load_average": os.getloadavg(),
            "command": "python scripts/bench_invariance.py " + " ".join(sys.argv[1:])}
    out = Path(args["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = ["# One checkpoint, every way of running its sparse network", "",
          f"`{meta['command']}` on {meta['machine']}, {meta['threads']} threads, torch {meta['torch']}, "
          f"allocator {meta['allocator']}, load average {meta['load_average'][0]:.1f}.", "",
          "| block_size | Car BEV AP R40 mod | Car 3D AP R40 mod | ms/frame | files = first way's |",
          "|---|---|---|---|---|"]
    same = {None: "-", True: "yes", False: "**no**"}
    md += [f"| {r['block_size']} | {r['bev_moderate']:.4f} | {r['3d_moderate']:.4f} | "
           f"{r['ms_per_frame']:.1f} | {same[r['files_identical_to_first']]} |" for r in rows]
    md += ["", "The mask defines what each unit computes, so every way gives the same detections; ms/frame includes "
           "decoding and the plan, one pass, on a machine that may be loaded (ratios, not figures, are the point of "
           "benchmarks/model_cpu.md)."]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0
