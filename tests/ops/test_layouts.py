"""The sbnet ops on channels-last maps, the fused relu scatter and the in-place scatter under autograd: values
against the reference, gradients by gradcheck in float64, and the raw ops' layout errors."""

import pytest
import torch

import detector.ops as ops
from detector.ops import _library, calc_block_params, reference
from tests.ops import cases

CL = torch.channels_last
CASES = ("halo2", "big-block", "stride2", "overlap3")
GEOMETRIES = cases.select(*CASES)  # a geometry's position here seeds its data


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if not _library.load():
        pytest.skip(f"sbnet kernels not available: {_library.unavailable_reason('cpu')}")


def _rand(shape, dtype, seed, fmt=torch.contiguous_format):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype).contiguous(memory_format=fmt)


def _is_cl(t):
    return t.is_contiguous(memory_format=CL) and not t.is_contiguous()


@pytest.mark.parametrize("geom", cases.params(*CASES))
@pytest.mark.parametrize("dtype", cases.DTYPES, ids=str)
def test_channels_last_ops_match_reference_and_keep_the_layout(geom, dtype):
    H, W, bsize, ksize, stride, padding = geom
    bp = calc_block_params(H, W, bsize, ksize, stride, padding)
    seed = GEOMETRIES.index(geom)
    N, C = 2, 6
    x = _rand((N, C, H, W), dtype, seed, CL)
    idx = cases.indices(bp, N, 0.6, seed)
    blocks = ops.sparse_gather(x, idx, bp)
    assert _is_cl(blocks) or idx.shape[0] == 0
    assert torch.equal(blocks, reference.sparse_gather(x.contiguous(), idx, bp))
    tiles = _rand((idx.shape[0], C, bp.obsize_h, bp.obsize_w), dtype, seed + 1, CL)
    base = _rand((N, C, bp.out_h, bp.out_w), dtype, seed + 2, CL)
    for add in (True, False):
        for relu in (False, True):
            expected = reference.sparse_scatter(tiles, idx, base.contiguous(), bp, add, relu)
            out = ops.sparse_scatter(tiles, idx, base, bp, add, relu)
            assert _is_cl(out) and torch.equal(out, expected)
            # NCHW tiles into a channels-last base: converted, same values
            assert torch.equal(ops.sparse_scatter(tiles.contiguous(), idx, base, bp, add, relu), expected)
            inplace = base.clone()
            assert ops.sparse_scatter_(tiles, idx, inplace, bp, add, relu) is inplace
            assert _is_cl(inplace) and torch.equal(inplace, expected)


@pytest.mark.parametrize("fmt", cases.FORMATS)
def test_relu_scatter_rule(fmt):
    """relu(base + tile) on the tiles (relu(tile) when written), base elsewhere, NaN kept as torch does."""
    bp = calc_block_params(8, 8, bsize=6, ksize=3)  # 4 x 4 tiles
    idx = torch.tensor([[0, 0, 1], [0, 1, 0]], dtype=torch.int32)
    base = torch.full((1, 2, 8, 8), 1.0).contiguous(memory_format=fmt)
    tiles = torch.full((2, 2, 4, 4), -3.0)
    tiles[0, :, 0, 0] = float("nan")
    tiles[1, :, 1, 1] = 0.5
    out = ops.sparse_scatter(tiles, idx, base, bp, add=True, relu=True)
    assert torch.isnan(out[0, :, 0, 4]).all()
    assert (out[0, :, 5, 1] == 1.5).all()
    assert out[0, :, 0, 5].eq(0).all() and out[0, :, 4:8, 0].eq(0).all() and out[0, :, 4, 2].eq(0).all()
    assert out[0, :, :4, :4].eq(1).all() and out[0, :, 4:, 4:].eq(1).all()  # inactive tiles keep base
    written = ops.sparse_scatter(tiles, idx, base, bp, add=False, relu=True)
    assert (written[0, :, 5, 1] == 0.5).all() and written[0, :, 4, 0].eq(0).all()


@pytest.mark.parametrize("fmt", cases.FORMATS)
@pytest.mark.parametrize("relu", [False, True])
def test_gradcheck_channels_last_and_inplace(fmt, relu):
    bp = calc_block_params(9, 8, bsize=(5, 4), ksize=3, stride=1, padding=1)
    idx = cases.indices(bp, 2, 0.6, 4)
    x = _rand((2, 3, 9, 8), torch.float64, 5, fmt).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: ops.sparse_gather(t, idx, bp), (x,))
    tiles = _rand((idx.shape[0], 3, bp.obsize_h, bp.obsize_w), torch.float64, 6, fmt)
    tiles = (tiles + 0.05 * tiles.sign()).requires_grad_()  # keep x + tile away from relu's kink
    base = _rand((2, 3, bp.out_h, bp.out_w), torch.float64, 7, fmt).requires_grad_()
    for add in (True, False):
        def copy(b, s, add=add):
            return ops.sparse_scatter(b, idx, s, bp, add, relu)

        def inplace(b, s, add=add):
            return ops.sparse_scatter_(b, idx, s * 1.0, bp, add, relu)  # s * 1.0: a non-leaf to write into

        for fn in (copy, inplace):
            assert torch.autograd.gradcheck(fn, (tiles, base))
            assert torch.autograd.gradgradcheck(fn, (tiles, base), fast_mode=True)


def test_inplace_scatter_is_caught_when_its_base_was_saved():
    """Autograd's version counter: writing into a map someone saved for backward fails loudly."""
    bp = calc_block_params(8, 8, bsize=6, ksize=3)
    idx = torch.tensor([[0, 0, 0]], dtype=torch.int32)
    x = torch.randn(1, 2, 8, 8, requires_grad=True)
    y = x * 1.0
    z = y * y  # saves y
    ops.sparse_scatter_(torch.randn(1, 2, 4, 4), idx, y, bp)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()


def test_raw_ops_reject_other_stride_patterns():
    bp = calc_block_params(12, 10, bsize=6, ksize=3)
    idx = torch.tensor([[0, 0, 0]], dtype=torch.int32)
    sliced = torch.randn(1, 6, 12, 20)[:, ::2, :, ::2]
    lib = torch.ops.sbnet
    with pytest.raises(RuntimeError, match="sbnet::sparse_gather: x must be contiguous in NCHW or channels-last"):
        lib.sparse_gather(sliced, idx, list(bp.bsize), list(bp.bstride), list(bp.boffset))
    base = torch.randn(1, 3, 12, 10).contiguous(memory_format=CL)
    with pytest.raises(RuntimeError, match="sbnet::sparse_scatter: blocks must be channels-last like its map"):
        lib.sparse_scatter(torch.randn(1, 3, 4, 4), idx, base, [4, 4], [0, 0], True, False)
    # the public function copies other patterns (out of place) and gives the reference's values
    assert torch.equal(ops.sparse_gather(sliced, idx, bp), reference.sparse_gather(sliced.contiguous(), idx, bp))


@pytest.mark.parametrize("dtype", cases.LOW_PRECISION, ids=str)
@pytest.mark.parametrize("inplace", [False, True])
def test_low_precision_backward_of_relu_scatter(dtype, inplace):
    """fp16/bf16 gradients of the relu scatter (copy and in place) against the reference op in the same dtype (the
    same rounding, so the same relu mask)."""
    bp = calc_block_params(20, 18, bsize=8, ksize=3, stride=1, padding=1)
    idx = cases.indices(bp, 2, 0.7, 16)
    tiles = _rand((idx.shape[0], 4, bp.obsize_h, bp.obsize_w), dtype, 17, CL)
    base = _rand((2, 4, 20, 18), dtype, 18, CL)
    g = _rand((2, 4, 20, 18), dtype, 19, CL)
    grads = []
    for op in (ops.sparse_scatter_ if inplace else ops.sparse_scatter, reference.sparse_scatter):
        t, b = tiles.clone().requires_grad_(), base.clone().requires_grad_()
        op(t, idx, b * 1.0, bp, True, True).backward(g)
        grads.append((t.grad, b.grad))
    for a, b in zip(*grads, strict=True):  # each element is g or 0: exact
        assert a.dtype == dtype and torch.equal(a, b)
