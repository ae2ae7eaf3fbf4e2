"""Training-frame loading with and without the frame cache (``data.cache_mb``), on make train's data.

    python scripts/bench_loader.py [root=data/sim_kitti] [epochs=3] [frames=0] [cache_mb=512]
                                   [out=benchmarks/loader_cpu.json] [extra="..."]

Builds make train's training split the way training does (the train config: augmentation, mask, BEV; ``extra``:
more Hydra overrides) twice, with ``data.cache_mb=0`` (every load reads the files and cuts the points to the
camera's view) and with ``data.cache_mb=<cache_mb>``, and loads every frame (or the first ``frames``) for
``epochs`` epochs, the two datasets taking turns frame by frame so that a drift of the machine's speed meets both
alike. Records the mean ms per frame of each epoch for each, the cache's size after the run, and the machine
(CPU, threads, allocator settings). The first epoch fills the cache: the later ones show what it saves.
Writes JSON to ``out`` and a markdown table beside it.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from detector.build import build_grid
from detector.cli import parse_args
from detector.machine import allocator_env, cpu_model
from detector.tasks import build_datamodule

REPO = Path(__file__).resolve().parents[2]
USAGE = __doc__
DEFAULTS = {"root": "data/sim_kitti", "epochs": 3, "frames": 0, "cache_mb": 512.0,
            "out": "benchmarks/loader_cpu.json", "extra": ""}


def train_dataset(root: str, cache_mb: float, extra: list[str]):
    with initialize_config_dir(str(REPO / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=[f"data.root={root}", "data.num_workers=0", f"data.cache_mb={cache_mb}",
                                          "paths.output_dir=/tmp/bench_loader", *extra])
    dm = build_datamodule(cfg.data, cfg.mask, build_grid(cfg.bev), bool(cfg.model.sparse))
    return dm.dataset("train")


def run(root: str, epochs: int, frames: int, cache_mb: float, extra: list[str]) -> dict:
    sets = {"cache_mb=0": train_dataset(root, 0.0, extra),
            f"cache_mb={cache_mb:g}": train_dataset(root, cache_mb, extra)}
    n = len(next(iter(sets.values())))
    n = min(n, frames) if frames > 0 else n
    per_epoch = {k: [] for k in sets}
    for epoch in range(epochs):
        spent = dict.fromkeys(sets, 0.0)
        for ds in sets.values():
            ds.set_epoch(epoch)
        for i in range(n):
            order = list(sets.items()) if i % 2 == 0 else list(sets.items())[::-1]
            for name, ds in order:
                t = time.perf_counter()
                ds[i]
                spent[name] += time.perf_counter() - t
        for name in sets:
            per_epoch[name].append(round(spent[name] / n * 1e3, 2))
    cached = sets[f"cache_mb={cache_mb:g}"]
    return {"frames": n, "epochs": epochs, "ms_per_frame": per_epoch,
            "cache": {"frames": len(cached._cache), "mib": round(cached._cached / 2**20, 1)},
            "machine": {"cpu": f"{platform.machine()}, {cpu_model()}", "threads": torch.get_num_threads(),
                        "torch": torch.__version__, "allocator": allocator_env()}}


def markdown(r: dict) -> str:
    names = list(r["ms_per_frame"])
    rows = ["| epoch | " + " | ".join(f"{k} (ms / frame)" for k in names) + " | ratio |",
            "|---|" + "---|" * (len(names) + 1)]
    for e in range(r["epochs"]):
        a, b = (r["ms_per_frame"][k][e] for k in names)
        rows.append(f"| {e} | {a:.2f} | {b:.2f} | {b / a:.2f} |")
    m = r["machine"]
    return (f"# Loading make train's training frames (`{r['command']}`)\n\n{m['cpu']}, {m['threads']} threads, torch "
            f"{m['torch']}, allocator {m['allocator']}; {r['frames']} frames per epoch, the two datasets taking turns "
            "frame by frame (augmentation runs on every load in both).\n\n" + "\n".join(rows)
            + f"\n\nThe cache held {r['cache']['frames']} frames, {r['cache']['mib']} MiB, after the run; the first "
            "epoch fills it.\n")


def main(argv=None) -> int:
    args = parse_args(argv, DEFAULTS, USAGE)
    extra = [e for e in str(args["extra"]).split() if e]
    r = run(str(args["root"]), int(args["epochs"]), int(args["frames"]), float(args["cache_mb"]), extra)
    r["command"] = " ".join(["python scripts/bench_loader.py", *(sys.argv[1:] if argv is None else argv)])
    out = Path(args["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(r, indent=1) + "\n")
    text = markdown(r)
    out.with_suffix(".md").write_text(text)
    print(text)
    return 0
