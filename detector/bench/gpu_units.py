# ruff: noqa: B023  (every lambda here is timed within its own loop iteration: late binding cannot bite)
"""GPU rows of the sync-free, fused, captured sparse path against the best dense (issue 42's goal rows).

    python detector/bench/gpu_units.py out=FILE.json [md=FILE.md] [dtype=float32,bfloat16] [batch=1,8]
        [sparsity=0.5,0.9] [what=units,backbone,train,profile] [reps=20] [compile=true] [device=cuda]

- ``units``: the bottleneck unit of stage 1 at bev=kitti (400 x 352 x 96, 24 mid channels), a random tile mask at
  each sparsity; forward: dense eager, dense captured, dense ``torch.compile(mode="reduce-overhead")`` (``compile``),
  sparse on a list of the count (eager), on a bucket eager and captured; forward + backward (training-mode BN): dense
  vs the list of the count and the bucket. Ratios against the faster dense; the floor beside them: the dense and the
  active blocks' MACs (halos included) and their quotient, the halo bound.
- ``backbone``: the default model's backbone at bev=kitti (36 x 800 x 704), a blob mask (about a quarter of the map)
  at tile 16: dense eager / captured / compiled vs the capacity path captured (the plan's read and the overflow
  read included), per batch.
- ``train``: one training step (forward + backward + SGD) of that backbone at batch 8: dense (eager, graphed,
  compiled) vs a list of the count (eager) and the bucket (eager with its plan read; forward and backward captured
  as graphs, ``model.capture_train``; compiled) at tile 16.
- ``profile``: kernels (CUDA kernel events) and host syncs (``torch.cuda.set_sync_debug_mode``'s warnings) per
  forward of the backbone: dense, a list of the count, capacity eager, capacity captured (one graph launch).

Without CUDA (``device=cpu``) it runs the same code on tiny shapes (``tiny=true`` is then implied): a smoke test of
the plumbing, not a measurement. Rows go to ``out`` as JSON (a list), a markdown table to ``md``.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path

import torch

DEFAULTS = {"out": "", "md": "", "dtype": "float32,bfloat16", "batch": "1,8", "sparsity": "0.5,0.9",
            "what": "units,backbone,train,profile", "reps": "20", "compile": "true", "device": "cuda",
            "tiny": "false"}


def parse(argv: list[str]) -> dict:
    args = dict(DEFAULTS)
    for a in argv:
        key, sep, value = a.partition("=")
        if not sep or key not in DEFAULTS:
            raise SystemExit(f"error: unexpected argument {a!r} (key=value with key in: {', '.join(DEFAULTS)})")
        args[key] = value
    return args


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev: torch.device, reps: int) -> float:  # noqa: ANN001
    """Median milliseconds of ``fn()`` over ``reps`` synchronized runs, after two warm-up runs."""
    for _ in range(2):
        fn()
    _sync(dev)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        times.append(1e3 * (time.perf_counter() - t0))
    times.sort()
    return times[len(times) // 2]


def tile_mask(n: int, h: int, w: int, tile: int, active: float, seed: int, dev: torch.device) -> torch.Tensor:
    """A mask whose ``active`` share of ``tile``-pixel tiles holds one set pixel (at the tile's centre)."""
    g = torch.Generator().manual_seed(seed)
    th, tw = -(-h // tile), -(-w // tile)
    on = (torch.rand(n, 1, th, tw, generator=g) < active).float()
    m = torch.zeros(n, 1, th * tile, tw * tile)
    m[:, :, tile // 2 :: tile, tile // 2 :: tile] = on
    return m[:, :, :h, :w].to(dev)


def blob_mask(n: int, h: int, w: int, seed: int, dev: torch.device) -> torch.Tensor:
    """A few discs covering about a quarter of the map (a road-like area)."""
    g = torch.Generator().manual_seed(seed)
    yy, xx = torch.meshgrid(torch.arange(h).float(), torch.arange(w).float(), indexing="ij")
    m = torch.zeros(n, 1, h, w)
    for i in range(n):
        for _ in range(6):
            cy, cx = float(torch.rand(1, generator=g)) * h, float(torch.rand(1, generator=g)) * w
            r = 0.13 * min(h, w) * (0.6 + 0.8 * float(torch.rand(1, generator=g)))
            m[i, 0][(yy - cy) ** 2 + (xx - cx) ** 2 < r * r] = 1.0
    return m.to(dev)


def _why(e: Exception) -> str:
    """An exception in one line for a row: its type and its message's first line."""
    first = str(e).splitlines()[0][:200] if str(e) else ""
    return f"{type(e).__name__}: {first}"


def _ratio(dense_ms: float, ms: float) -> float:
    return round(dense_ms / ms, 3) if ms > 0 else float("nan")


def bench_units(args: dict, dev: torch.device, dtype: torch.dtype, rows: list) -> None:
    from detector.nn import capacity as cp
    from detector.nn.cost import dense_macs, sparse_macs
    from detector.nn.graphs import DenseRunner, capture
    from detector.nn.resnet import SparseResidualUnit, SparseStage
    from detector.ops.capacity import bucket_for

    tiny = args["tiny"] == "true"
    H, W, C = (40, 36, 16) if tiny else (400, 352, 96)
    tile, reps = (8 if tiny else 16), int(args["reps"])
    unit = SparseResidualUnit(C, C, bottleneck=True, block_size=tile).to(dev, dtype).eval()
    stage = SparseStage([unit])

    class One(torch.nn.Module):  # the unit as a one-stage net for the capacity path and the runners
        def __init__(self) -> None:
            super().__init__()
            self.stages, self.channels_last = torch.nn.ModuleList([stage]), True

        def forward(self, x):  # noqa: ANN001, ANN202
            return [unit(x)]

    net = One()
    for b in (int(v) for v in args["batch"].split(",")):
        x = torch.randn(b, C, H, W, device=dev, dtype=dtype).contiguous(memory_format=torch.channels_last)
        dense = {"eager": DenseRunner(net, "eager"), "graph": DenseRunner(net, "graph")}
        if args["compile"] == "true" and dev.type == "cuda":
            dense["compile"] = DenseRunner(net, "compile")
        dense_ms = {k: timed(lambda r=r: r(x), dev, reps) for k, r in dense.items()}
        best = min(dense_ms.values())
        for sp in (float(v) for v in args["sparsity"].split(",")):
            mask = tile_mask(b, H, W, tile, 1.0 - sp, 0, dev).to(dtype)
            with torch.no_grad():
                blocks = unit.active_blocks(mask)
                k = blocks.capacity  # a list of exactly the active blocks
                modes, caps = [tile], [(bucket_for(k, b * blocks.block.num_blocks), 0)]
                run_cap = lambda: cp.forward_capacity(net, x, mask, modes, caps)  # noqa: E731
                graph = capture(lambda a, m: cp.forward_capacity(net, a, m, modes, caps), x, mask)
                ms = {"sparse_eager": timed(lambda: unit(x, mask=mask, blocks=blocks),
                                            dev, reps),
                      "sparse_capacity": timed(run_cap, dev, reps),
                      "sparse_capacity_graph": timed(lambda: graph(x, mask), dev, reps)}
            # forward + backward (training-mode BN): dense vs a list of the count (eager) and the bucket (the
            # bucket of this count, as a training step plans it)
            unit.train()
            xg = x.detach().clone().requires_grad_()
            fb_dense = timed(lambda: unit(xg).float().sum().backward(), dev, max(3, reps // 2))
            fb_sparse = timed(lambda: unit(xg, mask=mask).float().sum().backward(), dev, max(3, reps // 2))
            fb_cap = timed(lambda: cp.stage_capacity(stage, xg, mask, tile, caps[0])[0].float().sum().backward(),
                           dev, max(3, reps // 2))
            unit.eval()
            dm, smac = dense_macs(unit, b, H, W), sparse_macs(unit, H, W, tile, k)
            rows.append({"bench": "units", "unit": f"bottleneck {H}x{W}x{C}", "batch": b, "sparsity": sp,
                         "dtype": str(dtype).removeprefix("torch."), "tile": tile, "active_blocks": k,
                         "capacity": caps[0][0], "dense_ms": {k2: round(v, 3) for k2, v in dense_ms.items()},
                         "best_dense_ms": round(best, 3), **{f"{k2}_ms": round(v, 3) for k2, v in ms.items()},
                         **{f"{k2}_x": _ratio(best, v) for k2, v in ms.items()},
                         "fwd_bwd_dense_ms": round(fb_dense, 3), "fwd_bwd_sparse_eager_ms": round(fb_sparse, 3),
                         "fwd_bwd_x": _ratio(fb_dense, fb_sparse), "fwd_bwd_sparse_capacity_ms": round(fb_cap, 3),
                         "fwd_bwd_capacity_x": _ratio(fb_dense, fb_cap), "dense_gmac": round(dm / 1e9, 3),
                         "sparse_gmac": round(smac / 1e9, 3), "halo_bound_x": _ratio(dm, smac)})


def _backbone(dev: torch.device, dtype: torch.dtype, tiny: bool):  # noqa: ANN202
    from detector.nn.resnet import SparseResNet

    torch.manual_seed(0)
    net = SparseResNet(36, stem_channels=24, stage_units=(1, 2, 2, 1), stage_channels=(48, 64, 96, 128),
                       stage_strides=(2, 2, 2, 2), bottleneck=False, block_size=16 if not tiny else 8)
    return net.to(dev, dtype).eval(), ((64, 56) if tiny else (800, 704))


def bench_backbone(args: dict, dev: torch.device, dtype: torch.dtype, rows: list) -> None:
    from detector.nn import capacity as cp
    from detector.nn.graphs import CapturedBackbone, DenseRunner

    tiny = args["tiny"] == "true"
    net, (H, W) = _backbone(dev, dtype, tiny)
    reps = int(args["reps"])
    run = CapturedBackbone(net)
    for b in (int(v) for v in args["batch"].split(",")):
        x = torch.randn(b, 36, H, W, device=dev, dtype=dtype)
        mask = blob_mask(b, H, W, 0, dev).to(dtype)
        dense = {"eager": DenseRunner(net, "eager"), "graph": DenseRunner(net, "graph")}
        if args["compile"] == "true" and dev.type == "cuda":
            dense["compile"] = DenseRunner(net, "compile")
        dense_ms = {k: timed(lambda r=r: r(x), dev, reps) for k, r in dense.items()}
        best = min(dense_ms.values())
        with torch.no_grad():
            modes, caps = cp.plan_capacities(net, x, mask)
            exact_ms = timed(lambda: net(x, mask), dev, reps)
        cap_ms = timed(lambda: run(x, mask), dev, reps)
        fixed_ms = timed(lambda: run(x, mask, modes, caps), dev, reps)
        rows.append({"bench": "backbone", "input": f"36x{H}x{W}", "batch": b,
                     "dtype": str(dtype).removeprefix("torch."), "mask": "blobs (~1/4 of the map)", "modes": modes,
                     "capacities": caps,
                     "dense_ms": {k: round(v, 3) for k, v in dense_ms.items()}, "best_dense_ms": round(best, 3),
                     "sparse_eager_ms": round(exact_ms, 3), "capacity_graph_ms": round(cap_ms, 3),
                     "capacity_graph_fixed_buckets_ms": round(fixed_ms, 3), "capacity_graph_x": _ratio(best, cap_ms),
                     "per_frame_ms": round(cap_ms / b, 3), "exact_x": _ratio(best, exact_ms)})


def bench_train(args: dict, dev: torch.device, dtype: torch.dtype, rows: list) -> None:
    """One SGD step of the backbone in training mode: dense (eager; ``compile``: also ``torch.compile``), the exact
    sparse path and the capacity path (its plan read each step, as a training step makes it; ``compile``: also
    the capacity forward compiled, the plan's modes and buckets fixed, or the error that stopped it)."""
    from detector.nn import capacity as cp

    tiny = args["tiny"] == "true"
    net, (H, W) = _backbone(dev, dtype, tiny)
    net.train()
    b = 2 if tiny else 8
    x = torch.randn(b, 36, H, W, device=dev, dtype=dtype)
    mask = blob_mask(b, H, W, 0, dev).to(dtype)
    opt = torch.optim.SGD(net.parameters(), lr=1e-4)

    def step(forward):  # noqa: ANN001, ANN202
        opt.zero_grad(set_to_none=True)
        sum(f.float().mean() for f in forward()).backward()
        opt.step()

    def capacity():  # noqa: ANN202
        modes, caps = cp.plan_capacities(net, x, mask)  # the step's one read
        return cp.forward_capacity(net, x, mask, modes, caps)[0]

    reps = max(3, int(args["reps"]) // 2)
    ms = {"dense_ms": timed(lambda: step(lambda: net(x)), dev, reps),
          "sparse_eager_ms": timed(lambda: step(lambda: net(x, mask)), dev, reps),
          "sparse_capacity_ms": timed(lambda: step(capacity), dev, reps)}
    if dev.type == "cuda":  # forward and backward captured as graphs (model.capture_train), the plan read each step
        from detector.nn.capture import capture_training

        class Lists(torch.nn.Module):
            def __init__(self, modes, caps) -> None:  # noqa: ANN001
                super().__init__()
                self.net, self.modes, self.caps = net, modes, caps

            def forward(self, a, m):  # noqa: ANN001, ANN202
                return tuple(cp.forward_capacity(self.net, a, m, self.modes, self.caps)[0])

        class Dense(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.net = net

            def forward(self, a):  # noqa: ANN001, ANN202
                return tuple(self.net(a))

        try:
            dense_g = capture_training(Dense(), x)
            ms["dense_graphed_ms"] = timed(lambda: step(lambda: dense_g(x)), dev, reps)
        except Exception as e:  # noqa: BLE001
            ms["dense_graphed_ms"] = f"failed: {_why(e)}"
        try:
            graphed = capture_training(Lists(*cp.plan_capacities(net, x, mask)), x, mask)

            def replay():  # noqa: ANN202
                cp.plan_capacities(net, x, mask)  # the step's one read (its buckets are the captured ones here)
                return graphed(x, mask)

            ms["sparse_capacity_graphed_ms"] = timed(lambda: step(replay), dev, reps)
        except Exception as e:  # noqa: BLE001  (a row that says why, not a lost run)
            ms["sparse_capacity_graphed_ms"] = f"failed: {_why(e)}"
    if args["compile"] == "true" and dev.type == "cuda":
        dense_c = torch.compile(lambda a: net(a))
        ms["dense_compiled_ms"] = timed(lambda: step(lambda: dense_c(x)), dev, reps)
        modes, caps = cp.plan_capacities(net, x, mask)
        cap_c = torch.compile(lambda a, m: cp.forward_capacity(net, a, m, modes, caps)[0])
        try:
            ms["sparse_capacity_compiled_ms"] = timed(lambda: step(lambda: cap_c(x, mask)), dev, reps)
        except Exception as e:  # noqa: BLE001  (a row that says why, not a lost run)
            ms["sparse_capacity_compiled_ms"] = f"failed: {_why(e)}"
    best = min(v for k, v in ms.items() if k.startswith("dense") and isinstance(v, float))
    rows.append({"bench": "train_step", "input": f"36x{H}x{W}", "batch": b, "dtype": str(dtype).removeprefix("torch."),
                 "mask": "blobs (~1/4 of the map)", **{k: round(v, 3) if isinstance(v, float) else v
                                                      for k, v in ms.items()},
                 "best_dense_ms": round(best, 3),
                 **{k.replace("_ms", "_over_dense"): round(v / best, 3) for k, v in ms.items()
                    if k.startswith("sparse") and isinstance(v, float)}})


def count_calls(fn, dev: torch.device) -> dict:  # noqa: ANN001
    """Kernels and host syncs of one call of ``fn`` (after a warm-up call)."""
    fn()
    _sync(dev)
    syncs = 0
    if dev.type == "cuda":
        torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
            with profile(activities=acts) as prof:
                fn()
                _sync(dev)
        syncs = sum("synchroniz" in str(w.message) for w in caught)
    finally:
        if dev.type == "cuda":
            torch.cuda.set_sync_debug_mode(0)
    kernels = sum(1 for e in prof.events() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
    return {"kernels": kernels, "host_syncs": syncs}


def bench_profile(args: dict, dev: torch.device, dtype: torch.dtype, rows: list) -> None:
    from detector.nn import capacity as cp
    from detector.nn.graphs import CapturedBackbone

    tiny = args["tiny"] == "true"
    net, (H, W) = _backbone(dev, dtype, tiny)
    x = torch.randn(1, 36, H, W, device=dev, dtype=dtype)
    mask = blob_mask(1, H, W, 0, dev).to(dtype)
    run = CapturedBackbone(net)
    with torch.no_grad():
        modes, caps = cp.plan_capacities(net, x, mask)
        cases = {"dense": lambda: net(x), "sparse eager, tile 16": lambda: net(x, mask),
                 "capacity eager (in the stages)": lambda: cp.forward_capacity(net, x, mask, modes, caps),
                 "capacity captured (fixed buckets, replay)": lambda: run.forward(x, mask, modes, caps),
                 "capacity captured (plan read + replay + overflow read)": lambda: run(x, mask)}
        for name, fn in cases.items():
            rows.append({"bench": "profile", "run": name, "dtype": str(dtype).removeprefix("torch."),
                         **count_calls(fn, dev)})


def markdown(rows: list[dict]) -> str:
    out = ["# Sync-free, fused, captured sparse path on the GPU (detector/bench/gpu_units.py)", ""]
    for bench in ("units", "backbone", "train_step", "profile", "errors"):
        sel = [r for r in rows if r["bench"] == bench]
        if not sel:
            continue
        keys = [k for k in sel[0] if k != "bench"]
        out += [f"## {bench}", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        out += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in sel]
        out.append("")
    return "\n".join(out)


def _write(args: dict, rows: list[dict]) -> str:
    if args["out"]:
        Path(args["out"]).write_text(json.dumps(rows, indent=1) + "\n")
    md = markdown(rows)
    if args["md"]:
        Path(args["md"]).write_text(md + "\n")
    return md


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    dev = torch.device(args["device"])
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: device=cuda but no CUDA device here (device=cpu runs the smoke test)")
    if dev.type != "cuda":
        args["tiny"] = "true"
    rows: list[dict] = []
    whats = args["what"].split(",")
    for name in args["dtype"].split(","):
        dtype = getattr(torch, name)
        for what, fn in (("units", bench_units), ("backbone", bench_backbone), ("train", bench_train),
                         ("profile", bench_profile)):
            if what in whats:
                t0 = time.perf_counter()
                try:
                    fn(args, dev, dtype, rows)
                except Exception as e:  # a failed section is a row that says why; the others still run
                    if dev.type != "cuda":
                        raise  # the CPU smoke test must see it
                    rows.append({"bench": "errors", "section": what, "dtype": name,
                                 "error": _why(e)})
                print(f"gpu_units: {what} [{name}] {time.perf_counter() - t0:.0f} s", flush=True)
                _write(args, rows)  # after every section: a run cut short by its time limit keeps what it measured
    md = _write(args, rows)
    print(md)
    return 1 if any(r["bench"] == "errors" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
