"""The CUDA kernels' host code and element bodies, run on the CPU (kernels/emulate/cuda_bodies.cpp).

``torch.ops.sbnet_emu.*`` are the CUDA files' own host plans (cuda/<op>.h) with each kernel launch run
serially on the host, calling the same elements.h body. Compared here with the pure-PyTorch reference
(its autograd for the adjoints) over both layouts, all four dtypes, every map border, halos and K = 0;
the adjoint's phase order is checked bit for bit against a hand-ordered float32 sum (and the CPU
kernel, which adds in the same order). Values are multiples of 1/4 that every dtype holds and adds
exactly, so every comparison is exact whatever the summation order, except where order is the point.
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from detector.ops import _library, calc_block_params, reference
from tests.ops import cases, cuda_emulation

DTYPES = cases.DTYPES
LAYOUTS = list(cases.LAYOUTS)
# halos of 2 (2 x 2 phases), stride 2, a 5 x 5 kernel (2 x 3 phases), and blocks larger than the map
CASES = ("halo2", "stride2", "k5-rect", "big-block")
GEOMETRIES = cases.select(*CASES)
N, C = 2, 3


@pytest.fixture(scope="module")
def emu():
    return cuda_emulation.load()


@pytest.fixture(params=["index32", "index64"])
def index(request, monkeypatch):
    """The bodies' index arithmetic: 32-bit (what every map here gets: its offsets fit) or forced 64-bit
    (SBNET_EMU_INDEX64=1; the CUDA kernels take it for maps of 2^31 elements or more)."""
    if request.param == "index64":
        monkeypatch.setenv("SBNET_EMU_INDEX64", "1")
    else:
        monkeypatch.delenv("SBNET_EMU_INDEX64", raising=False)
    return request.param


def _full_grid(bp) -> torch.Tensor:
    """Every block of the grid in both samples: blocks at every map border (and beyond it)."""
    rows = [(n, by, bx) for n in range(N) for by in range(bp.bcount_h) for bx in range(bp.bcount_w)]
    return torch.tensor(rows, dtype=torch.int32)


def _tile_bp(bp):
    """The scatter's tile grid as BlockParams for reference.sparse_gather: size = stride = obsize, offset 0."""
    return dataclasses.replace(bp, bsize_h=bp.obsize_h, bsize_w=bp.obsize_w, bstride_h=bp.obsize_h,
                               bstride_w=bp.obsize_w, boffset_h=0, boffset_w=0)


def _assert_same(actual: torch.Tensor, expected: torch.Tensor, layout: str) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert actual.is_contiguous(memory_format=cases.memory_format(layout)), actual.stride()
    assert torch.equal(actual, expected)


def _setup(geom):
    H, W, bsize, ksize, stride, padding = geom
    bp = calc_block_params(H, W, bsize, ksize, stride, padding)
    return bp, _full_grid(bp)


def test_schemas_are_those_of_the_sbnet_library(emu):
    """Both libraries define their schemas with kernels/schemas.h: the same 10 ops, the same signatures (the two
    region ops have no CUDA kernel, hence no emulated body)."""
    text = (cuda_emulation.KERNELS / "schemas.h").read_text()
    names = re.findall(r'm\.def\(\s*"(\w+)\(', text)
    assert len(names) == 10
    if not _library.load():
        pytest.skip("sbnet kernels not built")
    for name in names:
        ours = str(getattr(torch.ops.sbnet, name).default._schema)
        assert str(getattr(emu, name).default._schema).replace("sbnet_emu::", "sbnet::") == ours


@pytest.mark.parametrize("geom", cases.params(*CASES))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gather_and_its_adjoints(emu, index, geom, layout, dtype):
    bp, idx = _setup(geom)
    size = [N, C, bp.in_h, bp.in_w]
    x = cases.quarters(size, dtype, 1, layout)
    blocks = emu.sparse_gather(x, idx, bp.bsize, bp.bstride, bp.boffset)
    _assert_same(blocks, reference.sparse_gather(x, idx, bp), layout)

    g = cases.quarters(blocks.shape, dtype, 2, layout)
    x_ref = torch.zeros(size, dtype=dtype, requires_grad=True)
    reference.sparse_gather(x_ref, idx, bp).backward(g)
    grad = emu.sparse_gather_backward(g, idx, size, bp.bstride, bp.boffset, layout == "nhwc")
    _assert_same(grad, x_ref.grad, layout)

    acc = cases.quarters(size, dtype, 3, layout)
    expected = acc + x_ref.grad
    emu.sparse_gather_backward_(g, idx, acc, bp.bstride, bp.boffset)
    _assert_same(acc, expected, layout)


@pytest.mark.parametrize("geom", cases.params(*CASES))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scatter_write_add_relu_and_in_place(emu, index, geom, layout, dtype):
    bp, idx = _setup(geom)
    blocks = cases.quarters([idx.shape[0], C, bp.obsize_h, bp.obsize_w], dtype, 4, layout)
    base = cases.quarters([N, C, bp.out_h, bp.out_w], dtype, 5, layout)
    before = base.clone()
    for add in (False, True):
        for relu in (False, True):
            expected = reference.sparse_scatter(blocks, idx, base, bp, add, relu)
            out = emu.sparse_scatter(blocks, idx, base, bp.obsize, [0, 0], add, relu)
            _assert_same(out, expected, layout)
            assert torch.equal(base, before)  # the copying scatter leaves base alone
            inplace = base.clone()
            emu.sparse_scatter_(blocks, idx, inplace, bp.obsize, [0, 0], add, relu)
            _assert_same(inplace, expected, layout)


@pytest.mark.parametrize("geom", cases.params(*CASES))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scatter_backward_is_the_reference_gradient(emu, index, geom, layout, dtype):
    bp, idx = _setup(geom)
    blocks = cases.quarters([idx.shape[0], C, bp.obsize_h, bp.obsize_w], dtype, 6, layout).requires_grad_()
    base = cases.quarters([N, C, bp.out_h, bp.out_w], dtype, 7, layout).requires_grad_()
    grad_out = cases.quarters(base.shape, dtype, 8, layout)
    for add in (False, True):
        for relu in (False, True):
            out = reference.sparse_scatter(blocks, idx, base, bp, add, relu)
            exp_blocks, exp_base = torch.autograd.grad(out, (blocks, base), grad_out)
            tiles = reference.sparse_gather(out.detach(), idx, _tile_bp(bp))
            tiles = tiles.contiguous(memory_format=cases.memory_format(layout))
            args = (grad_out, idx, tiles if relu else None, bp.obsize, bp.obsize, [0, 0], add, relu)
            grad_blocks, grad_base = emu.sparse_scatter_backward(*args, True, True)
            _assert_same(grad_blocks, exp_blocks, layout)
            _assert_same(grad_base, exp_base, layout)
            only_blocks = emu.sparse_scatter_backward(*args, True, False)
            only_base = emu.sparse_scatter_backward(*args, False, True)
            assert only_blocks[1] is None and only_base[0] is None
            assert torch.equal(only_blocks[0], exp_blocks) and torch.equal(only_base[1], exp_base)


@pytest.mark.parametrize("geom", cases.params(*CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reduce_mask(emu, geom, dtype):
    bp, _ = _setup(geom)
    gen = torch.Generator().manual_seed(9)
    mask = ((torch.rand((N, 1, bp.in_h, bp.in_w), generator=gen) ** 4) * 8).floor().div(8).to(dtype)
    for avgpool in (False, True):
        for tol in (0.0, 0.125, 0.25, 0.5):  # means and maxima land exactly on these (strict >)
            expected = reference.reduce_mask(mask, bp, tol, avgpool)
            got = emu.reduce_mask(mask, bp.bsize, bp.bstride, bp.boffset, bp.bcount, tol, avgpool)
            assert got.dtype == torch.int32 and got.is_contiguous() and torch.equal(got, expected), (avgpool, tol)
            flags = emu.block_activity(mask, bp.bsize, bp.bstride, bp.boffset, bp.bcount, tol, avgpool)
            assert torch.equal(flags, reference.block_activity(mask, bp, tol, avgpool)), (avgpool, tol)
    cl = mask.contiguous(memory_format=torch.channels_last)
    assert torch.equal(emu.reduce_mask(cl, bp.bsize, bp.bstride, bp.boffset, bp.bcount, 0.1, True),
                       reference.reduce_mask(mask, bp, 0.1, True))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_k_zero(emu, layout):
    bp, _ = _setup(GEOMETRIES[0])
    idx = emu.reduce_mask(torch.zeros(N, 1, bp.in_h, bp.in_w), bp.bsize, bp.bstride, bp.boffset, bp.bcount, 0.5, False)
    assert idx.shape == (0, 3) and idx.dtype == torch.int32
    x = cases.quarters([N, C, bp.in_h, bp.in_w], torch.float32, 1, layout)
    blocks = emu.sparse_gather(x, idx, bp.bsize, bp.bstride, bp.boffset)
    assert blocks.shape == (0, C, *bp.bsize)
    grad = emu.sparse_gather_backward(blocks, idx, list(x.shape), bp.bstride, bp.boffset, layout == "nhwc")
    _assert_same(grad, torch.zeros_like(x), layout)
    tiles = x.new_zeros((0, C, *bp.obsize)).contiguous(memory_format=cases.memory_format(layout))
    _assert_same(emu.sparse_scatter(tiles, idx, x, bp.obsize, [0, 0], True, True), x, layout)
    gb, gbase = emu.sparse_scatter_backward(x, idx, tiles, bp.obsize, bp.obsize, [0, 0], False, True, True, True)
    assert gb.shape == tiles.shape
    _assert_same(gbase, x, layout)


def _phase_ordered_sum(g, idx, size, bp, reverse=False):
    """Gather's adjoint in float32, adding the blocks phase by phase (py, px) in row-major order (or the
    reverse). Blocks of one phase never overlap, so the order within a phase does not matter."""
    P, Q = math.ceil(bp.bsize_h / bp.bstride_h), math.ceil(bp.bsize_w / bp.bstride_w)
    phases = [(py, px) for py in range(P) for px in range(Q)]
    out = torch.zeros(size, dtype=torch.float32)
    for py, px in reversed(phases) if reverse else phases:
        for k, (n, by, bx) in enumerate(idx.tolist()):
            if by % P != py or bx % Q != px:
                continue
            top, left = bp.boffset_h + by * bp.bstride_h, bp.boffset_w + bx * bp.bstride_w
            y0, y1 = max(top, 0), min(top + bp.bsize_h, size[2])
            x0, x1 = max(left, 0), min(left + bp.bsize_w, size[3])
            if y0 < y1 and x0 < x1:
                out[n, :, y0:y1, x0:x1] += g[k, :, y0 - top:y1 - top, x0 - left:x1 - left]
    return out


def _cpu_kernel_adjoint():
    """The CPU kernel's sparse_gather_backward when built with the channels_last argument, else None."""
    if not _library.load() or "channels_last" not in str(torch.ops.sbnet.sparse_gather_backward.default._schema):
        return None
    return torch.ops.sbnet.sparse_gather_backward


@pytest.mark.parametrize("geom", cases.params(*CASES[:3]))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_adjoint_adds_in_phase_order_bit_for_bit(emu, geom, layout, monkeypatch):
    bp, idx = _setup(geom)
    size = [N, 4, bp.in_h, bp.in_w]
    gen = torch.Generator().manual_seed(10)
    g = torch.randn((idx.shape[0], 4, *bp.bsize), generator=gen).contiguous(memory_format=cases.memory_format(layout))
    got = emu.sparse_gather_backward(g, idx, size, bp.bstride, bp.boffset, layout == "nhwc")
    assert torch.equal(got, _phase_ordered_sum(g, idx, size, bp))
    # the data tells orders apart: adding the phases the other way round rounds differently
    assert not torch.equal(got, _phase_ordered_sum(g, idx, size, bp, reverse=True))
    # within one launch the elements' order does not matter (one writer per element per phase)
    monkeypatch.setenv("SBNET_EMU_REVERSE", "1")
    assert torch.equal(emu.sparse_gather_backward(g, idx, size, bp.bstride, bp.boffset, layout == "nhwc"), got)
    monkeypatch.delenv("SBNET_EMU_REVERSE")
    cpu = _cpu_kernel_adjoint()
    if cpu is None:
        pytest.skip(f"CPU kernels not built with the new schema: {_library.unavailable_reason('cpu')}")
    assert torch.equal(cpu(g, idx, size, bp.bstride, bp.boffset, layout == "nhwc"), got)


def test_scatter_launch_order_does_not_matter(emu, monkeypatch):
    bp, idx = _setup(GEOMETRIES[1])
    gen = torch.Generator().manual_seed(11)
    blocks = torch.randn((idx.shape[0], C, *bp.obsize), generator=gen)
    base = torch.randn((N, C, bp.out_h, bp.out_w), generator=gen)
    args = (blocks, idx, base, bp.obsize, [0, 0], True, True)
    first = emu.sparse_scatter(*args)
    monkeypatch.setenv("SBNET_EMU_REVERSE", "1")
    assert torch.equal(emu.sparse_scatter(*args), first)


def test_bad_input_names_the_op_and_argument(emu):
    bp, idx = _setup(GEOMETRIES[0])
    x = torch.zeros(N, C, bp.in_h, bp.in_w)
    geo = (bp.bsize, bp.bstride, bp.boffset)
    tile = (bp.obsize, bp.obsize, [0, 0])  # (tile, bstride, boffset); scatter takes tile[1:]
    sc = tile[1:]
    blocks = torch.zeros(idx.shape[0], C, *bp.obsize)
    base = torch.zeros(N, C, bp.out_h, bp.out_w)
    cases = [
        (lambda: emu.sparse_gather(x.transpose(2, 3), idx, *geo), r"sparse_gather: x must be contiguous in NCHW"),
        (lambda: emu.sparse_gather(x.int(), idx, *geo), r"sparse_gather: x must be float16, bfloat16"),
        (lambda: emu.sparse_gather(x, idx.long(), *geo), r"sparse_gather: indices must be int32"),
        (lambda: emu.sparse_gather(x[0], idx, *geo), r"sparse_gather: x must be 4-D"),
        (lambda: emu.sparse_gather(x, idx, [0, 3], bp.bstride, bp.boffset), r"block size must be positive"),
        (lambda: emu.sparse_scatter(blocks.contiguous(memory_format=torch.channels_last), idx, base, *sc, True),
         r"sparse_scatter: blocks must be NCHW-contiguous like its map"),
        (lambda: emu.sparse_scatter_(blocks.double(), idx, base, *sc, True), r"sparse_scatter_: blocks .* dtype"),
        (lambda: emu.sparse_scatter(blocks[:-1], idx, base, *sc, True), r"sparse_scatter: blocks .* does not match"),
        (lambda: emu.sparse_scatter(blocks, idx, base, [1, 1], [0, 0], True), r"sparse_scatter: tiles .* overlap"),
        (lambda: emu.sparse_gather_backward(blocks, idx, [N, C, 5], *tile[1:]), r"input_size must be 4 sizes"),
        (lambda: emu.sparse_gather_backward(blocks, idx, [N, C + 1, 5, 5], *tile[1:]),
         r"sparse_gather_backward: grad_blocks .* does not match"),
        (lambda: emu.sparse_gather_backward(blocks, idx, list(base.shape), *sc, True),
         r"sparse_gather_backward: grad_blocks must be channels-last"),
        (lambda: emu.sparse_gather_backward_(blocks, idx, base.transpose(0, 1), *tile[1:]),
         r"sparse_gather_backward_: grad_x must be contiguous"),
        (lambda: emu.sparse_scatter_backward(base, idx, None, *tile, True, True, True, True),
         r"sparse_scatter_backward: out_tiles .* is required with relu"),
        (lambda: emu.sparse_scatter_backward(base, idx, blocks[:, :, :1], *tile, True, True, True, True),
         r"sparse_scatter_backward: out_tiles .* does not match the tile"),
    ]
    for call, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call()


@pytest.mark.parametrize("geom", cases.params(*CASES))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_emulated_ops_equal_the_cpu_kernels(emu, geom, layout):
    """Two implementations of one semantics (row-copying CPU kernels, element-wise CUDA bodies): equal bit
    for bit on random float32 data, every op."""
    cpu = _cpu_kernel_adjoint()
    if cpu is None:
        pytest.skip(f"CPU kernels not built with the new schema: {_library.unavailable_reason('cpu')}")
    sb = torch.ops.sbnet
    bp, idx = _setup(geom)
    gen = torch.Generator().manual_seed(14)

    def rand(*shape):
        return torch.randn(shape, generator=gen).contiguous(memory_format=cases.memory_format(layout))

    x, g = rand(N, C, bp.in_h, bp.in_w), rand(idx.shape[0], C, *bp.bsize)
    geo = (bp.bsize, bp.bstride, bp.boffset)
    assert torch.equal(emu.sparse_gather(x, idx, *geo), sb.sparse_gather(x, idx, *geo))
    acc_emu, acc_cpu = x.clone(), x.clone()
    emu.sparse_gather_backward_(g, idx, acc_emu, *geo[1:])
    sb.sparse_gather_backward_(g, idx, acc_cpu, *geo[1:])
    assert torch.equal(acc_emu, acc_cpu)
    tiles, base = rand(idx.shape[0], C, *bp.obsize), rand(N, C, bp.out_h, bp.out_w)
    for add in (False, True):
        for relu in (False, True):
            sc = (bp.obsize, [0, 0], add, relu)
            out = emu.sparse_scatter(tiles, idx, base, *sc)
            assert torch.equal(out, sb.sparse_scatter(tiles, idx, base, *sc))
            b_emu, b_cpu = base.clone(), base.clone()
            emu.sparse_scatter_(tiles, idx, b_emu, *sc)
            sb.sparse_scatter_(tiles, idx, b_cpu, *sc)
            assert torch.equal(b_emu, b_cpu)
            out_tiles = emu.sparse_gather(out, idx, bp.obsize, bp.obsize, [0, 0])
            args = (base, idx, out_tiles, bp.obsize, bp.obsize, [0, 0], add, relu, True, True)
            for a, b in zip(emu.sparse_scatter_backward(*args), sb.sparse_scatter_backward(*args), strict=True):
                assert torch.equal(a, b)
    mask = torch.rand((N, 1, bp.in_h, bp.in_w), generator=gen, dtype=torch.float64)
    for avgpool in (False, True):
        args = (mask, bp.bsize, bp.bstride, bp.boffset, bp.bcount, 0.5, avgpool)
        assert torch.equal(emu.reduce_mask(*args), sb.reduce_mask(*args))
        assert torch.equal(emu.block_activity(*args), sb.block_activity(*args))
