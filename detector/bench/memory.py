"""Estimated vs measured peak memory of a training step and of inference (detector/memory.py), on the CPU.

    python scripts/bench_memory.py [bevs=small,kitti] [batches=1,2,4,8,16] [sparsities=dense,0.5,0.7,0.9]
                                   [modes=train,infer] [limit_mb=6000] [root=data/sim_kitti] [out=benchmarks/memory_cpu]
                                   [merge=false] [note=TEXT] [render_only=false]

The CPU training config's model (configs/model/sparse.yaml with fixed 16-px tiles, Adam) on real train frames of
``root``; the computation mask is replaced by a random mask of 16-px tiles with ``1 - sparsity`` of them active
(``dense``: mask=none, the dense network). So ``sparsity`` here is the inactive tile share at stride 1 only: the
deeper stages' shares are those of the same mask's real blocks at their strides (coarser tiles, fewer of them
inactive); scripts/estimate_memory.py's ``sparsity=`` is the inactive share at every stage. measured: the bytes of
the tensors alive before the step (parameters, buffers, optimizer state, the batch) plus the peak of the CPU
allocator's events during it (torch.profiler memory events; not RSS), for one training step (forward, loss,
backward, optimizer step) after a warm-up step, or one inference forward (no grad). estimate:
:func:`detector.memory.estimate` from the shapes and the mask's active blocks per chain (no layer runs). Rows whose
estimate exceeds ``limit_mb`` are not measured (marked).
``out``: the files ``out``.json and ``out``.md (``out=X.json`` names the same pair).
``merge=true`` keeps the rows of ``out``.json that this run does not redo (same bev, batch, sparsity, mode) and
adds this command to the recorded ones: a table measured in several runs (a shared machine) stays one file.
``note=TEXT`` is recorded with the run (why rows were left unmeasured, the machine's state).
``render_only=true`` measures nothing: it rewrites ``out``.md from ``out``.json (after editing its notes by hand).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from detector.build import build_grid, build_model
from detector.cli import parse_args
from detector.machine import allocator_env, cpu_model
from detector.memory import MB, estimate, measure_peak, tensor_bytes
from detector.tasks import build_datamodule

REPO = Path(__file__).resolve().parents[2]


def setup(bev: str, root: str, dense: bool):
    with initialize_config_dir(str(REPO / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=[f"bev={bev}", f"data.root={root}", "data.num_workers=0", "data.augment=null",
                                          "model.block_size=16", "model.head_block_size=16", "paths.output_dir=/tmp/bm"]
                      # a data-side mask (road_map) for the sparse rows: the table sets the mask itself
                      + ["mask=none" if dense else "mask=road_map"])
    grid = build_grid(cfg.bev)
    torch.manual_seed(0)
    return cfg, grid, build_model(cfg.model, cfg.mask, grid)


def tile_mask(n: int, H: int, W: int, share: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    coarse = (torch.rand(n, 1, -(-H // 16), -(-W // 16), generator=g) < share).float()
    return coarse.repeat_interleave(16, 2).repeat_interleave(16, 3)[:, :, :H, :W].contiguous()


def batch_of(cfg, grid, b: int, sparse: bool, share: float | None):
    data_cfg = cfg.data.copy()
    data_cfg.batch_size = b
    dm = build_datamodule(data_cfg, cfg.mask, grid, sparse)
    batch = next(iter(dm.train_dataloader()))
    mask = tile_mask(b, grid.H, grid.W, share, seed=b) if share is not None else None
    return dataclasses.replace(batch, mask=mask)


def run(bev: str, b: int, sparsity: str, modes: list[str], args: dict) -> list[dict]:
    dense = sparsity == "dense"
    cfg, grid, model = setup(bev, args["root"], dense)
    share = None if dense else 1.0 - float(sparsity)
    batch = batch_of(cfg, grid, b, not dense, share)
    rows = []
    for mode in modes:
        train = mode == "train"
        est = estimate(model, b, None if dense else share, train, mask=batch.mask)
        row = {"bev": bev, "batch": b, "sparsity": sparsity, "mode": mode, "estimate_mb": round(est.peak_mb, 1),
               "estimate_parts_mb": {k: round(getattr(est, k) / MB, 1) for k in
                                     ("params", "grads", "optimizer", "activations", "workspace")}}
        if est.peak_mb > float(args["limit_mb"]):
            row["measured_mb"] = None
            row["note"] = f"not measured: estimate above limit_mb={args['limit_mb']}"
        else:
            t0 = time.perf_counter()
            row["measured_mb"] = round(measure(model, batch, train) / MB, 1)
            row["measure_s"] = round(time.perf_counter() - t0, 1)
            row["error_pct"] = round(100 * (row["estimate_mb"] - row["measured_mb"]) / row["measured_mb"], 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def measure(model, batch, train: bool) -> int:
    dev = torch.device("cpu")
    if not train:
        model.eval()
        base = tensor_bytes([*model.parameters(), *model.buffers(), batch.points, batch.mask])
        with torch.no_grad():
            model(batch)  # warm-up (kernel caches, the plan)
            return base + measure_peak(lambda: model(batch), dev)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)

    def step():
        out = model(batch)
        loss, _ = model.loss(out, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up: the optimizer state exists from here on, as in training
    gc.collect()
    state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    base = tensor_bytes([*model.parameters(), *model.buffers(), *state, batch.points, batch.mask])
    return base + measure_peak(step, dev)


KEY = ("bev", "batch", "sparsity", "mode")


def markdown(meta: dict, rows: list[dict]) -> str:
    measured = [r for r in rows if "error_pct" in r]
    worst = max(measured, key=lambda r: abs(r["error_pct"]), default=None)
    within = sum(abs(r["error_pct"]) <= 10 for r in measured)
    lines = ["# Peak memory: estimate (detector/memory.py, from shapes) vs measured (CPU allocator events)", "",
             f"{meta.get('cpu')}, {meta['threads']} threads, torch {meta['torch']}, allocator {meta['allocator']}. "
             "CPU training config (configs/model/sparse.yaml), fixed 16-px tiles, Adam, fp32, real sim frames; "
             "sparsity = share of 16-px tiles inactive at stride 1 (random tiles); the deeper stages' shares are "
             "those of the same mask's real blocks at their strides (coarser tiles: fewer inactive), unlike "
             "scripts/estimate_memory.py's sparsity=, the inactive share at every stage; train = forward + loss + "
             "backward + optimizer step after a warm-up step; measured = tensors alive before + peak of "
             "torch.profiler's CPU allocator events (not RSS). Runs (merged; load average at their start and end):", ""]
    lines += [f"- `{c}`" for c in meta.get("commands", [])]
    lines += ["", *meta.get("notes", [])] if meta.get("notes") else []
    lines += ["", f"{len(measured)} measured rows; |error| <= 10 % in {within}"
              + (f"; largest |error| {worst['error_pct']:+.1f} % ({worst['bev']} batch {worst['batch']} sparsity "
                 f"{worst['sparsity']} {worst['mode']})." if worst else "."), "",
              "| bev | batch | sparsity | mode | estimate MB | measured MB | error % |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        meas = "-" if r["measured_mb"] is None else f"{r['measured_mb']:.1f}"
        err = f"{r['error_pct']:+.1f}" if "error_pct" in r else r.get("note", "")
        lines.append(f"| {r['bev']} | {r['batch']} | {r['sparsity']} | {r['mode']} | {r['estimate_mb']:.1f} | "
                     f"{meas} | {err} |")
    return "\n".join(lines) + "\n"


def out_files(out: str | Path) -> tuple[Path, Path]:
    """The JSON and markdown files of ``out=``: ``out``.json and ``out``.md (a name ending in .json or .md names the
    pair too; any other dot stays part of the name)."""
    name = str(out)
    ext = next((e for e in (".json", ".md") if name.endswith(e) and len(name) > len(e)), "")
    name = name[: len(name) - len(ext)]
    return Path(name + ".json"), Path(name + ".md")


def render(out: str | Path) -> None:
    """Rewrite ``out``.md from ``out``.json (no measurement)."""
    js, md = out_files(out)
    data = json.loads(js.read_text())
    md.write_text(markdown(data["meta"], data["rows"]))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv, {"bevs": "small,kitti", "batches": "1,2,4,8,16", "sparsities": "dense,0.5,0.7,0.9",
                             "modes": "train,infer", "limit_mb": 6000.0, "root": "data/sim_kitti",
                             "out": "benchmarks/memory_cpu", "merge": False, "note": "",
                             "render_only": False},
                      __doc__)
    argv = sys.argv[1:] if argv is None else list(argv)
    js, md = out_files(args["out"])
    if args["render_only"]:
        if not js.is_file():
            raise SystemExit(f"error: render_only=true: {js} does not exist")
        render(args["out"])
        print(f"wrote {md} from {js}")
        return
    command = " ".join(["python scripts/bench_memory.py", *(a for a in argv if not a.startswith("note="))])
    load_start = os.getloadavg()[0]
    rows = []
    for bev in args["bevs"].split(","):
        for sparsity in args["sparsities"].split(","):
            for b in (int(x) for x in args["batches"].split(",")):
                rows += run(bev, b, sparsity, args["modes"].split(","), args)
    command += f" (load {load_start:.1f} -> {os.getloadavg()[0]:.1f})"
    meta = {"cpu": cpu_model(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "allocator": allocator_env(),
            "measured": "tensors alive before + peak of torch.profiler CPU allocator events (not RSS)",
            "commands": [command], "notes": [args["note"]] if args["note"] else []}
    if args["merge"] and js.is_file():
        old = json.loads(js.read_text())
        for key in ("cpu", "torch"):  # rows from several machines or torch versions: say so (earlier runs first)
            was = str(old["meta"].get(key, ""))
            if was and str(meta[key]) not in was:
                meta[key] = f"{was}; {meta[key]} (run {len(old['meta'].get('commands', [])) + 1} on)"
            elif was:
                meta[key] = was
        meta["commands"] = old["meta"].get("commands", []) + meta["commands"]
        meta["notes"] = [n for n in [old["meta"].get("note")] if n] + old["meta"].get("notes", []) + meta["notes"]
        new = {tuple(r[k] for k in KEY): r for r in rows}
        rows = [new.pop(tuple(r[k] for k in KEY), r) for r in old["rows"]] + list(new.values())
    js.parent.mkdir(parents=True, exist_ok=True)
    js.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    md.write_text(markdown(meta, rows))
    print(f"wrote {js} and {md}")
