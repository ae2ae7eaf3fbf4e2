"""Triton kernel of the fused sparse-block convolution: the GPU path of :mod:`detector.ops.fused`.

One kernel, :func:`block_conv`, is an implicit GEMM over the rows of a :class:`~detector.ops.capacity.BlockList`:
program ``(k, m-tile, n-tile)`` computes ``BM`` output pixels x ``BN`` output channels of block ``k`` (nothing
when ``k >= count``: padding rows are skipped, their outputs left unwritten), reducing over ``KH x KW x CI``.
Its prologue reads the source where it lies:

- ``IN_MAP``: the map itself (any strides: NCHW or NHWC) at the block's window with its halo, zero outside the
  map (the gather fused in; nothing is copied or padded); ``PRE``: ``relu(x * s + t)`` per input channel first
  (a pre-activation unit's input BN), still zero outside the map;
- else the previous convolution's blocks ``[capacity, CI, e, e]``.

Its epilogue: ``+ bias`` (the folded batch norm's shift; the scale is folded into the weight), then

- blocks out: ReLU, pixels outside the level's map zeroed (the dense twin's zero padding for the next
  convolution), stored as ``[capacity, CO, OH, OW]``;
- ``OUT_MAP``: the tile written into the output map at the block's place, clipped to the map, with the residual
  added first (``RES=1``: the map's own value there, the identity shortcut; ``RES=2``: a shortcut block tensor,
  the projection) and ReLU after: the scatter fused into the last convolution; ``MASKED``: only at the pixels of
  the unit's mask (a ``[N, 1, H', W']`` map), the output map keeping its value elsewhere.

Accumulation in float32 (float64 for float64 data). Under ``TRITON_INTERPRET=1`` the same kernel runs on CPU
tensors (the tests); the interpreter's half-precision dot is upcast to float32 first. The kernel is decorated
on first use, so the interpreter setting read then is the one that counts. Every launch goes through
:func:`_launch`; inside :func:`recording` each is recorded as a GPU would compile it (what
``tests/ops/test_triton_aot.py`` compiles ahead of time for sm_80 and sm_90).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

__all__ = ["Launch", "Pointer", "available", "block_conv", "block_conv_dgrad", "block_conv_wgrad", "recording"]

_KERNELS: dict[tuple[str, bool], object] = {}


def available() -> bool:
    """Whether triton can be imported."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True)
class Pointer:
    """A tensor argument as the compiler sees it: its element type and its address modulo 16 (0: the 16-byte
    alignment the compiler specializes on)."""

    dtype: torch.dtype
    address: int

    def data_ptr(self) -> int:
        return self.address


@dataclass(frozen=True)
class Launch:
    """One recorded launch: the kernel's Python function, its positional arguments (tensors as :class:`Pointer`)
    and its keyword arguments (the constexprs, as a GPU compiles them, and any launch options)."""

    fn: Callable
    args: tuple
    kwargs: dict


_RECORDS: list[Launch] | None = None
_RUN = True


@contextlib.contextmanager
def recording(run: bool = True) -> Iterator[list[Launch]]:
    """The launches made inside, in order, as :class:`Launch` records. ``run=False``: recorded and not run (their
    outputs keep whatever their memory held): what a configuration launches, without the cost of running it."""
    global _RECORDS, _RUN
    outer, _RECORDS, outer_run, _RUN = _RECORDS, [], _RUN, run
    try:
        yield _RECORDS
    finally:
        _RECORDS, _RUN = outer, outer_run


def _launch(kernel, grid: tuple[int, ...], *args, **kwargs) -> None:  # noqa: ANN001
    """``kernel[grid](*args, **kwargs)`` with ``kwargs`` as a GPU compiles them; the interpreter also upcasts
    the dot's operands (``UPCAST``: it has no half-precision dot). Recorded inside :func:`recording`."""
    if _RECORDS is not None:
        _RECORDS.append(Launch(kernel.fn, tuple(Pointer(a.dtype, a.data_ptr() % 16) if isinstance(a, torch.Tensor)
                                                else a for a in args), dict(kwargs)))
    if not _RUN:
        return
    if _interpreting():
        kwargs["UPCAST"] = True
    kernel[grid](*args, **kwargs)


def _kernel():
    interp = _interpreting()
    if ("fwd", interp) in _KERNELS:
        return _KERNELS["fwd", interp]
    import triton
    import triton.language as tl

    def _block_conv(
        src, s_n, s_c, s_h, s_w, idx, cnt, w, bias, pre_s, pre_t,
        res, r_n, r_c, r_h, r_w, out, o_n, o_c, o_h, o_w, msk, m_n, m_h, m_w,
        CI, CO, SH, SW, OH, OW,
        in_mul_h, in_off_h, in_mul_w, in_off_w,
        z_mul_h, z_off_h, z_mul_w, z_off_w, ZH, ZW,
        KH: tl.constexpr, KW: tl.constexpr, STRIDE: tl.constexpr,
        IN_MAP: tl.constexpr, PRE: tl.constexpr, OUT_MAP: tl.constexpr, MASKED: tl.constexpr, RES: tl.constexpr,
        RELU: tl.constexpr,
        ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, F64: tl.constexpr,
        PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, M_TILES: tl.constexpr,
    ):
        pid = tl.program_id(0)
        k = pid // M_TILES
        mt = pid % M_TILES
        count = tl.load(cnt)
        if k < count:
            n = tl.load(idx + k * 3).to(tl.int64)
            by = tl.load(idx + k * 3 + 1)
            bx = tl.load(idx + k * 3 + 2)
            rm = mt * BM + tl.arange(0, BM)
            m_ok = rm < OH * OW
            oy = rm // OW
            ox = rm % OW
            rn = tl.program_id(1) * BN + tl.arange(0, BN)
            n_ok = rn < CO
            if IN_MAP:
                base = src + n * s_n
                y0 = by * in_mul_h - in_off_h
                x0 = bx * in_mul_w - in_off_w
            else:
                base = src + k.to(tl.int64) * s_n
                y0 = 0
                x0 = 0
            acc = tl.full((BM, BN), 0.0, dtype=tl.float64 if F64 else tl.float32)
            for ky in tl.static_range(KH):
                for kx in tl.static_range(KW):
                    iy = y0 + oy * STRIDE + ky
                    ix = x0 + ox * STRIDE + kx
                    pix_ok = m_ok
                    if IN_MAP:
                        pix_ok = pix_ok & (iy >= 0) & (iy < SH) & (ix >= 0) & (ix < SW)
                    for c0 in range(0, CI, BK):
                        rc = c0 + tl.arange(0, BK)
                        c_ok = rc < CI
                        ok = pix_ok[:, None] & c_ok[None, :]
                        a = tl.load(base + iy[:, None] * s_h + ix[:, None] * s_w + rc[None, :] * s_c, mask=ok,
                                    other=0.0)
                        if PRE:
                            ps = tl.load(pre_s + rc, mask=c_ok, other=0.0)
                            pt = tl.load(pre_t + rc, mask=c_ok, other=0.0)
                            a2 = tl.maximum(a.to(acc.dtype) * ps[None, :] + pt[None, :], 0.0)
                            a = tl.where(ok, a2, 0.0).to(a.dtype)
                        b = tl.load(w + ((ky * KW + kx) * CI + rc)[:, None] * CO + rn[None, :],
                                    mask=c_ok[:, None] & n_ok[None, :], other=0.0)
                        if UPCAST:
                            acc += tl.dot(a.to(acc.dtype), b.to(acc.dtype))
                        else:
                            acc += tl.dot(a, b, input_precision=PREC)
            if HAS_BIAS:
                acc += tl.load(bias + rn, mask=n_ok, other=0.0).to(acc.dtype)[None, :]
            if OUT_MAP:
                py = by * OH + oy
                px = bx * OW + ox
                pix = m_ok & (py < ZH) & (px < ZW)
                if MASKED:  # only the pixels of the unit's mask are written: the map keeps its value elsewhere
                    mv = tl.load(msk + n * m_n + py * m_h + px * m_w, mask=pix, other=0.0)
                    pix = pix & (mv > 0.5)
                ok = pix[:, None] & n_ok[None, :]
                if RES == 1:
                    r = tl.load(res + n * r_n + rn[None, :] * r_c + py[:, None] * r_h + px[:, None] * r_w, mask=ok,
                                other=0.0)
                    acc += r.to(acc.dtype)
                if RES == 2:
                    r = tl.load(res + k.to(tl.int64) * r_n + rn[None, :] * r_c + oy[:, None] * r_h
                                + ox[:, None] * r_w, mask=ok, other=0.0)
                    acc += r.to(acc.dtype)
                if RELU:
                    acc = tl.maximum(acc, 0.0)
                tl.store(out + n * o_n + rn[None, :] * o_c + py[:, None] * o_h + px[:, None] * o_w,
                         acc.to(out.dtype.element_ty), mask=ok)
            else:
                if RELU:
                    acc = tl.maximum(acc, 0.0)
                if ZERO:
                    zy = by * z_mul_h - z_off_h + oy
                    zx = bx * z_mul_w - z_off_w + ox
                    inside = (zy >= 0) & (zy < ZH) & (zx >= 0) & (zx < ZW)
                    acc = tl.where(inside[:, None], acc, 0.0)
                tl.store(out + k.to(tl.int64) * o_n + rn[None, :] * o_c + oy[:, None] * o_h + ox[:, None] * o_w,
                         acc.to(out.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    _KERNELS["fwd", interp] = triton.jit(_block_conv)
    return _KERNELS["fwd", interp]


def _pow2(v: int, lo: int, hi: int) -> int:
    p = lo
    while p < v and p < hi:
        p *= 2
    return p


def block_conv(src: torch.Tensor, indices: torch.Tensor, count: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None, out: torch.Tensor, *, stride: int, in_map: bool,
               origin: tuple[tuple[int, int], tuple[int, int]] = ((0, 0), (0, 0)),
               pre: tuple[torch.Tensor, torch.Tensor] | None = None, relu: bool = False,
               zero: tuple[tuple[int, int], tuple[int, int], tuple[int, int]] | None = None,
               tile: tuple[int, int] | None = None, residual: torch.Tensor | None = None,
               residual_map: bool = False, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the kernel (module docstring); ``out`` is written and returned: blocks ``[capacity, CO, OH, OW]``,
    or (``tile`` given) the map ``[N, CO, H', W']`` at each block's ``tile``-sized output tile - only where
    ``mask [N, 1, H', W']`` (the unit's mask at the output) is set, when given.

    ``weight [CO, CI, KH, KW]`` (the BN scale folded in), ``bias [CO]`` or None; ``origin``: the block's first
    source pixel is ``(by * mul_h - off_h, bx * mul_w - off_w)`` for ``((mul_h, mul_w), (off_h, off_w))``;
    ``zero``: ``((mul_h, mul_w), (off_h, off_w), (H, W))`` of the output level, pixels outside it zeroed;
    ``residual``: the output map's own values (``residual_map``) or a ``[capacity, CO, th, tw]`` block tensor."""
    cap = int(indices.shape[0])
    co, ci, kh, kw = (int(v) for v in weight.shape)
    if cap == 0:
        return out
    f64 = src.dtype == torch.float64
    acc = torch.float64 if f64 else torch.float32
    w = weight.permute(2, 3, 1, 0).reshape(kh * kw * ci, co).to(src.dtype).contiguous()
    b = bias.to(acc).contiguous() if bias is not None else w  # an unused pointer when HAS_BIAS is false
    ps, pt = (pre[0].to(acc).contiguous(), pre[1].to(acc).contiguous()) if pre is not None else (w, w)
    res = residual if residual is not None else out
    out_map = tile is not None
    msk = mask if mask is not None and out_map else out  # an unused pointer when MASKED is false
    ms = (msk.stride(0), msk.stride(2), msk.stride(3))
    oh, ow = tile if out_map else (int(out.shape[2]), int(out.shape[3]))
    (mh, mw), (fh, fw) = origin
    if out_map:
        zmh = zmw = zfh = zfw = 0
        zh, zw = int(out.shape[2]), int(out.shape[3])
    elif zero is not None:
        (zmh, zmw), (zfh, zfw), (zh, zw) = zero
    else:
        zmh = zmw = zfh = zfw = zh = zw = 0
    m = oh * ow
    bm, bn, bk = _pow2(m, 16, 64), _pow2(co, 16, 64), _pow2(ci, 16, 32)
    m_tiles = -(-m // bm)
    prec = "tf32" if torch.backends.cudnn.allow_tf32 else "ieee"
    grid = (cap * m_tiles, -(-co // bn))
    _launch(
        _kernel(), grid, src, *src.stride(), indices, count, w, b, ps, pt,
        res, *res.stride(), out, *out.stride(), msk, *ms,
        ci, co, int(src.shape[2]), int(src.shape[3]), oh, ow,
        mh, fh, mw, fw, zmh, zfh, zmw, zfw, zh, zw,
        KH=kh, KW=kw, STRIDE=stride, IN_MAP=in_map, PRE=pre is not None, OUT_MAP=out_map,
        MASKED=out_map and mask is not None,
        RES=0 if residual is None else (1 if residual_map else 2), RELU=relu, ZERO=zero is not None and not out_map,
        HAS_BIAS=bias is not None, UPCAST=f64, F64=f64, PREC=prec,
        BM=bm, BN=bn, BK=bk, M_TILES=m_tiles,
    )
    return out


def _grad_kernels():
    """The backward's two kernels (:func:`block_conv_dgrad`, :func:`block_conv_wgrad`), decorated on first use."""
    interp = _interpreting()
    if ("bwd", interp) in _KERNELS:
        return _KERNELS["bwd", interp]
    import triton
    import triton.language as tl

    def _dgrad(
        g, g_n, g_c, g_h, g_w, cnt, w, out, o_n, o_c, o_h, o_w,
        CI, CO, OH, OW, PH, PW,
        KH: tl.constexpr, KW: tl.constexpr, STRIDE: tl.constexpr, UPCAST: tl.constexpr, F64: tl.constexpr,
        PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, M_TILES: tl.constexpr,
    ):
        pid = tl.program_id(0)
        k = pid // M_TILES
        mt = pid % M_TILES
        count = tl.load(cnt)
        rm = mt * BM + tl.arange(0, BM)
        m_ok = rm < PH * PW
        py = rm // PW
        px = rm % PW
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        n_ok = rn < CI
        acc = tl.full((BM, BN), 0.0, dtype=tl.float64 if F64 else tl.float32)
        if k < count:  # a padding row's gradient is zero (written below, never left unwritten)
            for ky in tl.static_range(KH):
                for kx in tl.static_range(KW):
                    ty = py - ky
                    tx = px - kx
                    qy = ty // STRIDE
                    qx = tx // STRIDE
                    ok = m_ok & (ty >= 0) & (tx >= 0) & (qy * STRIDE == ty) & (qx * STRIDE == tx) & (qy < OH)
                    ok = ok & (qx < OW)
                    for c0 in range(0, CO, BK):
                        rc = c0 + tl.arange(0, BK)
                        c_ok = rc < CO
                        a = tl.load(g + k.to(tl.int64) * g_n + rc[None, :] * g_c + qy[:, None] * g_h
                                    + qx[:, None] * g_w, mask=ok[:, None] & c_ok[None, :], other=0.0)
                        b = tl.load(w + ((ky * KW + kx) * CO + rc)[:, None] * CI + rn[None, :],
                                    mask=c_ok[:, None] & n_ok[None, :], other=0.0)
                        if UPCAST:
                            acc += tl.dot(a.to(acc.dtype), b.to(acc.dtype))
                        else:
                            acc += tl.dot(a, b, input_precision=PREC)
        tl.store(out + k.to(tl.int64) * o_n + rn[None, :] * o_c + py[:, None] * o_h + px[:, None] * o_w,
                 acc.to(out.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    def _wgrad(
        src, s_n, s_c, s_h, s_w, cnt, g, g_n, g_c, g_h, g_w, part,
        CI, CO, OH, OW, PER,
        KH: tl.constexpr, KW: tl.constexpr, STRIDE: tl.constexpr, UPCAST: tl.constexpr,
        F64: tl.constexpr, PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BI: tl.constexpr,
        CI_TILES: tl.constexpr,
    ):
        pid = tl.program_id(0)
        kk = pid // CI_TILES
        ky = kk // KW
        kx = kk % KW
        ri = (pid % CI_TILES) * BI + tl.arange(0, BI)
        i_ok = ri < CI
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        n_ok = rn < CO
        split = tl.program_id(2)
        count = tl.load(cnt)
        lo = split * PER
        hi = tl.minimum(lo + PER, count)
        acc = tl.full((BI, BN), 0.0, dtype=tl.float64 if F64 else tl.float32)
        zero64 = (split * 0).to(tl.int64)  # the row's offsets in 64 bits (the loop index is a plain int interpreted)
        for k in range(lo, hi):
            k64 = zero64 + k
            base = src + k64 * s_n
            for m0 in range(0, OH * OW, BM):
                rm = m0 + tl.arange(0, BM)
                m_ok = rm < OH * OW
                oy = rm // OW
                ox = rm % OW
                iy = oy * STRIDE + ky
                ix = ox * STRIDE + kx
                a = tl.load(base + ri[:, None] * s_c + iy[None, :] * s_h + ix[None, :] * s_w,
                            mask=i_ok[:, None] & m_ok[None, :], other=0.0)
                b = tl.load(g + k64 * g_n + rn[None, :] * g_c + oy[:, None] * g_h + ox[:, None] * g_w,
                            mask=m_ok[:, None] & n_ok[None, :], other=0.0)
                if UPCAST:
                    acc += tl.dot(a.to(acc.dtype), b.to(acc.dtype))
                else:
                    acc += tl.dot(a, b, input_precision=PREC)
        tl.store(part + (split * KH * KW + kk) * CI * CO + ri[:, None] * CO + rn[None, :], acc,
                 mask=i_ok[:, None] & n_ok[None, :])

    _KERNELS["bwd", interp] = (triton.jit(_dgrad), triton.jit(_wgrad))
    return _KERNELS["bwd", interp]


def _precision(dtype: torch.dtype) -> tuple[bool, bool, str]:
    f64 = dtype == torch.float64
    return f64, f64, "tf32" if torch.backends.cudnn.allow_tf32 else "ieee"


def block_conv_dgrad(grad: torch.Tensor, count: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, *,
                     stride: int) -> torch.Tensor:
    """The gradient of :func:`block_conv`'s source window from the gradient of its convolution's output
    ``grad [capacity, CO, OH, OW]`` (the epilogue's ReLU and zeroing already applied to it): the transposed
    convolution, written into ``out [capacity, CI, PH, PW]`` (the window; zeros at padding rows and where no
    output pixel reads a window pixel). One program per (row, pixel tile, channel tile)."""
    cap, co, oh, ow = (int(v) for v in grad.shape)
    _, ci, kh, kw = (int(v) for v in weight.shape)
    ph, pw = int(out.shape[2]), int(out.shape[3])
    if cap == 0:
        return out
    upcast, f64, prec = _precision(grad.dtype)
    w = weight.permute(2, 3, 0, 1).reshape(kh * kw * co, ci).to(grad.dtype).contiguous()
    m = ph * pw
    bm, bn, bk = _pow2(m, 16, 64), _pow2(ci, 16, 64), _pow2(co, 16, 32)
    m_tiles = -(-m // bm)
    _launch(
        _grad_kernels()[0], (cap * m_tiles, -(-ci // bn)),
        grad, *grad.stride(), count, w, out, *out.stride(), ci, co, oh, ow, ph, pw,
        KH=kh, KW=kw, STRIDE=stride, UPCAST=upcast, F64=f64, PREC=prec, BM=bm, BN=bn, BK=bk, M_TILES=m_tiles,
    )
    return out


def block_conv_wgrad(src: torch.Tensor, count: torch.Tensor, grad: torch.Tensor, kernel: tuple[int, int], *,
                     stride: int, splits: int = 32) -> torch.Tensor:
    """The gradient of :func:`block_conv`'s weight, ``[CO, CI, KH, KW]`` in float32 (float64 for float64 data): the sum
    over the list's active rows and output pixels of the source blocks ``src [capacity, CI, e_h, e_w]`` (a map
    source's gathered windows) times ``grad [capacity, CO, OH, OW]``. The rows are cut into ``splits`` runs, each
    summed by its own programs into a partial; the partials are then added by one reduction: no atomics, so the
    result does not depend on scheduling (deterministic)."""
    cap, co, oh, ow = (int(v) for v in grad.shape)
    ci = int(src.shape[1])
    kh, kw = kernel
    upcast, f64, prec = _precision(src.dtype)
    acc = torch.float64 if f64 else torch.float32
    splits = max(1, min(splits, cap))
    per = -(-cap // splits) if cap else 0
    part = torch.zeros((splits, kh * kw, ci, co), dtype=acc, device=src.device)
    if cap:
        bi, bn, bm = _pow2(ci, 16, 32), _pow2(co, 16, 64), _pow2(oh * ow, 16, 64)
        ci_tiles = -(-ci // bi)
        _launch(
            _grad_kernels()[1], (kh * kw * ci_tiles, -(-co // bn), splits),
            src, *src.stride(), count, grad, *grad.stride(), part, ci, co, oh, ow, per,
            KH=kh, KW=kw, STRIDE=stride, UPCAST=upcast, F64=f64, PREC=prec, BM=bm, BN=bn, BI=bi,
            CI_TILES=ci_tiles,
        )
    return part.sum(0).view(kh, kw, ci, co).permute(3, 2, 0, 1)
