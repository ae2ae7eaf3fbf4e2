"""Micro-benchmark of the sbnet CPU kernels against naive pure-PyTorch versions (one run, ratios).

    MALLOC_MMAP_MAX_=0 .venv/bin/python scripts/bench_ops.py [out=benchmarks/ops_cpu.json] [reps=10]
                                                             [size=2,32,400,352]

(MALLOC_MMAP_MAX_=0, as the Makefile sets, keeps large buffers on the heap instead of fresh mmaps
whose page faults would dominate every allocation-heavy variant.)

For each fraction of randomly chosen active blocks it times, on one BEV-sized feature map:
- gather:  kernel  vs  naive "pad the whole tensor, then advanced-index the blocks";
- scatter: kernel (one copy of base, tiles written)  vs  naive "zero output of the padded grid size,
  index_put the tiles, crop, add to base";
- backward of gather (kernel's phase-ordered adjoint vs autograd through the naive gather);
- on the same map stored channels-last (NHWC), the kernels against the torch index ops they replace (what
  the layers ran before the kernels read NHWC: ``index_select`` of the blocks' pixel rows with an
  ``index_fill`` of the out-of-map ones; the residual scatter ``relu(x + tile)`` as a copy of ``x`` plus
  ``index_select``/``add``/``relu``/``index_copy``; the adjoint as ``index_add`` into zeros).
- batch norm over tile regions (``region_bn_nhwc``: forward + backward of ``detector.nn.norm.region_batch_norm`` on
  the gathered blocks of that map, 24 channels, the 8-px tiles with 1-px halos of make train's stem and stage 1):
  the kernels ``region_sums`` / ``region_norm_grad`` against the composition of torch ops it ran before them
  (region rows copied, two-pass moments, the gradient's sums and corrections as separate passes).
Prints a table (median milliseconds and naive/kernel ratio) and writes it as JSON and markdown.
Timings on a shared machine are noisy: compare ratios within one run.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from detector.cli import parse_args
from detector.machine import allocator_env, cpu_model
from detector.ops import BlockParams, _library, calc_block_params, sparse_gather, sparse_scatter


@dataclass(frozen=True)
class Row:
    op: str
    active_fraction: float
    blocks: int
    kernel_ms: float
    naive_ms: float

    @property
    def speedup(self) -> float:
        return self.naive_ms / self.kernel_ms


def naive_gather(x: torch.Tensor, idx: torch.Tensor, bp: BlockParams) -> torch.Tensor:
    """Pad the whole map (the cost the kernels avoid), then advanced-index every block at once."""
    pad_h = max(0, (bp.bcount_h - 1) * bp.bstride_h + bp.bsize_h + bp.boffset_h - bp.in_h)
    pad_w = max(0, (bp.bcount_w - 1) * bp.bstride_w + bp.bsize_w + bp.boffset_w - bp.in_w)
    xp = F.pad(x, (-bp.boffset_w, pad_w, -bp.boffset_h, pad_h))
    idx = idx.long()
    rows = (idx[:, 1:2] * bp.bstride_h + torch.arange(bp.bsize_h)).view(-1, bp.bsize_h, 1)
    cols = (idx[:, 2:3] * bp.bstride_w + torch.arange(bp.bsize_w)).view(-1, 1, bp.bsize_w)
    blocks = xp.permute(0, 2, 3, 1)[idx[:, 0].view(-1, 1, 1), rows, cols]  # [K, bh, bw, C]
    return blocks.permute(0, 3, 1, 2).contiguous()


def naive_scatter(
    blocks: torch.Tensor, idx: torch.Tensor, base: torch.Tensor, bp: BlockParams
) -> torch.Tensor:
    """Zero output of the whole padded grid, index_put the tiles, crop, add to base (add=True)."""
    N, C = base.shape[:2]
    full = base.new_zeros((N, bp.bcount_h * bp.obsize_h, bp.bcount_w * bp.obsize_w, C))
    idx = idx.long()
    rows = (idx[:, 1:2] * bp.obsize_h + torch.arange(bp.obsize_h)).view(-1, bp.obsize_h, 1)
    cols = (idx[:, 2:3] * bp.obsize_w + torch.arange(bp.obsize_w)).view(-1, 1, bp.obsize_w)
    full[idx[:, 0].view(-1, 1, 1), rows, cols] = blocks.permute(0, 2, 3, 1)
    return base + full[:, : bp.out_h, : bp.out_w].permute(0, 3, 1, 2)


def _pixel_rows(shape, idx: torch.Tensor, start_h, start_w, bh, bw, stride_h, stride_w):
    """NHWC row of every block pixel (clamped into the map) and the rows outside the map (the baseline's
    index math)."""
    _, _, H, W = shape
    n = idx[:, 0].long()
    rows = idx[:, 1].long()[:, None] * stride_h + start_h + torch.arange(bh)
    cols = idx[:, 2].long()[:, None] * stride_w + start_w + torch.arange(bw)
    vr, vc = (rows >= 0) & (rows < H), (cols >= 0) & (cols < W)
    flat = ((n[:, None, None] * H + rows.clamp(0, H - 1)[:, :, None]) * W + cols.clamp(0, W - 1)[:, None, :])
    outside = (~(vr[:, :, None] & vc[:, None, :])).reshape(-1).nonzero().flatten()
    return flat.reshape(-1), outside


def index_gather(x: torch.Tensor, idx: torch.Tensor, bp: BlockParams) -> torch.Tensor:
    N, C, H, W = x.shape
    flat, outside = _pixel_rows(x.shape, idx, bp.boffset_h, bp.boffset_w, bp.bsize_h, bp.bsize_w,
                                bp.bstride_h, bp.bstride_w)
    rows = x.permute(0, 2, 3, 1).reshape(N * H * W, C).index_select(0, flat).index_fill_(0, outside, 0)
    return rows.view(-1, bp.bsize_h, bp.bsize_w, C).permute(0, 3, 1, 2)


def index_residual_scatter(tiles: torch.Tensor, idx: torch.Tensor, x: torch.Tensor, bp: BlockParams) -> torch.Tensor:
    N, C, H, W = x.shape
    flat, outside = _pixel_rows(x.shape, idx, 0, 0, bp.obsize_h, bp.obsize_w, bp.obsize_h, bp.obsize_w)
    keep = torch.ones(flat.numel(), dtype=torch.bool).index_fill_(0, outside, False)
    src = tiles.permute(0, 2, 3, 1).reshape(-1, C)[keep]
    flat = flat[keep]
    out = x.permute(0, 2, 3, 1).reshape(N * H * W, C).clone()
    out.index_copy_(0, flat, out.index_select(0, flat).add_(src).relu_())
    return out.view(N, H, W, C).permute(0, 3, 1, 2)


def index_gather_backward(g: torch.Tensor, idx: torch.Tensor, bp: BlockParams, shape) -> torch.Tensor:
    N, C, H, W = shape
    flat, outside = _pixel_rows(shape, idx, bp.boffset_h, bp.boffset_w, bp.bsize_h, bp.bsize_w,
                                bp.bstride_h, bp.bstride_w)
    rows = g.permute(0, 2, 3, 1).reshape(-1, C).index_fill(0, outside, 0)
    gx = g.new_zeros((N * H * W, C)).index_add_(0, flat, rows)
    return gx.view(N, H, W, C).permute(0, 3, 1, 2)


def bench_nhwc(x: torch.Tensor, bp: BlockParams, frac: float, reps: int, gen: torch.Generator) -> list[Row]:
    """Rows for the NHWC kernels against the torch index ops they replace (values checked first)."""
    x = x.contiguous(memory_format=torch.channels_last)
    N, C, H, W = x.shape
    idx = (torch.rand((N, bp.bcount_h, bp.bcount_w), generator=gen) < frac).nonzero().to(torch.int32)
    K = idx.shape[0]
    tiles = torch.randn((K, C, bp.obsize_h, bp.obsize_w), generator=gen).contiguous(memory_format=torch.channels_last)
    g = torch.randn((K, C, bp.bsize_h, bp.bsize_w), generator=gen).contiguous(memory_format=torch.channels_last)
    lib = torch.ops.sbnet
    st, of = list(bp.bstride), list(bp.boffset)
    assert torch.equal(index_gather(x, idx, bp), sparse_gather(x, idx, bp))
    torch.testing.assert_close(index_residual_scatter(tiles, idx, x, bp),
                               sparse_scatter(tiles, idx, x, bp, add=True, relu=True))
    torch.testing.assert_close(index_gather_backward(g, idx, bp, x.shape),
                               lib.sparse_gather_backward(g, idx, list(x.shape), st, of, True))
    pairs = {
        "gather_nhwc": (lambda: sparse_gather(x, idx, bp), lambda: index_gather(x, idx, bp)),
        "residual_scatter_nhwc": (lambda: sparse_scatter(tiles, idx, x, bp, add=True, relu=True),
                                  lambda: index_residual_scatter(tiles, idx, x, bp)),
        "gather_backward_nhwc": (lambda: lib.sparse_gather_backward(g, idx, list(x.shape), st, of, True),
                                 lambda: index_gather_backward(g, idx, bp, x.shape)),
    }
    return [Row(op, frac, K, *median_ms_pair(kernel, naive, reps)) for op, (kernel, naive) in pairs.items()]


def composed_region_bn(z: torch.Tensor, g: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, off: int,
                       size: int) -> torch.Tensor:
    """Region batch norm's forward and input gradient as the torch ops composed them before the kernels (all the
    region's pixels in the map): returns dz."""
    C, eps, n = z.shape[1], 1e-5, z.shape[0] * size * size
    sl = (slice(None), slice(None), slice(off, off + size), slice(off, off + size))
    rows = z[sl].permute(0, 2, 3, 1).reshape(-1, C)
    mean = rows.sum(0) / n
    d = rows - mean
    inv = torch.rsqrt((d * d).sum(0) / n + eps)
    scale = weight * inv
    torch.addcmul((bias - mean * scale).view(1, C, 1, 1), z, scale.view(1, C, 1, 1))  # y
    g_rows, z_rows = g.permute(0, 2, 3, 1).reshape(-1, C), z.permute(0, 2, 3, 1).reshape(-1, C)
    sum_g = g_rows.sum(0)
    sum_gx = (g_rows * z_rows).sum(0) - mean * sum_g
    dz = g * scale.view(1, C, 1, 1)
    c1 = -scale * inv * inv * sum_gx / n
    c0 = -scale * sum_g / n - mean * c1
    dz[sl].addcmul_(z[sl], c1.view(1, C, 1, 1)).add_(c0.view(1, C, 1, 1))
    return dz


def bench_region_bn(x: torch.Tensor, frac: float, reps: int, gen: torch.Generator) -> Row:
    """Region batch norm (forward + backward) on the blocks of 8-px tiles with 1-px halos gathered from ``x``'s
    first 24 channels (channels-last), against its former torch composition (values checked first)."""
    from torch import nn

    from detector.nn.geometry import Level, LevelMasks
    from detector.nn.norm import region_batch_norm

    x = x[:, :24].contiguous(memory_format=torch.channels_last)
    N, C, H, W = x.shape
    bp = calc_block_params(H, W, bsize=(10, 10), ksize=3, stride=1, padding=1)
    idx = (torch.rand((N, bp.bcount_h, bp.bcount_w), generator=gen) < frac).nonzero().to(torch.int32)
    z = sparse_gather(x, idx, bp)
    K = z.shape[0]
    g = torch.randn(z.shape, generator=gen).contiguous(memory_format=torch.channels_last)
    bn = nn.BatchNorm2d(C)
    level = Level(extent=(10, 10), offset=(1, 1), region=(8, 8), map_size=(H, W))
    masks = LevelMasks(outside=None, region=None, count=K * 64)
    zk = z.detach().requires_grad_()

    def kernel() -> torch.Tensor:
        y, _ = region_batch_norm(bn, zk, level, masks)
        return torch.autograd.grad(y, zk, g)[0]

    w, b = bn.weight.detach(), bn.bias.detach()
    torch.testing.assert_close(kernel(), composed_region_bn(z, g, w, b, 1, 8), rtol=1e-4, atol=1e-5)
    return Row("region_bn_nhwc", frac, K, *median_ms_pair(kernel, lambda: composed_region_bn(z, g, w, b, 1, 8), reps))


def median_ms_pair(kernel, naive, reps: int) -> tuple[float, float]:
    """Median milliseconds of two callables, measured alternately so machine load hits both alike."""
    kernel(), naive()  # warm-up
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(reps):
        for fn, out in ((kernel, times[0]), (naive, times[1])):
            start = time.perf_counter()
            fn()
            out.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[0]), statistics.median(times[1])


def bench_fraction(
    x: torch.Tensor, bp: BlockParams, frac: float, reps: int, gen: torch.Generator
) -> list[Row]:
    """Rows for gather, scatter-add and gather's backward with a random ``frac`` of the blocks active."""
    N, C = x.shape[:2]
    active = torch.rand((N, bp.bcount_h, bp.bcount_w), generator=gen) < frac
    idx = active.nonzero().to(torch.int32)
    K = idx.shape[0]
    assert torch.equal(naive_gather(x, idx, bp), sparse_gather(x, idx, bp))
    blocks = torch.randn((K, C, bp.obsize_h, bp.obsize_w), generator=gen)
    torch.testing.assert_close(naive_scatter(blocks, idx, x, bp), sparse_scatter(blocks, idx, x, bp))
    g = torch.randn((K, C, bp.bsize_h, bp.bsize_w), generator=gen)
    xk, xn = x.clone().requires_grad_(), x.clone().requires_grad_()
    yk, yn = sparse_gather(xk, idx, bp), naive_gather(xn, idx, bp)
    pairs = {
        "gather": (lambda: sparse_gather(x, idx, bp), lambda: naive_gather(x, idx, bp)),
        "scatter_add": (lambda: sparse_scatter(blocks, idx, x, bp),
                        lambda: naive_scatter(blocks, idx, x, bp)),
        "gather_backward": (lambda: torch.autograd.grad(yk, xk, g, retain_graph=True),
                            lambda: torch.autograd.grad(yn, xn, g, retain_graph=True)),
    }
    return [Row(op, frac, K, *median_ms_pair(kernel, naive, reps)) for op, (kernel, naive) in pairs.items()]


def main(argv=None) -> None:
    a = parse_args(argv, {"out": "benchmarks/ops_cpu.json", "reps": 10, "size": "2,32,400,352"}, __doc__)
    size = [int(v) for v in a["size"].split(",")]
    if len(size) != 4:
        raise SystemExit("error: size=N,C,H,W")
    args = SimpleNamespace(out=Path(a["out"]), reps=a["reps"], size=size)
    if not _library.load(verbose=True):
        raise SystemExit(f"sbnet kernels unavailable: {_library.unavailable_reason('cpu')}")

    N, C, H, W = args.size
    bp = calc_block_params(H, W, bsize=(16, 16), ksize=3, stride=1, padding=1)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((N, C, H, W), generator=gen)
    fracs = (0.05, 0.2, 0.5, 1.0)
    rows = [row for frac in fracs for row in bench_fraction(x, bp, frac, args.reps, gen)]
    rows += [row for frac in fracs for row in bench_nhwc(x, bp, frac, args.reps, gen)]
    rows += [bench_region_bn(x, frac, args.reps, gen) for frac in fracs]

    cpu = cpu_model()
    env = allocator_env()
    title = (f"sbnet CPU kernels vs naive torch (NCHW rows) and vs the torch ops they replace (NHWC rows; region_bn: "
             f"forward + backward of batch norm over 8-px tiles' regions, 24 channels), "
             f"x = [{N}, {C}, {H}, {W}] float32, bsize 16, ksize 3, {torch.get_num_threads()} threads, "
             f"median of {args.reps}; {cpu}; allocator {env}")
    print(f"\n{title}")
    print(f"{'op':<16} {'active':>6} {'K':>6} {'kernel ms':>10} {'naive ms':>10} {'naive/kernel':>12}")
    for r in rows:
        print(f"{r.op:<16} {r.active_fraction:>6.2f} {r.blocks:>6d} {r.kernel_ms:>10.3f} {r.naive_ms:>10.3f} "
              f"{r.speedup:>12.2f}")
    table = [f"# {title}", "", "| op | active | K | kernel ms | naive ms | naive/kernel |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    table += [f"| {r.op} | {r.active_fraction:.2f} | {r.blocks} | {r.kernel_ms:.3f} | {r.naive_ms:.3f} "
              f"| {r.speedup:.2f} |" for r in rows]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "size": [N, C, H, W], "threads": torch.get_num_threads(), "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(), "cpu": cpu, "allocator": env, "reps": args.reps,
        "rows": [dict(asdict(r), speedup=r.speedup) for r in rows],
    }, indent=2) + "\n")
    args.out.with_suffix(".md").write_text("\n".join(table) + "\n")
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
