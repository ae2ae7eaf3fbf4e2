"""Inference ms/frame of the exported detector on the CPU: eager, torch.compile, the .pt2 program, onnxruntime.

    python scripts/bench_export.py [bevs=small,kitti] [frames=4] [reps=5] [root=data/sim_kitti] [block_size=auto]
                                   [backends=eager,compile,pt2,onnx] [out=benchmarks/export_cpu]

The CPU training config's model (configs/model/sparse.yaml, random weights, eval mode) on the first ``frames``
val frames of ``root`` one at a time (batch 1), sparse on the frames' road-map masks and dense (mask=none), through
each backend: eager PyTorch (the network the programs are exported from, plan frozen on the first frame;
``block_size=16`` fixes the tiles of every sparse stage instead of the ``auto`` plan, which may choose dense),
``torch.compile`` (:func:`detector.export.compile_net`: inductor, dynamic shapes, the block counts captured in the
graph; inductor's layout optimization off for the sparse network, see compile_net), the ``torch.export``
program (``ExportedProgram.module()``) and the ONNX model on onnxruntime's CPU provider (the sbnet ops in
standard operators). Time = network only (BEV tensor + mask -> heatmap + regression): median over ``reps``
passes over the frames, after two warm-up passes. Outputs are checked against eager (max abs difference).
The sparse network's torch._dynamo graphs and graph breaks per bev (``torch._dynamo.explain`` on the first frame:
traced, not compiled; :func:`detector.export.graph_breaks`) go in the metadata (``graph_breaks``).
Writes ``out``.json and ``out``.md with the CPU model, threads and the allocator settings (use the Makefile's
``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=4000000000``).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from detector.build import build_grid, build_model
from detector.cli import parse_args
from detector.export import (
    DeployNet,
    OnnxRunner,
    compile_net,
    export_onnx,
    export_program,
    freeze_modes,
    graph_breaks,
)
from detector.machine import allocator_env, cpu_model
from detector.tasks import build_datamodule

REPO = Path(__file__).resolve().parents[2]


def frames(bev: str, root: str, n: int, block_size: str):
    with initialize_config_dir(str(REPO / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=[f"bev={bev}", f"data.root={root}", "data.num_workers=0", "mask=road_map",
                                          "data.augment=null", "data.eval_batch_size=1", "paths.output_dir=/tmp/be",
                                          f"model.block_size={block_size}", f"model.head_block_size={block_size}"])
    grid = build_grid(cfg.bev)
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.mask, grid).eval()
    dm = build_datamodule(cfg.data, cfg.mask, grid, True)
    out = []
    with torch.no_grad():
        for batch in dm.val_dataloader():
            out.append((model.voxelize(batch), batch.mask.to(torch.float32)))
            if len(out) == n:
                break
    return model, out


def timed(fn, inputs, reps: int) -> float:
    with torch.no_grad():
        for _ in range(2):  # warm-up: one pass leaves first-call costs (measured: 116 vs 32 ms at bev=small)
            for x in inputs:
                fn(*x)
        runs = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for x in inputs:
                fn(*x)
            runs.append((time.perf_counter() - t0) / len(inputs))
    runs.sort()
    return 1000 * runs[len(runs) // 2]


def graph_break_record(net: torch.nn.Module, *inputs: torch.Tensor) -> dict:
    """``torch._dynamo.explain`` of ``net`` on ``inputs`` (traced as torch.compile would, nothing compiled): the
    number of graphs, of graph breaks and the first breaks' reasons; or the error if tracing fails."""
    try:
        graphs, breaks, reasons = graph_breaks(net, *inputs)
    except Exception as e:  # noqa: BLE001 - reported in the metadata, as a failing backend is in its row
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    return {"graphs": graphs, "graph_breaks": breaks, "reasons": [str(r)[:200] for r in reasons[:5]]}


def bench(bev: str, args: dict, tmp: Path, meta: dict | None = None) -> list[dict]:
    """The rows of ``bev``; the sparse network's graph breaks go in ``meta["graph_breaks"][bev]``."""
    model, data = frames(bev, args["root"], int(args["frames"]), args["block_size"])
    rows = []
    for variant in ("sparse", "dense"):
        source = "input" if variant == "sparse" else "none"
        modes = freeze_modes(model, *data[0]) if variant == "sparse" else None
        net = DeployNet(model, source, modes)
        if variant == "sparse" and meta is not None:
            meta.setdefault("graph_breaks", {})[bev] = graph_break_record(net, *data[0])
            print(json.dumps({"bev": bev, "graph_breaks": meta["graph_breaks"][bev]}), flush=True)
        inputs = [x if variant == "sparse" else x[:1] for x in data]
        with torch.no_grad():
            refs = [net(*x) for x in inputs]
        program = export_program(net, *data[0]) if {"pt2", "onnx"} & set(args["backends"]) else None
        for backend in args["backends"]:
            t0 = time.perf_counter()
            try:
                if backend == "eager":
                    fn = net
                elif backend == "compile":
                    fn = compile_net(net, dynamic=True)
                elif backend == "pt2":
                    fn = program.module()
                else:
                    fn = OnnxRunner(export_onnx(program, tmp / f"{bev}_{variant}.onnx"))
                with torch.no_grad():
                    err = max(float((a - torch.as_tensor(b)).abs().max()) for x, r in zip(inputs, refs, strict=True)
                              for a, b in zip(r, fn(*x), strict=True))
                prep = time.perf_counter() - t0
                ms = timed(fn, inputs, int(args["reps"]))
                row = {"bev": bev, "variant": variant, "backend": backend, "ms_per_frame": round(ms, 2),
                       "max_abs_diff_vs_eager": err, "prepare_s": round(prep, 1), "plan": modes}
            except Exception as e:  # noqa: BLE001 - a backend that fails is reported, not hidden
                row = {"bev": bev, "variant": variant, "backend": backend, "error": f"{type(e).__name__}: {e}"[:300]}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def _breaks_text(g: dict) -> str:
    if "error" in g:
        return f"not traced ({g['error'][:120]})"
    text = f"{g['graph_breaks']} ({g['graphs']} graph{'' if g['graphs'] == 1 else 's'})"
    return text + (f": {', '.join(g['reasons'])}" if g.get("reasons") else "")


def write(out: Path, meta: dict, rows: list[dict]) -> None:
    meta = dict(meta, loadavg_end=os.getloadavg())  # a shared machine: other work there slows every row
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [f"# Exported detector, CPU inference ({meta['cpu']}, {meta['threads']} threads, torch {meta['torch']}, "
             f"onnxruntime {meta.get('onnxruntime')}, allocator {meta['allocator']}; load average "
             f"{meta['loadavg_start'][0]:.1f} at the start, {meta['loadavg_end'][0]:.1f} at the end)", "",
             f"`python scripts/bench_export.py frames={meta['frames']} reps={meta['reps']} "
             f"block_size={meta['block_size']}` - batch 1, median of {meta['reps']} passes over {meta['frames']} "
             "val frames (road-map masks); ms/frame of the network (BEV + mask -> heatmap + regression); compile = "
             "inductor via detector.export.compile_net (layout optimization off for the sparse network); prepare s "
             "includes the first call (compiling).", ""]
    if meta.get("graph_breaks"):
        lines += ["torch._dynamo graph breaks of the sparse network (torch._dynamo.explain on the first frame, "
                  "traced, not compiled): " + "; ".join(f"{bev} {_breaks_text(g)}"
                                                        for bev, g in meta["graph_breaks"].items()) + ".", ""]
    lines += ["| bev | variant | backend | ms/frame | max abs diff vs eager | prepare s |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['bev']} | {r['variant']} | {r['backend']} | failed: {r['error'][:120]} | | |")
        else:
            lines.append(f"| {r['bev']} | {r['variant']} | {r['backend']} | {r['ms_per_frame']:.1f} | "
                         f"{r['max_abs_diff_vs_eager']:.1e} | {r['prepare_s']} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv, {"bevs": "small,kitti", "frames": 4, "reps": 5, "root": "data/sim_kitti",
                             "backends": "eager,compile,pt2,onnx", "out": "benchmarks/export_cpu",
                             "block_size": "auto"}, __doc__)
    args["backends"] = args["backends"].split(",")
    meta = {"cpu": cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "allocator": allocator_env(),
            "frames": int(args["frames"]), "reps": int(args["reps"]), "root": args["root"], "batch": 1,
            "block_size": args["block_size"],
            "loadavg_start": os.getloadavg()}
    try:
        import onnxruntime

        meta["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        pass
    rows = []
    out = Path(args["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for bev in args["bevs"].split(","):
            rows += bench(bev, args, Path(tmp), meta)
            write(out, meta, rows)  # after each grid: a run cut short keeps what it measured
    print(f"wrote {out}.json and {out}.md")
