"""Where the sparse detector's time goes on a GPU: timed runs and torch.profiler tables, one markdown file.

    python3 scripts/profile_gpu.py [out=build/gpu_check/profile_gpu.md] [device=cuda] [reps=20]

For `make gpu-check` (scripts/gpu_check.py runs it on the device machine). Models are built from the real
configs with random weights; the mask is a fixed set of car-sized blobs (about a quarter of the map, the
road-map/predicted masks' share at bev=kitti), given as the batch's mask so that no mask network runs:

- ``kitti``: ``experiment=kitti_full bev=kitti`` (PIXOR's grid and backbone), inference at batch 1 - dense, the
  sparse model at a fixed tile of 16, and with the default plan (``block_size=auto``);
- ``train``: the default config (``make train``'s model, bev=small) - a training step (forward, loss-free sum,
  backward) at batch 4, dense and sparse with the plan.

Per row: median ms over ``reps`` runs (synchronized), kernels launched and host-device synchronizations
(``cudaStreamSynchronize``/``cudaDeviceSynchronize``/blocking ``cudaMemcpy*``) per run, and the top operators by
self device time and by self host time of one profiled run. On a machine without CUDA it runs on the CPU
(``device=cpu``: the same tables without device columns), which the tests use.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from detector.cli import parse_args

REPO = Path(__file__).resolve().parents[2]

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaMemcpyAsync", "cudaEventSynchronize")


def build(overrides: list[str], device: str):
    from hydra import compose, initialize_config_dir

    from detector.build import build_grid, build_model

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        cfg = compose("train", overrides=overrides)
    grid = build_grid(cfg.bev)
    model = build_model(cfg.model, cfg.mask, grid)
    model.mask_net = None  # the batch's mask (below) instead of a predicted one: no mask network runs
    return model.to(device), grid


def blob_mask(n: int, h: int, w: int, device: str) -> torch.Tensor:
    """Car-sized blobs (40 x 90 cells at bev=kitti, scaled with the grid), about a quarter of the map."""
    mask = torch.zeros(n, 1, h, w)
    g = torch.Generator().manual_seed(1)
    bh, bw = max(2, h // 20), max(4, w // 8)
    for i in range(n):
        for _ in range(40):
            y = int(torch.randint(0, h - bh, (1,), generator=g))
            x = int(torch.randint(0, w - bw, (1,), generator=g))
            mask[i, :, y : y + bh, x : x + bw] = 1
    return mask.to(device)


class _Batch:
    def __init__(self, mask):
        self.mask = mask


def _run(model, bev, mask, train: bool):
    out = model(_Batch(mask), bev=bev)
    if train:
        (out.heatmap.float().sum() + out.regression.float().sum()).backward()
    return out


def measure(label: str, model, bev, mask, train: bool, reps: int, device: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model.train(train)
    with torch.set_grad_enabled(train):
        for _ in range(3):  # warm-up: kernels, cuDNN algorithms, the plan's cost model
            _run(model, bev, mask, train)
        sync()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            out = _run(model, bev, mask, train)
            sync()
            times.append(1e3 * (time.perf_counter() - t))
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            _run(model, bev, mask, train)
            sync()
    events = prof.key_averages()
    dev_attr = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel"))
    syncs = sum(e.count for e in events if e.key in SYNC_CALLS)
    plan = getattr(out, "plan", None)
    row = {"label": label, "ms": round(statistics.median(times), 2), "ms_min": round(min(times), 2),
           "kernels": launches, "syncs": syncs,
           "plan": None if plan is None else " ".join(f"{n}:{c}" for n, c in zip(plan.names, plan.choices,
                                                                                   strict=True)),
           "top_device": [], "top_host": []}
    if cuda:
        for e in sorted(events, key=lambda e: -getattr(e, dev_attr))[:12]:
            row["top_device"].append((e.key[:60], e.count, round(getattr(e, dev_attr) / 1e3, 3)))
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]:
        row["top_host"].append((e.key[:60], e.count, round(e.self_cpu_time_total / 1e3, 3)))
    print(f"  {label:<34} {row['ms']:8.2f} ms  kernels {launches:5d}  syncs {syncs:4d}  plan {row['plan']}", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, {"out": str(REPO / "build" / "gpu_check" / "profile_gpu.md"), "device": "cuda",
                             "reps": 20}, __doc__)
    device = args["device"] if args["device"] != "cuda" or torch.cuda.is_available() else "cpu"
    reps = int(args["reps"])
    torch.manual_seed(0)
    name = torch.cuda.get_device_name(0) if device == "cuda" else "CPU"
    print(f"profile_gpu: {name}, torch {torch.__version__}, reps {reps}", flush=True)
    rows = []
    cases = [
        ("kitti", ["experiment=kitti_full", "bev=kitti"], 1, False),
        ("train", [], 4, True),
    ]
    for case, base, n, train in cases:
        dense, grid = build([*base, "model.block_size=dense", "model.head_block_size=dense"], device)
        bev = torch.rand(n, grid.C, grid.H, grid.W, device=device)
        mask = blob_mask(n, grid.H, grid.W, device)
        rows.append(measure(f"{case} dense (no mask)", dense, bev, None, train, reps, device))
        del dense
        settings = [("16", "16"), ("auto", "auto")] if case == "kitti" else [("auto", "auto")]
        for bs, hbs in settings:
            model, _ = build([*base, f"model.block_size={bs}", f"model.head_block_size={hbs}"], device)
            rows.append(measure(f"{case} sparse block_size={bs}", model, bev, mask, train, reps, device))
            del model
        rows[-1]["mask_share"] = round(float(mask.mean()), 3)
    md = [f"# Sparse detector profile on {name} (torch {torch.__version__})", "",
          "`python3 scripts/profile_gpu.py` (run by `make gpu-check`): random weights, a fixed blob mask (about a "
          "quarter of the map) as the batch's mask; median of the timed runs, synchronized.", "",
          "| run | ms (median) | ms (min) | kernels / run | host syncs / run | plan |", "|---|---|---|---|---|---|"]
    md += [f"| {r['label']} | {r['ms']} | {r['ms_min']} | {r['kernels']} | {r['syncs']} | {r['plan'] or '-'} |"
           for r in rows]
    for r in rows:
        md += ["", f"## {r['label']}", ""]
        if r["top_device"]:
            md += ["Top operators by self device time (ms, one run):", "", "| op | calls | ms |", "|---|---|---|"]
            md += [f"| `{k}` | {c} | {t} |" for k, c, t in r["top_device"]]
            md.append("")
        md += ["Top operators by self host time (ms, one run):", "", "| op | calls | ms |", "|---|---|---|"]
        md += [f"| `{k}` | {c} | {t} |" for k, c, t in r["top_host"]]
    out = Path(args["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(md) + "\n")
    print(f"wrote {out}")
    return 0
