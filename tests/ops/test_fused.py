"""The fused sparse-block convolution (detector.ops.fused): its Triton kernel (detector.ops.triton_blocks, run on
the CPU under TRITON_INTERPRET=1) against the composition of the compiled gather/scatter and F.conv2d (the CPU
path, itself checked against the exact sparse unit in tests/nn/test_capacity.py).

Cases: NCHW and channels-last maps, float32 (rtol = atol = 1e-5: only the summation order differs) and bfloat16
(rtol = 3e-2, atol = 0.1: outputs are sums of ~45 products of O(1) values, up to ~15 in size, where a bfloat16
ulp is 0.06; both sides round their float32 sums to bfloat16, oneDNN's convolution in its own order), every border (an
all-ones mask activates the tiles at the map's edges; halos reach past them), K = 0, padded capacity (rows past
the count), outputs poisoned with NaN before each run so that an element the kernel fails to write shows.
Backward: the kernel's fused backward (dgrad and wgrad kernels) against the composition's autograd (float64 to 1e-10,
float32 1e-4, bfloat16 rtol 5e-2 / atol 0.2), gradcheck in float64 (fast mode, tiny shapes).
Without triton the module skips (triton is not a dependency of the CPU install; CUDA builds of torch ship it).
"""

from __future__ import annotations

import pytest
import torch

from detector.ops import calc_block_params, fused, triton_blocks
from detector.ops.capacity import reduce_mask_capacity

pytest.importorskip("triton")

H, W, N = 9, 10, 2
LAYOUTS = {"nchw": torch.contiguous_format, "nhwc": torch.channels_last}
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=3e-2, atol=1e-1)}


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _blist(p: float, capacity: int, bsize=6, ksize=3, stride=1, padding=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(N, 1, H, W, generator=g) > p).float() if p < 1 else torch.zeros(N, 1, H, W)
    bp = calc_block_params(H, W, bsize=bsize, ksize=ksize, stride=stride, padding=padding)
    return reduce_mask_capacity(mask, bp, capacity), bp


def _both(monkeypatch, fn):
    """fn() by the composition, then by the kernel (DETECTOR_FUSED forces the path)."""
    monkeypatch.setenv("DETECTOR_FUSED", "torch")
    want = fn()
    monkeypatch.setenv("DETECTOR_FUSED", "triton")
    return want, fn()


# (mask density p, capacity) on a 3 x 3 grid of 4-pixel tiles per sample: some blocks with padding rows past the
# count, every block (all borders; the bottom and right tiles stick out of the map), none (K = 0)
SOME, ALL, NONE = (0.85, 18), (-1.0, 18), (1.0, 8)
CASES = [(torch.float32, "nchw", ALL), (torch.float32, "nhwc", SOME), (torch.bfloat16, "nhwc", SOME),
         (torch.bfloat16, "nchw", ALL), (torch.float32, "nhwc", NONE)]
CASE_IDS = [f"{str(d).removeprefix('torch.')}-{lay}-{['some', 'all', 'none'][[SOME, ALL, NONE].index(m)]}"
            for d, lay, m in CASES]


@pytest.mark.parametrize("dtype,layout,pcap", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("pre", [False, True])
def test_first_conv_gathers_from_the_map(dtype, layout, pcap, pre):
    """3x3 conv on 6x6 windows (halo 1 on each side, origin by*4 - 1), BN folded, ReLU, zero outside the map."""
    bl, bp = _blist(*pcap)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, 5, H, W, generator=g).to(dtype).contiguous(memory_format=LAYOUTS[layout])
    w, b = torch.randn(7, 5, 3, 3, generator=g).to(dtype), torch.randn(7, generator=g)
    ps = (torch.rand(5, generator=g) + 0.5, torch.randn(5, generator=g)) if pre else None
    kw = dict(stride=1, origin=((4, 4), (1, 1)), extent=(6, 6), pre=ps, relu=True, zero=((4, 4), (0, 0), (H, W)))
    want = fused._conv_blocks_torch(x, bl, w, b, 1, kw["origin"], (6, 6), ps, True, kw["zero"])
    out = torch.full((bl.capacity, 7, 4, 4), float("nan"), dtype=dtype).contiguous(memory_format=LAYOUTS[layout])
    got = triton_blocks.block_conv(x, bl.indices, bl.count, w, b, out, stride=1, in_map=True, origin=kw["origin"],
                                   pre=ps, relu=True, zero=kw["zero"])
    k = min(int(bl.count), bl.capacity)
    torch.testing.assert_close(got[:k], want[:k], **TOL[dtype])
    assert got[k:].isnan().all()  # padding rows are skipped (the count read on the device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_strided_projection_and_blocks_source(dtype, layout, monkeypatch):
    """A 1x1 stride-2 projection read from the map (origin by*8), and a 3x3 stride-2 conv on blocks."""
    bl, _ = _blist(0.85, 12, bsize=9, ksize=3, stride=2, padding=1)
    g = torch.Generator().manual_seed(4)
    fmt = LAYOUTS[layout]
    x = torch.randn(N, 3, H, W, generator=g).to(dtype).contiguous(memory_format=fmt)
    wp = torch.randn(6, 3, 1, 1, generator=g).to(dtype)
    src = torch.randn(bl.capacity, 3, 9, 9, generator=g).to(dtype).contiguous(memory_format=fmt)
    w3 = torch.randn(6, 3, 3, 3, generator=g).to(dtype)
    want, got = _both(monkeypatch, lambda: (
        fused.conv_blocks(x, bl, wp, None, stride=2, origin=((8, 8), (0, 0)), extent=(7, 7)),
        fused.conv_blocks(src, bl, w3, torch.randn(6, generator=torch.Generator().manual_seed(5)), stride=2)))
    k = int(bl.count)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a[:k], b[:k], **TOL[dtype])


@pytest.mark.parametrize("dtype,layout,pcap", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("residual", ["map", "blocks", None])
def test_last_conv_scatters_with_residual(dtype, layout, pcap, residual, monkeypatch):
    """The last conv's tiles (4x4, clipped at the bottom/right border) into the map: + residual, ReLU."""
    bl, _ = _blist(*pcap)
    g = torch.Generator().manual_seed(6)
    fmt = LAYOUTS[layout]
    a = torch.randn(bl.capacity, 5, 6, 6, generator=g).to(dtype).contiguous(memory_format=fmt)
    w, b = torch.randn(4, 5, 3, 3, generator=g).to(dtype), torch.randn(4, generator=g)
    base = torch.randn(N, 4, H, W, generator=g).to(dtype).contiguous(memory_format=fmt)
    if residual is None:  # written tiles: a NaN map shows every element the kernel should have written and did not
        base.fill_(float("nan"))
    res = torch.randn(bl.capacity, 4, 4, 4, generator=g).to(dtype) if residual == "blocks" else residual
    relu = residual != "blocks"
    want, got = _both(monkeypatch, lambda: fused.conv_scatter(a, bl, w, b, base.clone(memory_format=fmt), tile=(4, 4),
                                                              residual=res, relu=relu))
    assert memory_format_ok(got, fmt)
    torch.testing.assert_close(got, want, equal_nan=True, **TOL[dtype])
    if residual is None and int(bl.count):
        assert not got[tuple(bl.indices[0, :1].long())].isnan().all()


def memory_format_ok(t: torch.Tensor, fmt: torch.memory_format) -> bool:
    return t.is_contiguous(memory_format=fmt)


def _unit(bl):
    def unit(x, w, w2):  # a first conv from the map, a blocks-to-blocks conv, the scatter with the residual
        a = fused.conv_blocks(x, bl, w, None, origin=((4, 4), (1, 1)), extent=(6, 6), relu=True,
                              zero=((4, 4), (0, 0), (H, W)))
        a = fused.conv_blocks(a, bl, w2, None)
        eye = torch.eye(x.shape[1], dtype=x.dtype).view(x.shape[1], x.shape[1], 1, 1)
        return fused.conv_scatter(a, bl, eye, None, x * 1.0, tile=(2, 2), residual="map", relu=True)
    return unit


def _grads(fn, *args):
    args = [a.detach().requires_grad_() for a in args]
    out = fn(*args)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=out.dtype)
    return out, torch.autograd.grad(out, args, g)


def test_unit_backward_through_the_kernels(monkeypatch):
    """A unit on the kernels under autograd (the first conv's fused backward, the scattering conv's backward by the
    composition) gives the composition's output and gradients, and the composition's gradients are right
    (gradcheck, float64)."""
    bl, _ = _blist(0.8, 6, bsize=6, ksize=3)
    g = torch.Generator().manual_seed(7)
    args = (torch.randn(N, 2, H, W, generator=g, dtype=torch.float64),
            torch.randn(2, 2, 3, 3, generator=g, dtype=torch.float64),
            torch.randn(2, 2, 3, 3, generator=g, dtype=torch.float64))
    (want, want_g), (got, got_g) = _both(monkeypatch, lambda: _grads(_unit(bl), *args))
    torch.testing.assert_close(got, want)
    for a, b in zip(got_g, want_g, strict=True):
        torch.testing.assert_close(a, b)
    monkeypatch.setenv("DETECTOR_FUSED", "torch")
    assert torch.autograd.gradcheck(_unit(bl), tuple(a.requires_grad_() for a in args), fast_mode=True)


@pytest.mark.slow
def test_gradcheck_through_the_kernel(monkeypatch):
    monkeypatch.setenv("DETECTOR_FUSED", "triton")
    bl, _ = _blist(0.8, 6, bsize=6, ksize=3)
    g = torch.Generator().manual_seed(7)
    args = tuple(torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True)
                 for s in ((N, 2, H, W), (2, 2, 3, 3), (2, 2, 3, 3)))
    assert torch.autograd.gradcheck(_unit(bl), args, fast_mode=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_kernel_vs_composition(dtype, monkeypatch):
    """On the GPU (compiled triton, no interpreter): every kernel mode against the composition on random data."""
    monkeypatch.delenv("TRITON_INTERPRET")
    dev = torch.device("cuda")
    tol = dict(rtol=2e-2, atol=2e-2)  # tf32 / bfloat16 dots
    bl, _ = _blist(0.7, 48)
    bl = type(bl)(bl.indices.to(dev), bl.count.to(dev), bl.block)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(N, 32, H, W, generator=g, device=dev).to(dtype).contiguous(memory_format=torch.channels_last)
    w, b = torch.randn(48, 32, 3, 3, generator=g, device=dev).to(dtype), torch.randn(48, generator=g, device=dev)
    w2 = torch.randn(32, 48, 3, 3, generator=g, device=dev).to(dtype) * 0.1
    base = torch.randn(N, 32, H, W, generator=g, device=dev).to(dtype).contiguous(memory_format=torch.channels_last)

    def run():
        a = fused.conv_blocks(x, bl, w, b, origin=((2, 2), (2, 2)), extent=(6, 6), relu=True,
                              zero=((2, 2), (1, 1), (H, W)))
        return a, fused.conv_scatter(a, bl, w2, None, base.clone(memory_format=torch.channels_last), tile=(2, 2),
                                     residual="map", relu=True)

    k = int(bl.count)
    want, got = _both(monkeypatch, run)
    torch.testing.assert_close(got[0][:k], want[0][:k], **tol)
    torch.testing.assert_close(got[1], want[1], **tol)


# the fused backward: (source, window extent, kernel, stride, origin) of conv_blocks
GRAD_CASES = {
    "map-3x3-halo": dict(src="map", extent=(6, 6), k=3, stride=1, origin=((4, 4), (1, 1))),
    "map-3x3-stride2": dict(src="map", extent=(9, 9), k=3, stride=2, origin=((8, 8), (1, 1))),
    "map-1x1-stride2": dict(src="map", extent=(7, 7), k=1, stride=2, origin=((8, 8), (0, 0))),
    "blocks-3x3": dict(src="blocks", extent=(6, 6), k=3, stride=1, origin=None),
    "blocks-3x3-stride2": dict(src="blocks", extent=(7, 7), k=3, stride=2, origin=None),
}
GRAD_TOL = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-4, atol=1e-4),
            torch.bfloat16: dict(rtol=5e-2, atol=2e-1)}


GRAD_DATA = {"float64-nchw-some": (torch.float64, "nchw", SOME), "float32-nhwc-all": (torch.float32, "nhwc", ALL),
             "bfloat16-nhwc-some": (torch.bfloat16, "nhwc", SOME), "float32-nchw-none": (torch.float32, "nchw", NONE)}
# make test runs each geometry once (every dtype, layout, epilogue and count among them; ~30 s interpreted), the
# slow run the whole product
GRAD_QUICK = {("map-3x3-halo", "float64-nchw-some", "relu-zero"), ("map-3x3-stride2", "float32-nhwc-all", "bias"),
              ("blocks-3x3", "bfloat16-nhwc-some", "relu-zero"),
              ("blocks-3x3-stride2", "float32-nhwc-all", "relu-zero"),
              ("map-1x1-stride2", "float64-nchw-some", "bias"), ("map-3x3-halo", "float32-nchw-none", "relu-zero")}
GRAD_PARAMS = [pytest.param(c, d, e, id=f"{e}-{d}-{c}",
                            marks=() if (c, d, e) in GRAD_QUICK else pytest.mark.slow)
               for c in GRAD_CASES for d in GRAD_DATA for e in ("relu-zero", "bias")]


@pytest.mark.parametrize("case,data,epilogue", GRAD_PARAMS)
def test_fused_backward_equals_the_composition(case, data, epilogue, monkeypatch):
    """conv_blocks' backward on the kernel's path (the dgrad and wgrad kernels) gives the composition's gradients
    of the source (a map: scatter-added windows; or blocks), the weight and the bias, when the rows past the count
    get no gradient from downstream (as on the capacity path, whose scatter takes nothing from them); a NaN sent
    to those rows changes nothing (they give nothing back)."""
    c = GRAD_CASES[case]
    dtype, layout, pcap = GRAD_DATA[data]
    bl, _ = _blist(*pcap)
    g = torch.Generator().manual_seed(11)
    fmt = LAYOUTS[layout]
    if c["src"] == "map":
        src = torch.randn(N, 5, H, W, generator=g, dtype=torch.float64).to(dtype).contiguous(memory_format=fmt)
    else:
        src = torch.randn(bl.capacity, 5, *c["extent"], generator=g, dtype=torch.float64).to(dtype)
        src = src.contiguous(memory_format=fmt)
    w = torch.randn(7, 5, c["k"], c["k"], generator=g, dtype=torch.float64).to(dtype)
    b = torch.randn(7, generator=g, dtype=torch.float64).to(dtype) if epilogue == "bias" else None
    relu, zero = epilogue == "relu-zero", ((4, 4), (0, 0), (H, W)) if epilogue == "relu-zero" else None
    oh = (c["extent"][0] - c["k"]) // c["stride"] + 1
    up = torch.randn(bl.capacity, 7, oh, oh, generator=g, dtype=torch.float64).to(dtype)
    up = torch.where(bl.valid.view(-1, 1, 1, 1), up, 0)

    def run(upstream):  # noqa: ANN001, ANN202
        args = [t.detach().clone().requires_grad_(True) for t in (src, w)] + (
            [b.detach().clone().requires_grad_(True)] if b is not None else [])
        out = fused.conv_blocks(args[0], bl, args[1], args[2] if b is not None else None, stride=c["stride"],
                                origin=c["origin"], extent=c["extent"] if c["origin"] else None, relu=relu, zero=zero)
        return torch.autograd.grad(out, args, upstream)

    (want, got) = _both(monkeypatch, lambda: run(up))
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e, **GRAD_TOL[dtype])
    if int(bl.count) < bl.capacity:
        nan_up = torch.where(bl.valid.view(-1, 1, 1, 1), up, float("nan"))
        for a, e in zip(run(nan_up), want, strict=True):
            torch.testing.assert_close(a, e, **GRAD_TOL[dtype])


SCATTER_DATA = {"float64-nhwc-some": (torch.float64, "nhwc", SOME), "bfloat16-nchw-all": (torch.bfloat16, "nchw", ALL),
                "float32-nhwc-none": (torch.float32, "nhwc", NONE)}
# make test: each residual kind once, every dtype among them; the slow run the product
SCATTER_QUICK = {("map", "float64-nhwc-some"), ("blocks", "bfloat16-nchw-all"), (None, "float32-nhwc-none")}


@pytest.mark.parametrize("residual,data", [
    pytest.param(r, d, id=f"{r}-{d}", marks=() if (r, d) in SCATTER_QUICK else pytest.mark.slow)
    for r in ("map", "blocks", None) for d in SCATTER_DATA])
def test_fused_scatter_backward_equals_the_composition(residual, data, monkeypatch):
    """conv_scatter's backward on the kernel's path gives the composition's gradients of the blocks, the weight, the
    bias, the base map (kept outside the active tiles; at them the residual's share, or nothing where overwritten)
    and a residual tensor; tiles clipped at the bottom and right border."""
    dtype, layout, pcap = SCATTER_DATA[data]
    bl, _ = _blist(*pcap)
    g = torch.Generator().manual_seed(13)
    fmt = LAYOUTS[layout]

    def rand(*shape):  # noqa: ANN002, ANN202
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)

    a, w, b = rand(bl.capacity, 5, 6, 6).contiguous(memory_format=fmt), rand(4, 5, 3, 3), rand(4)
    base = rand(N, 4, H, W).contiguous(memory_format=fmt)
    res = rand(bl.capacity, 4, 4, 4) if residual == "blocks" else None
    up = rand(N, 4, H, W)
    relu = residual != "blocks"

    def run():  # noqa: ANN202
        args = [t.detach().clone().requires_grad_(True) for t in (a, w, b, base) + ((res,) if res is not None else ())]
        out = fused.conv_scatter(args[0], bl, args[1], args[2], args[3] * 1.0, tile=(4, 4),
                                 residual=args[4] if res is not None else residual, relu=relu)
        return (out.detach(), *torch.autograd.grad(out, args, up))

    want, got = _both(monkeypatch, run)
    for x, e in zip(got, want, strict=True):
        torch.testing.assert_close(x, e, **GRAD_TOL[dtype])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", list(GRAD_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_fused_backward_vs_composition(case, dtype, monkeypatch):
    """On the GPU (compiled triton): conv_blocks' fused backward against the composition's, random data, 48 rows."""
    monkeypatch.delenv("TRITON_INTERPRET")
    dev, c = torch.device("cuda"), GRAD_CASES[case]
    bl, _ = _blist(0.7, 48)
    bl = type(bl)(bl.indices.to(dev), bl.count.to(dev), bl.block)
    g = torch.Generator(device=dev).manual_seed(0)
    shape = (N, 32, H, W) if c["src"] == "map" else (bl.capacity, 32, *c["extent"])
    src = torch.randn(shape, generator=g, device=dev).to(dtype).contiguous(memory_format=torch.channels_last)
    w = torch.randn(48, 32, c["k"], c["k"], generator=g, device=dev).to(dtype) * 0.1
    oh = (c["extent"][0] - c["k"]) // c["stride"] + 1
    up = torch.where(bl.valid.view(-1, 1, 1, 1), torch.randn(bl.capacity, 48, oh, oh, generator=g, device=dev), 0)

    def run():  # noqa: ANN202
        args = [t.detach().clone().requires_grad_(True) for t in (src, w)]
        out = fused.conv_blocks(args[0], bl, args[1], None, stride=c["stride"], origin=c["origin"],
                                extent=c["extent"] if c["origin"] else None, relu=True)
        return torch.autograd.grad(out, args, up.to(dtype))

    want, got = _both(monkeypatch, run)
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a.float(), e.float(), rtol=3e-2, atol=3e-2 * float(e.abs().max()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("residual", ["map", "blocks"])
def test_gpu_fused_scatter_backward_vs_composition(residual, monkeypatch):
    """On the GPU (compiled triton): conv_scatter's fused backward against the composition's, random data."""
    monkeypatch.delenv("TRITON_INTERPRET")
    dev = torch.device("cuda")
    bl, _ = _blist(0.7, 48)
    bl = type(bl)(bl.indices.to(dev), bl.count.to(dev), bl.block)
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(bl.capacity, 48, 6, 6, generator=g, device=dev).contiguous(memory_format=torch.channels_last)
    w = torch.randn(32, 48, 3, 3, generator=g, device=dev) * 0.1
    base = torch.randn(N, 32, H, W, generator=g, device=dev).contiguous(memory_format=torch.channels_last)
    res = torch.randn(bl.capacity, 32, 4, 4, generator=g, device=dev) if residual == "blocks" else None
    up = torch.randn(N, 32, H, W, generator=g, device=dev)

    def run():  # noqa: ANN202
        args = [t.detach().clone().requires_grad_(True) for t in (a, w, base) + ((res,) if res is not None else ())]
        out = fused.conv_scatter(args[0], bl, args[1], None, args[2] * 1.0, tile=(4, 4),
                                 residual=args[3] if res is not None else residual, relu=True)
        return torch.autograd.grad(out, args, up)

    want, got = _both(monkeypatch, run)
    for x, e in zip(got, want, strict=True):
        torch.testing.assert_close(x, e, rtol=3e-2, atol=3e-2 * float(e.abs().max()))


def test_self_check_passes_the_kernels_and_refuses_a_wrong_or_failing_one(monkeypatch):
    """fused_backend's check of the kernels (run here on the CPU under the interpreter): the real kernels pass; a
    kernel whose output is off, or that raises, fails with one warning naming why, and the verdict is remembered
    per device and dtype."""
    dev = torch.device("cpu")
    monkeypatch.setattr(fused, "_CHECKED", {})
    assert fused.self_check(dev, torch.float32)
    real = triton_blocks.block_conv

    def off(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        return real(*args, **kwargs).add_(0.5)

    def raises(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("no kernel image is available for execution on the device")

    for broken, why in ((off, "output off by"), (raises, "RuntimeError: no kernel image")):
        monkeypatch.setattr(fused, "_CHECKED", {})
        monkeypatch.setattr(triton_blocks, "block_conv", broken)
        with pytest.warns(RuntimeWarning, match=why):
            assert not fused.self_check(dev, torch.float32)
        assert fused._CHECKED == {("cpu", torch.float32): False}
        assert not fused.self_check(dev, torch.float32)  # remembered: no second run, no second warning
    assert fused.fused_backend(dev) == "torch"  # the CPU takes the composition whatever the check says
