"""Milliseconds of one training step of a configuration, on one fixed batch: what a step costs with your
overrides, or - run from two checkouts in turn (``PYTHONPATH=<tree>``) - whether a change made the step slower.

    python scripts/bench_step.py [steps=12] [warmup=3] [out=PATH.json] [Hydra overrides of scripts/train.py ...]

Run as ``PYTHONPATH=<tree> python <this file>`` it times that tree's package with that tree's configs (the detector
package imported decides both). The training config (``configs/train.yaml`` with the overrides: by default make
train's, bev=small, mask=predicted, block_size=auto) on its first training batch (augmented as in training), AdamW:
``warmup`` steps, then ``steps`` timed ones (forward, loss, backward, optimizer step), the mask schedule past its
warm-up (the predicted mask). Prints the median, min and max ms per step; ``out``: appends them as one JSON line
(with the tree, the CPU, the threads and the allocator settings).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
from hydra import compose, initialize_config_dir

from detector.build import build_grid, build_model
from detector.cli import parse_args
from detector.machine import allocator_env, cpu_model
from detector.resources import config_dir
from detector.tasks import build_datamodule


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    own = [a for a in argv if a.split("=")[0] in ("steps", "warmup", "out", "-h", "--help")]
    args = parse_args(own, {"steps": 12, "warmup": 3, "out": ""}, __doc__)
    overrides = [a for a in argv if a not in own]
    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        cfg = compose("train", overrides=["data.num_workers=0", "paths.output_dir=/tmp/bench_step", *overrides])
    grid = build_grid(cfg.bev)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, cfg.mask, grid).train()
    batch = next(iter(build_datamodule(cfg.data, cfg.mask, grid, bool(cfg.model.sparse)).train_dataloader()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    past_warmup = 10**6  # the schedule's steps after its warm-up: the mask it trains with for most of a run

    def step(i: int) -> float:
        t0 = time.perf_counter()
        out = model(batch, step=past_warmup + i)
        loss, _ = model.loss(out, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return 1000 * (time.perf_counter() - t0)

    for i in range(int(args["warmup"])):
        step(i)
    ms = [step(i) for i in range(int(args["steps"]))]
    tree = str(config_dir().parent)
    row = {"tree": tree, "overrides": overrides, "median_ms": round(statistics.median(ms), 1),
           "min_ms": round(min(ms), 1), "max_ms": round(max(ms), 1), "steps": len(ms), "cpu": cpu_model(),
           "threads": torch.get_num_threads(), "allocator": allocator_env()}
    print(f"ms per training step: median {row['median_ms']}, min {row['min_ms']}, max {row['max_ms']} "
          f"({len(ms)} steps, {tree})")
    if args["out"]:
        with open(args["out"], "a") as f:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
