"""The fused sparse-block convolution: gather + convolution + folded batch norm + ReLU, and the last
convolution + residual + ReLU + scatter, on a :class:`~detector.ops.capacity.BlockList` (no host sync).

    a  = conv_blocks(x, blist, w0, b0, stride=s, origin=((R, R), (P, P)), extent=e0, relu=True, zero=level1)
    a  = conv_blocks(a, blist, w1, b1, stride=1, relu=True, zero=level2)          # blocks in, blocks out
    y  = conv_scatter(a, blist, w2, b2, out=x, tile=T, residual="map", relu=True)  # written into x's tiles

Semantics, per row ``k`` of the list with ``k < count`` (padding rows: blocks out unspecified, the map
untouched):

    conv_blocks:  src_k = x[n, :, by*R_h - P_h : ... + e_h, bx*R_w - P_w : ... + e_w]   (0 outside the map)
                          (or the source blocks[k] when ``origin`` is None)
                  src_k = relu(src_k * pre_s + pre_t), 0 outside the map               (``pre`` given)
                  out[k] = conv2d(src_k, weight, bias, stride)   (VALID)
                  out[k] = relu(out[k]) (``relu``); pixels outside ``zero``'s map = 0  (``zero`` given)
    conv_scatter: t = conv2d(blocks[k], weight, bias) (+ out's tile (``residual="map"``) or residual[k]);
                  out[n, :, by*T_h : ... + T_h, bx*T_w : ... + T_w] = relu?(t)      (clipped to the map)

One op, two paths by device: on CUDA with triton, the kernel of :mod:`detector.ops.triton_blocks` (one launch
each, the gather and the scatter fused in; padding rows skipped by the device-side count) once it has passed
:func:`self_check` on that device and dtype and the whole network's first batch has matched the composition
(:func:`whole_check`; else, with a warning, the composition); elsewhere (the CPU:
its oneDNN convolutions and the compiled gather/scatter kernels stay the CPU path) the composition of
``sparse_gather``, ``F.conv2d`` and :func:`~detector.ops.capacity.scatter_padded`. Backward: the composition's
autograd on the CPU; on the kernel's path both ops have a fused backward (two kernels: the transposed convolution
into the source window - scatter-added into a map source by the gather's backward - and the weight's gradient,
summed in deterministic runs of rows), except :func:`conv_blocks` with a ``pre`` affine, which recomputes the
composition and takes its backward.
``DETECTOR_FUSED=triton`` forces the kernel on any device (with ``TRITON_INTERPRET=1``: on the CPU, the tests),
``DETECTOR_FUSED=torch`` the composition.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.nn.functional as F

from . import triton_blocks
from .capacity import BlockList, gather_tiles, gather_windows, level_valid, list_memo, scatter_padded, uses_buckets
from .formulas import memory_format_of
from .functional import _kernels_for

__all__ = ["conv_blocks", "conv_scatter", "fused_backend", "self_check", "whole_check"]

Origin = tuple[tuple[int, int], tuple[int, int]]
Zero = tuple[tuple[int, int], tuple[int, int], tuple[int, int]]


def fused_backend(device: torch.device, dtype: torch.dtype = torch.float32) -> str:
    """'triton' (CUDA with triton whose kernels pass :func:`self_check` for this device and dtype, or forced by
    ``DETECTOR_FUSED=triton`` unless a check found them wrong there) or 'torch' (the composition)."""
    forced = _FORCE or os.environ.get("DETECTOR_FUSED", "")
    device = torch.device(device)
    if forced in ("triton", "torch"):  # forced: still off where a check found the kernels wrong
        ok = forced == "triton" and triton_blocks.available() and _CHECKED.get((str(device), dtype), True)
        return "triton" if ok else "torch"
    if device.type != "cuda" or not triton_blocks.available():
        return "torch"
    return "triton" if self_check(device, dtype) else "torch"


_CHECKED: dict[tuple[str, torch.dtype], bool] = {}


def self_check(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the Triton kernels give the composition's values on ``device`` in ``dtype``, forward and backward,
    on a small random case at the map's border with padding rows: run once per device and dtype (a second or so of
    compiling), remembered. A kernel that raises or differs is not used: the path falls back to the composition,
    with one warning naming the failure (so a GPU or triton version the kernels were never run on costs speed, not
    a training run). Inside a trace or a graph capture, where nothing may run, an unchecked pair counts as passing."""
    key = (str(device), dtype)
    if key in _CHECKED:
        return _CHECKED[key]
    if torch.compiler.is_compiling() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return True
    ok, why = _compare(device, dtype)
    _CHECKED[key] = ok
    if not ok:
        warnings.warn(f"the fused Triton kernels failed their check on {device} in {dtype} ({why}); the capacity "
                      "path runs the composition of the gather/scatter kernels and the library's convolutions "
                      "instead", RuntimeWarning, stacklevel=2)
    return ok


def _compare(device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    from .blocks import calc_block_params
    from .capacity import reduce_mask_capacity

    g = torch.Generator().manual_seed(0)
    H, W = 11, 13
    mask = (torch.rand(2, 1, H, W, generator=g) > 0.6).float()
    bl = reduce_mask_capacity(mask, calc_block_params(H, W, bsize=6, ksize=3, stride=1, padding=1), 24)
    written = (torch.rand(2, 1, H, W, generator=g) > 0.3).to(device, dtype)  # the unit's mask: the tiles' pixels
    bl = BlockList(bl.indices.to(device), bl.count.to(device), bl.block, written)

    def rand(*shape):  # noqa: ANN002, ANN202
        return (torch.randn(shape, generator=g) * 0.5).to(device, dtype)

    x = rand(2, 16, H, W).contiguous(memory_format=torch.channels_last)
    w0, w1, b0 = rand(16, 16, 3, 3), rand(16, 16, 1, 1), rand(16)  # a 3x3 from the map, a 1x1 scattering
    up = rand(2, 16, H, W)

    def run(backend: str) -> list[torch.Tensor]:
        global _FORCE
        _FORCE = backend
        try:
            args = [t.detach().clone().requires_grad_(True) for t in (x, w0, w1)]
            a = conv_blocks(args[0], bl, args[1], b0, origin=((4, 4), (1, 1)), extent=(6, 6), relu=True,
                            zero=((4, 4), (0, 0), (H, W)))
            y = conv_scatter(a, bl, args[2], None, args[0] * 1, tile=(4, 4), residual="map", relu=True)
            return [y.detach(), *torch.autograd.grad(y, args, up)]
        finally:
            _FORCE = None

    try:
        got = run("triton")
    except Exception as e:  # noqa: BLE001  (any failure of the kernels means: do not use them)
        return False, f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    want = run("torch")
    return _close(("output", "x's gradient", "w0's gradient", "w1's gradient"), got, want, dtype)


def _close(names, got, want, dtype: torch.dtype) -> tuple[bool, str]:  # noqa: ANN001
    for name, a, b in zip(names, got, want, strict=True):
        scale = float(b.float().abs().max()) or 1.0
        err = float((a.float() - b.float()).abs().max()) / scale
        if not err <= (0.05 if dtype in (torch.float16, torch.bfloat16) else 0.01):  # tf32 dots; NaN fails
            return False, f"{name} off by {err:.3g} of its largest value"
    return True, ""


_FORCE: str | None = None  # the self check's own choice of path, over everything else
_WHOLE: dict[tuple[str, torch.dtype], bool] = {}


def whole_check(device: torch.device, dtype: torch.dtype, run) -> bool:  # noqa: ANN001
    """Whether a whole network ``run()`` (its outputs, a tuple of tensors) gives the same values with the kernels as
    with the composition, on ``device`` in ``dtype``: run once per device and dtype on the first batch, after the
    kernels' own :func:`self_check`, remembered. A failure (an exception or values off by more than the self check
    allows) switches the kernels off for that device and dtype, with one warning: the path then runs the
    composition."""
    device = torch.device(device)
    key = (str(device), dtype)
    if key in _WHOLE:
        return _WHOLE[key]
    if torch.compiler.is_compiling() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return True
    global _FORCE
    try:
        got = [t.detach().clone() for t in run()]
    except Exception as e:  # noqa: BLE001  (any failure of the kernels means: do not use them)
        ok, why = False, f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    else:
        _FORCE = "torch"
        try:
            want = run()
        finally:
            _FORCE = None
        ok, why = _close([f"output {i}" for i in range(len(want))], got, want, dtype)
    _WHOLE[key] = ok
    if not ok:
        _CHECKED[key] = False
        warnings.warn(f"the network on the fused Triton kernels differs from the composition on {device} in {dtype} "
                      f"({why}); the capacity path runs the composition of the gather/scatter kernels and the "
                      "library's convolutions instead", RuntimeWarning, stacklevel=2)
    return ok


def _conv_blocks_torch(src, blist, weight, bias, stride, origin, extent, pre, relu, zero):  # noqa: ANN001, ANN202
    idx = blist.indices
    if origin is not None:
        a = gather_windows(src.contiguous(memory_format=memory_format_of(src) or torch.contiguous_format), idx, extent,
                    origin)
        if pre is not None:
            dt = torch.promote_types(a.dtype, torch.float32)  # the affine in the opmath type, as the kernel does
            a = torch.relu(a.to(dt) * pre[0].view(1, -1, 1, 1).to(dt) + pre[1].view(1, -1, 1, 1).to(dt)).to(a.dtype)
            inside = level_valid(idx, origin[0], origin[1], extent, (int(src.shape[2]), int(src.shape[3])))
            a = a * inside.to(a.dtype)
    else:
        a = src
    y = F.conv2d(a, weight.to(a.dtype), None if bias is None else bias.to(a.dtype), stride)
    if relu:
        y = torch.relu_(y)  # a fresh convolution output: its backward does not read it
    if zero is not None:
        size = (int(y.shape[2]), int(y.shape[3]))
        inside, every = list_memo(blist, ("inside", zero, size), lambda: _inside(idx, zero, size))
        if not every:
            y = y * inside.to(y.dtype)
    return y


def _inside(idx: torch.Tensor, zero, size: tuple[int, int]) -> tuple[torch.Tensor, bool]:  # noqa: ANN001
    """The list's block pixels inside the level's map, and whether that is all of them - where lists hold their
    counts (off CUDA) the read is free and most have no pixel past the map (their pass is skipped)."""
    inside = level_valid(idx, zero[0], zero[1], size, zero[2])
    return inside, not (uses_buckets(idx.device) or torch.compiler.is_compiling()) and bool(inside.all())


def _conv_scatter_torch(blocks, blist, weight, bias, out, tile, residual, relu, inplace, zeros):  # noqa: ANN001, ANN202
    t = F.conv2d(blocks, weight.to(blocks.dtype), None if bias is None else bias.to(blocks.dtype))
    if tuple(t.shape[2:]) != tuple(tile):
        raise ValueError(f"conv_scatter: the convolution gives {tuple(t.shape[2:])} tiles, expected {tuple(tile)}")
    if isinstance(residual, torch.Tensor):
        t = t + residual
    return scatter_padded(t, blist, out, add=_is_map(residual), relu=relu, inplace=inplace, zeros=zeros)


def _is_map(residual: object) -> bool:
    return isinstance(residual, str) and residual == "map"


class _ViaComposition(torch.autograd.Function):
    """Forward by the kernel, backward by the composition's autograd (recomputed)."""

    @staticmethod
    def forward(ctx, fast, slow, *tensors):  # noqa: ANN001, ANN205
        ctx.slow = slow
        ctx.save_for_backward(*tensors)
        return fast(*tensors)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        inputs = [t.detach().requires_grad_(need) if t is not None and need else t
                  for t, need in zip(ctx.saved_tensors, ctx.needs_input_grad[2:], strict=True)]
        wanted = [t for t, need in zip(inputs, ctx.needs_input_grad[2:], strict=True) if need]
        with torch.enable_grad():
            out = ctx.slow(*inputs)
        grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True))
        return (None, None, *(next(grads) if need else None for need in ctx.needs_input_grad[2:]))


class _FusedConv(torch.autograd.Function):
    """The kernel's forward and its fused backward (:func:`~detector.ops.triton_blocks.block_conv_dgrad`,
    :func:`~detector.ops.triton_blocks.block_conv_wgrad`): ``grad`` through the epilogue (ReLU: where the output
    is positive; the level's zeroing: where it kept the pixel), then the source window's gradient (for a map
    source scatter-added into the map at each row's window, halos adding up: the gather's own backward) and the
    weight's; the bias's is the sum over the active rows. Padding rows get and give nothing. A map source is kept
    for the backward as its gathered windows (block-sized, and the map stays free to be written in place)."""

    @staticmethod
    def forward(ctx, fast, geo, src, weight, bias):  # noqa: ANN001, ANN205
        out = fast(src, weight, bias, None, None)
        blist, origin, extent = geo[0], geo[2], geo[3]
        ctx.geo = geo
        ctx.src = (tuple(src.shape), memory_format_of(src) or torch.contiguous_format)
        kept = src if origin is None else gather_windows(src.detach(), blist.indices, extent, origin)
        ctx.save_for_backward(kept, weight, out)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        src, weight, out = ctx.saved_tensors
        blist, stride, origin, extent, relu, zero = ctx.geo
        need_src, need_w, need_b = ctx.needs_input_grad[2:]
        valid = blist.valid.view(-1, 1, 1, 1)
        g = torch.where(valid & (out > 0) if relu else valid, grad, 0)
        if zero is not None and not relu:
            g = g * level_valid(blist.indices, zero[0], zero[1], tuple(g.shape[2:]), zero[2]).to(g.dtype)
        g = g.contiguous(memory_format=memory_format_of(out) or torch.contiguous_format)
        dwin, dw, db = _conv_grads(g, src, weight, blist, stride, need_src, need_w, need_b)
        dsrc = dwin if origin is None or dwin is None else _gather_grad(dwin, blist.indices, *ctx.src, origin)
        return None, None, dsrc, dw, db


def _conv_grads(g: torch.Tensor, src: torch.Tensor, weight: torch.Tensor, blist: BlockList, stride: int,
                need_src: bool, need_w: bool, need_b: bool
                ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """From ``g``, the gradient of the kernel's convolution output (padding rows zero): the source blocks' (the
    dgrad kernel; ``[capacity, CI, e_h, e_w]``, like ``src``), the weight's (the wgrad kernel) and the bias's
    gradient, each only where needed."""
    dwin = dw = db = None
    if need_w:
        dw = triton_blocks.block_conv_wgrad(src, blist.count, g, tuple(weight.shape[2:]), stride=stride)
        dw = dw.to(weight.dtype)
    if need_b:
        db = g.sum((0, 2, 3), dtype=torch.promote_types(g.dtype, torch.float32))
    if need_src:
        dwin = torch.empty(tuple(src.shape), dtype=src.dtype, device=src.device,
                           memory_format=memory_format_of(src) or torch.contiguous_format)
        dwin = triton_blocks.block_conv_dgrad(g, blist.count, weight, dwin, stride=stride)
    return dwin, dw, db


class _FusedScatter(torch.autograd.Function):
    """:func:`conv_scatter`'s kernel forward and its fused backward: the map's gradient at each active row's tile
    (:func:`~detector.ops.capacity.gather_tiles`; zero past the map), through the ReLU where the written output is
    positive, gives the convolution's output gradient ``g``; then the blocks' (the dgrad kernel), the weight's (the
    wgrad kernel), the bias's and a residual tensor's (``g``); the base map's is the map's gradient with the active
    tiles replaced by ``g`` (``residual="map"``: the tile added the base's value) or by zeros (overwritten). Kept
    for the backward: the blocks and, for the ReLU, the output's tiles (block-sized); written in place, the base
    is marked dirty (its history continues through this node)."""

    @staticmethod
    def forward(ctx, fast, geo, blocks, weight, bias, base, res):  # noqa: ANN001, ANN205
        out = fast(blocks, weight, bias, base, res)
        blist, tile, relu, _ = geo
        if out is base:
            ctx.mark_dirty(base)
        ctx.geo = geo
        ctx.fmt = memory_format_of(out) or torch.contiguous_format
        ctx.save_for_backward(blocks, weight, gather_tiles(out.detach(), blist.indices, tile) if relu else None)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        blocks, weight, out_tiles = ctx.saved_tensors
        blist, tile, relu, residual_map = ctx.geo
        need_blocks, need_w, need_b, need_base, need_res = ctx.needs_input_grad[2:]
        fmt = ctx.fmt
        grad = grad.contiguous(memory_format=fmt)
        written = blist.keep(tile)
        g = gather_tiles(grad, blist.indices, tile)
        keep = written & (out_tiles > 0) if relu else written
        g = torch.where(keep, g, 0).contiguous(memory_format=fmt)
        dblocks, dw, db = _conv_grads(g, blocks, weight, blist, 1, need_blocks, need_w, need_b)
        dbase = None
        if need_base:
            dbase = scatter_padded(g if residual_map else torch.zeros_like(g), blist, grad.clone(memory_format=fmt),
                                   add=False, relu=False, inplace=True)
        return None, None, dblocks, dw, db, dbase, g if need_res else None


def _gather_grad(dwin: torch.Tensor, indices: torch.Tensor, shape: tuple[int, ...], fmt: torch.memory_format,
                 origin: Origin) -> torch.Tensor:
    """The gradient of a map of ``shape`` (layout ``fmt``) from its windows' (``sparse_gather``'s backward: each
    window added at its place)."""
    (mh, mw), (fh, fw) = origin
    if _kernels_for(dwin.device):
        return torch.ops.sbnet.sparse_gather_backward(dwin, indices, list(shape), [mh, mw], [-fh, -fw],
                                                      fmt == torch.channels_last)
    xs = torch.zeros(shape, dtype=dwin.dtype, device=dwin.device, memory_format=fmt).requires_grad_(True)
    with torch.enable_grad():
        blocks = gather_windows(xs, indices, tuple(dwin.shape[2:]), origin)
    return torch.autograd.grad(blocks, xs, dwin)[0]


def _grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def conv_blocks(src: torch.Tensor, blist: BlockList, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                stride: int = 1, origin: Origin | None = None, extent: tuple[int, int] | None = None,
                pre: tuple[torch.Tensor, torch.Tensor] | None = None, relu: bool = False,
                zero: Zero | None = None) -> torch.Tensor:
    """Blocks ``[capacity, CO, OH, OW]`` (module docstring): from the map ``src`` at the list's windows
    (``origin`` and ``extent`` given; the gather fused in) or from the blocks ``src [capacity, CI, e, e]``;
    the blocks take the source's memory layout."""
    if origin is not None and extent is None:
        raise ValueError("conv_blocks: a map source needs the block extent")
    kh, kw = int(weight.shape[2]), int(weight.shape[3])
    e = tuple(extent) if origin is not None else (int(src.shape[2]), int(src.shape[3]))
    oh, ow = (e[0] - kh) // stride + 1, (e[1] - kw) // stride + 1
    fmt = memory_format_of(src) or torch.contiguous_format

    def slow(s, w, b, ps, pt):  # noqa: ANN001, ANN202
        return _conv_blocks_torch(s, blist, w, b, stride, origin, e, None if ps is None else (ps, pt), relu, zero)

    if fused_backend(src.device, src.dtype) != "triton":
        return slow(src, weight, bias, *(pre if pre is not None else (None, None)))

    tensors = (src, weight, bias, *(pre if pre is not None else (None, None)))
    grad = _grad(*tensors)

    def fast(s, w, b, ps, pt):  # noqa: ANN001, ANN202
        # under autograd the padding rows are zeros, not unwritten: a batch norm's sums multiply them by a zero
        # gradient, and 0 * (whatever memory held) may be NaN
        out = torch.empty((blist.capacity, int(w.shape[0]), oh, ow), dtype=s.dtype, device=s.device,
                          memory_format=fmt)
        if grad:
            out.zero_()
        return triton_blocks.block_conv(s, blist.indices, blist.count, w, b, out, stride=stride,
                                        in_map=origin is not None, origin=origin or ((0, 0), (0, 0)),
                                        pre=None if ps is None else (ps, pt), relu=relu, zero=zero)

    if grad and pre is None:
        return _FusedConv.apply(fast, (blist, stride, origin, e if origin is not None else None, relu, zero), src,
                                weight, bias)
    if grad:  # the input affine (a pre-activation unit's BN in eval mode) under autograd: the composition's
        return _ViaComposition.apply(fast, slow, *tensors)
    return fast(*tensors)


def conv_scatter(blocks: torch.Tensor, blist: BlockList, weight: torch.Tensor, bias: torch.Tensor | None,
                 out: torch.Tensor, *, tile: tuple[int, int], residual: str | torch.Tensor | None = None,
                 relu: bool = False, inplace: bool = True, zeros: bool = False) -> torch.Tensor:
    """The last convolution of a unit on ``blocks``, its tiles combined into the map ``out`` (module docstring):
    ``residual="map"`` adds out's own values (the identity shortcut), a ``[capacity, CO, th, tw]`` tensor adds
    that (the projection), None writes. ``inplace``: into ``out`` itself (recorded as an in-place write under
    autograd), else into a copy of it; ``zeros``: ``out`` holds zeros at the tiles (not read)."""
    if residual is not None and not isinstance(residual, torch.Tensor) and not _is_map(residual):
        raise ValueError(f"conv_scatter: residual must be 'map', a tensor or None, got {residual!r}")
    tile = (int(tile[0]), int(tile[1]))
    res_t = residual if isinstance(residual, torch.Tensor) else None
    grad = _grad(blocks, weight, bias, out, res_t)

    def slow(bl, w, b, o, r):  # noqa: ANN001, ANN202
        return _conv_scatter_torch(bl, blist, w, b, o, tile, r if r is not None else residual, relu, inplace, zeros)

    if fused_backend(blocks.device, blocks.dtype) != "triton":
        return slow(blocks, weight, bias, out, res_t)

    def fast(bl, w, b, o, r):  # noqa: ANN001, ANN202
        dst = o if inplace else o.clone(memory_format=memory_format_of(o) or torch.contiguous_format)
        return triton_blocks.block_conv(bl, blist.indices, blist.count, w, b, dst, stride=1, in_map=False,
                                        relu=relu, tile=tile, residual=dst if _is_map(residual) else r,
                                        residual_map=_is_map(residual), mask=blist.mask)

    if grad:
        return _FusedScatter.apply(fast, (blist, tile, relu, _is_map(residual)), blocks, weight, bias, out, res_t)
    return fast(blocks, weight, bias, out, res_t)
