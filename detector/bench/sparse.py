"""Sparse-block benchmark: dense vs sparse, a 3x3 convolution and a bottleneck residual unit, on CPU.

    python scripts/bench_sparse.py [quick=false] [out=benchmarks/sparse_cpu.json] [md=] [batch=1]
        [stages=1,2,3,4] [sparsity=0.5,0.75,0.9,0.95,0.99] [blocks=8,16,32] [layers=conv3x3,bottleneck]
        [passes=fwd,fwd+bwd] [reps=3] [threads=1] [layout=nhwc] [spconv=true] [device=cpu] [dtype=float32]

Layers, at the four stage sizes of SBNet's LiDAR backbone on our KITTI BEV grid (PIXOR layout, input
800 x 704, stage outputs at strides 2..16 with 96/192/256/384 channels; see detector.nn.resnet):

    stage 1: 400 x 352 x  96    stage 2: 200 x 176 x 192    stage 3: 100 x 88 x 256    stage 4: 50 x 44 x 384

- ``conv3x3``: one 3x3 conv-BN-ReLU C -> C (a one-conv SparseConvChain vs its dense twin);
- ``bottleneck``: one post-activation bottleneck unit C -> C/4 -> C/4 -> C with identity shortcut
  (SparseResidualUnit vs its dense twin, same weights).

Maps are channels-last (``layout=nhwc``, default) for dense and sparse alike: oneDNN's dense convolution
is fastest that way on this CPU, and the compiled ops gather/scatter NHWC block rows natively;
``layout=nchw`` runs both on NCHW maps. ``device=cuda`` / ``dtype=bfloat16`` run on a GPU / in bf16
(``make gpu-check``); times are then taken after ``torch.cuda.synchronize()``.

Masks: at each block size, a random ``(1 - sparsity)`` fraction of the layer's output tiles is active
(at least one): the mask has one pixel at each chosen tile's centre, so ``reduce_mask`` returns exactly
those blocks. The sparse time is the whole layer call with the mask (reduce_mask, gather, convolutions,
BN/ReLU, scatter). ``fwd``: eval mode under ``torch.no_grad()`` (BN folded into the convolutions on both
sides); ``speedup`` is the layer's normal path, a unit whose caller keeps its input (it writes a copy);
``sparse_inplace_ms`` / ``speedup_inplace`` give the path the backbone takes for the stage's own
intermediates (the unit writes into its input; in ``fwd+bwd`` too, on a non-leaf input made before the
timer starts). ``fwd+bwd``: training mode (batch statistics), forward and backward of a fixed output
gradient, input gradient included. Every time is the best of ``reps`` after a warm-up
(the median is recorded too). Each row reports the best block size; ``speedup`` = dense / sparse at that
block size, ``ideal`` = 1 / (1 - actual block sparsity), ``auto_speedup`` = dense / min(dense, sparse)
(what ``block_size="auto"`` may reach by choosing dense). Time shares of the sparse path's phases
(reduce_mask, gather incl. the channels-last copy, conv = everything computed on the blocks, scatter)
are timed phase by phase at that block size, with their backward in ``fwd+bwd`` rows.

Threads: 1 by default (``threads=0``: torch's default). On a shared 2-core machine two OpenMP threads
stall in every parallel region whenever the other core is busy; the sparse path, with many small
operations, suffers most, and the numbers stop meaning anything. One thread gives repeatable ratios.

The allocator matters on this machine: large fresh allocations pay page faults, and glibc's
``MALLOC_MMAP_MAX_=0`` (exported by the Makefile) keeps them on the heap. Dense and sparse always run
in the same process under the same setting; the setting is printed and recorded in every row.
Optional: ``spconv`` (``pip install spconv``, not a project dependency): a SubMConv2d on the same active
pixels, when it imports. ``quick=true``: stages 1 and 4, 50 % and 90 %, block 16, two reps, dense
timed only in the layout the full runs found faster (NHWC forward, NCHW forward+backward): < 1 min.
Writes JSON (a list of rows) to ``out`` and a markdown table to ``md`` (default: ``out`` with ``.md``).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from detector.cli import parse_args
from detector.machine import allocator_env, cpu_model
from detector.nn.block_pass import BlockPass
from detector.nn.chain import SparseConvChain, zeros_in_layout
from detector.nn.geometry import BlockSpan, level_masks
from detector.nn.resnet import SparseResidualUnit
from detector.ops import reduce_mask, sparse_gather, sparse_scatter, sparse_scatter_

USAGE = __doc__
DEFAULTS = {
    "quick": False,
    "out": "benchmarks/sparse_cpu.json",
    "md": "",
    "batch": 1,
    "stages": "1,2,3,4",
    "sparsity": "0.5,0.75,0.9,0.95,0.99",
    "blocks": "8,16,32",
    "layers": "conv3x3,bottleneck",
    "passes": "fwd,fwd+bwd",
    "reps": 3,
    "threads": 1,
    "layout": "nhwc",
    "spconv": True,
    "device": "cpu",
    "dtype": "float32",
}
STAGES = {1: (400, 352, 96), 2: (200, 176, 192), 3: (100, 88, 256), 4: (50, 44, 384)}
PHASES = ("reduce_mask", "gather", "conv", "scatter")


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed(fn: Callable[..., object], reps: int, setup: Callable[[], object] | None = None) -> tuple[float, float]:
    """(best, median) milliseconds of ``reps`` calls after one warm-up call; ``setup()`` (untimed) makes
    each call's argument."""
    arg = () if setup is None else (setup(),)
    fn(*arg)
    ts = []
    for _ in range(reps):
        arg = () if setup is None else (setup(),)
        _sync()
        t0 = time.perf_counter()
        fn(*arg)
        _sync()
        ts.append((time.perf_counter() - t0) * 1e3)
    return min(ts), statistics.median(ts)


def make_layer(layer: str, C: int, block: int) -> torch.nn.Module:
    torch.manual_seed(0)
    if layer == "conv3x3":
        unit = SparseConvChain(C, (C,), (3,), (1,), shortcut="none", block_size=block, name="conv3x3")
    else:
        unit = SparseResidualUnit(C, C, bottleneck=True, block_size=block)
    with torch.no_grad():  # realistic BN statistics: not the identity
        for bn in unit.slots:
            bn.running_mean.uniform_(-0.1, 0.1)
            bn.running_var.uniform_(0.5, 1.5)
    return unit


def block_params(m: SparseConvChain, H: int, W: int):
    return m.geometry(H, W).block


def random_tile_mask(bp, N: int, sparsity: float, seed: int) -> tuple[torch.Tensor, int]:
    """A mask with one pixel at the centre of a random (1 - sparsity) share of the output tiles."""
    total = N * bp.num_blocks
    k = max(1, round((1.0 - sparsity) * total))
    g = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(total, generator=g)[:k]
    n, rest = chosen // bp.num_blocks, chosen % bp.num_blocks
    by, bx = rest // bp.bcount_w, rest % bp.bcount_w
    s = bp.stride_h
    cy = (by * bp.obsize_h * s + bp.obsize_h * s // 2).clamp(max=bp.in_h - 1)
    cx = (bx * bp.obsize_w * s + bp.obsize_w * s // 2).clamp(max=bp.in_w - 1)
    mask = torch.zeros(N, 1, bp.in_h, bp.in_w)
    mask[n, 0, cy, cx] = 1.0
    return mask, k


def sparse_phases(m, x, mask, bp, backward: bool, reps: int) -> dict[str, float]:
    """Best-of-reps milliseconds of each phase of the sparse path (with its backward if asked)."""
    idx = reduce_mask(mask, bp, tol=m.tol)
    out: dict[str, float] = {"reduce_mask": timed(lambda: reduce_mask(mask, bp, tol=m.tol), reps)[0]}
    geo = m.geometry(x.shape[2], x.shape[3])
    span = BlockSpan.of(idx)
    masks = [level_masks(idx, lv, span) for lv in geo.levels]
    identity = m.shortcut == "identity"
    post = identity and not m.preact  # relu(x + tile) done by the scatter

    def gather(x_):
        return sparse_gather(x_, idx, bp)

    def compute(xb):
        return BlockPass(m, geo, masks, [None] * len(m.slots), collect=False).run(xb, skip_identity=post)[0]

    with torch.no_grad():
        xb = gather(x)
        tiles = compute(xb)
    base_shape = (x.shape[0], tiles.shape[1], bp.out_h, bp.out_w)

    def scatter(t, base):  # the unit's normal path: into a copy of its input, or into fresh zeros
        if identity:
            return sparse_scatter(t, idx, base, bp, add=True, relu=post)
        return sparse_scatter_(t, idx, zeros_in_layout(x, base_shape), bp, add=False)

    if not backward:
        with torch.no_grad():
            out["gather"] = timed(lambda: gather(x), reps)[0]
            out["conv"] = timed(lambda: compute(xb), reps)[0]
            out["scatter"] = timed(lambda: scatter(tiles, x), reps)[0]
        return out
    gb, gt = torch.randn_like(xb), torch.randn_like(tiles)
    go = zeros_in_layout(x, base_shape).normal_()

    def gather_fb():
        xr = x.detach().requires_grad_(True)
        gather(xr).backward(gb)

    def compute_fb():
        xr = xb.detach().requires_grad_(True)
        compute(xr).backward(gt)

    def scatter_fb():
        tr = tiles.detach().requires_grad_(True)
        scatter(tr, x.detach().requires_grad_(identity)).backward(go)

    out["gather"] = timed(gather_fb, reps)[0]
    out["conv"] = timed(compute_fb, reps)[0]
    out["scatter"] = timed(scatter_fb, reps)[0]
    return out


def spconv_time(x, mask_tiles, C, reps) -> tuple[float, float] | None:
    """SubMConv2d (spconv, CPU) on the active tiles' pixels: (best ms, max abs error); None when spconv
    does not import or run. The error is against SubM semantics computed densely - a 3x3 convolution of
    the masked input with spconv's own weight (layout [out, kh, kw, in]) - read at the active pixels."""
    try:
        import spconv.pytorch as spconv  # optional benchmark dependency
    except Exception:
        return None
    try:
        N, _, H, W = x.shape
        coords = mask_tiles[:, 0].nonzero().int()  # (n, y, x)
        feats = x.permute(0, 2, 3, 1)[
            coords[:, 0].long(), coords[:, 1].long(), coords[:, 2].long()
        ].contiguous()
        conv = spconv.SubMConv2d(C, C, 3, bias=False)
        with torch.no_grad():
            ms = timed(lambda: conv(spconv.SparseConvTensor(feats, coords, [H, W], N)), reps)[0]
            y = conv(spconv.SparseConvTensor(feats, coords, [H, W], N))
            ref = F.conv2d(x * mask_tiles, conv.weight.permute(0, 3, 1, 2).contiguous(), padding=1)
            oc = y.indices.long()
            err = (y.features - ref.permute(0, 2, 3, 1)[oc[:, 0], oc[:, 1], oc[:, 2]]).abs().max().item()
        if err > 1e-3:
            print(
                f"spconv: WARNING output differs from a 3x3 convolution by up to {err:.3g}", file=sys.stderr
            )
        return ms, err
    except Exception as exc:  # CPU builds may lack kernels: report, do not fail the benchmark
        print(f"spconv: skipped ({type(exc).__name__}: {exc})", file=sys.stderr)
        return None


def tile_pixels(bp, idx: torch.Tensor, N: int) -> torch.Tensor:
    grid = torch.zeros(N, bp.bcount_h, bp.bcount_w)
    i = idx.long()
    grid[i[:, 0], i[:, 1], i[:, 2]] = 1
    m = grid.repeat_interleave(bp.obsize_h, 1).repeat_interleave(bp.obsize_w, 2)
    return m[:, None, : bp.out_h, : bp.out_w]


def environment() -> dict[str, object]:
    cpu = cpu_model()
    return {
        "allocator": allocator_env(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cpu": cpu,
        "python": platform.python_version(),
    }


def run(args: dict) -> list[dict]:
    quick = args["quick"]
    stages = [1, 4] if quick else [int(s) for s in args["stages"].split(",")]
    sparsities = [0.5, 0.9] if quick else [float(s) for s in args["sparsity"].split(",")]
    blocks = [16] if quick else [int(b) for b in args["blocks"].split(",")]
    reps = 2 if quick else args["reps"]
    layers = args["layers"].split(",")
    passes = args["passes"].split(",")
    N = args["batch"]
    device, dtype = torch.device(args["device"]), getattr(torch, args["dtype"])
    env = environment()
    env["device"], env["dtype"] = str(device), args["dtype"]
    load0 = os.getloadavg()[0]
    print(
        f"allocator {env['allocator']} | sparse maps {args['layout']}"
        f" | threads {env['threads']} | torch {env['torch']} | {env['cpu']} | load {load0:.2f}",
        flush=True,
    )
    from detector.ops import _library

    if not _library.has_kernels(device.type):
        print(
            f"WARNING: compiled sbnet kernels unavailable ({_library.unavailable_reason(device.type)}); "
            "timing the pure-PyTorch reference",
            flush=True,
        )
    print(" ".join(HEADER), flush=True)
    rows = []
    for stage in stages:
        H, W, C = STAGES[stage]
        torch.manual_seed(stage)
        x_nchw = torch.randn(N, C, H, W).to(device, dtype)
        g_nchw = torch.randn(N, C, H, W).to(device, dtype)
        maps = {
            "nchw": (x_nchw, g_nchw),
            "nhwc": tuple(t.contiguous(memory_format=torch.channels_last) for t in (x_nchw, g_nchw)),
        }
        x, g = maps[args["layout"]]
        for layer in layers:
            for pas in passes:
                backward = pas == "fwd+bwd"
                m = make_layer(layer, C, blocks[0]).to(device, dtype).train(backward)

                def call(x_, g_, m=m, backward=backward, **kw):
                    if not backward:
                        with torch.no_grad():
                            return m(x_, **kw)
                    for p in m.parameters():
                        p.grad = None
                    xr = x_.detach().requires_grad_(True)
                    y = m(xr, **kw)
                    y.backward(g_)
                    return y

                # the dense twin in both layouts, its best is the baseline (quick: only the layout that
                # the full runs found faster on this CPU - NHWC forward, NCHW forward+backward)
                layouts = [("nchw" if backward else "nhwc")] if quick else list(maps)
                dense = {lay: timed(lambda xg=maps[lay], call=call: call(*xg), reps) for lay in layouts}
                dense_layout = min(dense, key=lambda k: dense[k][0])
                dense_ms, dense_med = dense[dense_layout]
                for sp in sparsities:
                    best = None
                    per_block = {}
                    for b in blocks:
                        m.block_size = b
                        bp = block_params(m, H, W)
                        mask, k = random_tile_mask(bp, N, sp, seed=1000 * stage + b)
                        mask = mask.to(device, dtype)
                        assert reduce_mask(mask, bp, tol=m.tol).shape[0] == k
                        ms, med = timed(lambda call=call, mask=mask, x=x, g=g: call(x, g, mask=mask), reps)
                        per_block[b] = ms
                        if best is None or ms < best[1]:
                            best = (b, ms, med, mask, k, bp)
                    b, sparse_ms, sparse_med, mask, k, bp = best
                    m.block_size = b
                    actual = 1.0 - k / (N * bp.num_blocks)
                    phases = sparse_phases(m, x, mask, bp, backward, reps)
                    total = sum(phases.values())
                    row = {
                        "layer": layer,
                        "stage": stage,
                        "H": H,
                        "W": W,
                        "C": C,
                        "sparsity": sp,
                        "pass": pas,
                        "batch": N,
                        "dense_ms": round(dense_ms, 3),
                        "sparse_ms": round(sparse_ms, 3),
                        "speedup": round(dense_ms / sparse_ms, 3),
                        "ideal": round(1.0 / (1.0 - actual), 3),
                        # the physical bound: the active tiles' blocks, halo included, at the dense rate
                        "bound": round(
                            (bp.obsize_h * bp.obsize_w) / ((1.0 - actual) * bp.bsize_h * bp.bsize_w), 3
                        ),
                        "auto_speedup": round(dense_ms / min(dense_ms, sparse_ms), 3),
                        "block_size": b,
                        "blocks_active": k,
                        "blocks_total": N * bp.num_blocks,
                        "actual_sparsity": round(actual, 4),
                        "sparse_ms_by_block": {str(kk): round(v, 3) for kk, v in per_block.items()},
                        "dense_layout": dense_layout,
                        **{f"dense_ms_{lay}": round(v[0], 3) for lay, v in dense.items()},
                        "sparse_layout": args["layout"],
                        "dense_ms_median": round(dense_med, 3),
                        "sparse_ms_median": round(sparse_med, 3),
                        "phase_ms": {p: round(phases[p], 3) for p in PHASES},
                        "shares": {p: round(phases[p] / total, 3) for p in PHASES},
                        **env,
                    }
                    if layer == "bottleneck":  # the unit writing into its own input (an intermediate it owns)
                        if backward:

                            def owned(x=x):
                                xr = x.detach().requires_grad_(True)
                                return xr * 1.0  # a non-leaf, as a stage's intermediate is

                            def step(xo, m=m, mask=mask, g=g):
                                for p in m.parameters():
                                    p.grad = None
                                m(xo, mask=mask, inplace=True).backward(g)
                        else:

                            def owned(x=x):
                                return x.clone()

                            def step(xo, m=m, mask=mask):
                                with torch.no_grad():
                                    m(xo, mask=mask, inplace=True)

                        ms = timed(step, reps, setup=owned)[0]
                        row["sparse_inplace_ms"] = round(ms, 3)
                        row["speedup_inplace"] = round(dense_ms / ms, 3)
                    if layer == "conv3x3" and not backward and args["spconv"] and device.type == "cpu":
                        t = spconv_time(x, tile_pixels(bp, reduce_mask(mask, bp), N), C, reps)
                        if t is not None:
                            row["spconv_subm_ms"], row["spconv_max_abs_err"] = round(t[0], 3), t[1]
                    rows.append(row)
                    print(fmt_row(row), flush=True)
    load1 = os.getloadavg()[0]
    for r in rows:
        r["load_avg_start"], r["load_avg_end"] = round(load0, 2), round(load1, 2)
    return rows


HEADER = (
    "layer",
    "stage",
    "H x W x C",
    "sparsity",
    "pass",
    "block",
    "dense ms",
    "sparse ms",
    "speedup",
    "in-place",
    "ideal",
    "bound",
    "auto",
    "reduce/gather/conv/scatter %",
)


_SUFFIX = {"nchw": "c", "nhwc": "h"}


def _inplace(r: dict) -> str:
    return f"{r['speedup_inplace']:.2f}x" if "speedup_inplace" in r else "-"


def fmt_row(r: dict) -> str:
    sh = "/".join(f"{100 * r['shares'][p]:.0f}" for p in PHASES)
    return (
        f"{r['layer']:10s} {r['stage']:1d} {r['H']:3d}x{r['W']:3d}x{r['C']:3d} {r['sparsity']:5.2f} "
        f"{r['pass']:7s} {r['block_size']:3d} {r['dense_ms']:9.1f}{_SUFFIX[r['dense_layout']]} "
        f"{r['sparse_ms']:9.1f} "
        f"{r['speedup']:6.2f}x {_inplace(r):>7s} {r['ideal']:6.1f}x {r['bound']:6.1f}x {r['auto_speedup']:6.2f}x  {sh}"
    )


def markdown(rows: list[dict], command: str) -> str:
    r0 = rows[0]
    lines = [
        f"# Sparse-block benchmark ({r0.get('device', 'cpu')}, {r0.get('dtype', 'float32')})",
        "",
        f"Command: `{command}`",
        "",
        f"CPU: {r0['cpu']}; torch {r0['torch']}, {r0['threads']} threads; "
        f"allocator {r0['allocator']} "
        f"(dense and sparse under the same setting, same process); batch {r0['batch']}; "
        f"load average {r0['load_avg_start']} at start, {r0['load_avg_end']} at end (shared machine).",
        "",
        f"Sparse maps {r0['sparse_layout']}; dense timed on NCHW and NHWC maps, the faster one is the "
        "baseline (`dense ms` suffix: c = NCHW, h = NHWC). Best of the repetitions; "
        "`speedup` = dense / sparse at the best block size (the unit writes a copy of its input: its "
        "caller keeps it); `in-place` = the unit writing into its input, as the backbone's stages do for "
        "their own intermediates (bottleneck; fwd+bwd on a non-leaf input made before the timer); "
        "`bound` = the physical bound: dense / (active tiles x (tile + halo)^2 / tile^2); "
        "`ideal` = 1 / (1 - actual block sparsity); `auto` = dense / min(dense, sparse) "
        "(block_size='auto' may choose dense). Shares: phases of the sparse path timed separately "
        "(with backward in fwd+bwd rows). fwd = eval mode, no grad; fwd+bwd = training mode. "
        "Generated by scripts/bench_sparse.py.",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
    ]
    for r in rows:
        sh = " / ".join(f"{100 * r['shares'][p]:.0f}" for p in PHASES)
        lines.append(
            f"| {r['layer']} | {r['stage']} | {r['H']}x{r['W']}x{r['C']} | {r['sparsity']:.2f} | "
            f"{r['pass']} | {r['block_size']} | {r['dense_ms']:.1f} {_SUFFIX[r['dense_layout']]} | "
            f"{r['sparse_ms']:.1f} | {r['speedup']:.2f}x | {_inplace(r)} | "
            f"{r['ideal']:.1f}x | {r['bound']:.1f}x | {r['auto_speedup']:.2f}x | {sh} |"
        )
    sp = [r for r in rows if "spconv_subm_ms" in r]
    if sp:
        lines += [
            "",
            "spconv SubMConv2d (CPU) on the same active pixels; `max abs err` is against a dense 3x3 "
            "convolution of the masked input with spconv's weight at those pixels (SubM semantics): a "
            "large error means spconv's CPU output is not that convolution, so its time is no comparison.",
            "",
            "| conv3x3 stage | sparsity | sparse ms | spconv SubMConv2d ms | spconv max abs err |",
            "|---|---|---|---|---|",
        ]
        for r in sp:
            lines.append(
                f"| {r['stage']} | {r['sparsity']:.2f} | {r['sparse_ms']:.1f} | {r['spconv_subm_ms']} | "
                f"{r['spconv_max_abs_err']:.3g} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv, DEFAULTS, USAGE)
    if args["threads"] > 0:
        torch.set_num_threads(args["threads"])
    rows = run(args)
    out = Path(args["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1) + "\n")
    md = Path(args["md"]) if args["md"] else out.with_suffix(".md")
    command = "python scripts/bench_sparse.py " + " ".join(sys.argv[1:] if argv is None else argv)
    md.write_text(markdown(rows, command.strip()))
    print(f"wrote {out} and {md}")
