"""Semantics of the sparse-block ops against brute-force per-pixel oracles and dense convolution.

Each test runs twice: on the pure-PyTorch reference (``detector.ops.reference``) and on the public
functions (``detector.ops``: the compiled kernels where they are built, else the reference).
"""

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import detector.ops as ops
from detector.ops import calc_block_params, reference
from tests.ops import cases


class _Public:
    reduce_mask = staticmethod(ops.reduce_mask)
    block_activity = staticmethod(ops.block_activity)
    sparse_gather = staticmethod(ops.sparse_gather)
    sparse_scatter = staticmethod(ops.sparse_scatter)
    sparse_scatter_ = staticmethod(ops.sparse_scatter_)


@pytest.fixture(params=["reference", "public"])
def impl(request):
    return reference if request.param == "reference" else _Public


CASES = ("halo2", "square", "big-block", "stride2", "k5", "1x1", "rect-kernel")
GEOMETRIES = cases.select(*CASES)  # a geometry's position here seeds its data


# ------------------------------------------------------------------------------ brute-force oracles
def oracle_reduce_mask(mask: np.ndarray, bp, tol: float, avgpool: bool) -> list[tuple[int, int, int]]:
    """Per pixel: add it to every block whose window contains it; then threshold per block."""
    N, _, H, W = mask.shape
    best = np.full((N, bp.bcount_h, bp.bcount_w), -np.inf)
    total = np.zeros((N, bp.bcount_h, bp.bcount_w))
    count = np.zeros((N, bp.bcount_h, bp.bcount_w))
    for n, y, x in itertools.product(range(N), range(H), range(W)):
        for by, bx in itertools.product(range(bp.bcount_h), range(bp.bcount_w)):
            top, left = bp.boffset_h + by * bp.bstride_h, bp.boffset_w + bx * bp.bstride_w
            if top <= y < top + bp.bsize_h and left <= x < left + bp.bsize_w:
                v = float(mask[n, 0, y, x])
                best[n, by, bx] = max(best[n, by, bx], v)
                total[n, by, bx] += v
                count[n, by, bx] += 1
    value = np.where(count > 0, total / np.maximum(count, 1), -np.inf) if avgpool else best
    return [tuple(int(i) for i in t) for t in np.argwhere((count > 0) & (value > tol))]


def oracle_gather(x: np.ndarray, idx: list, bp) -> np.ndarray:
    N, C, H, W = x.shape
    out = np.zeros((len(idx), C, bp.bsize_h, bp.bsize_w), dtype=x.dtype)
    for k, (n, by, bx) in enumerate(idx):
        for i, j in itertools.product(range(bp.bsize_h), range(bp.bsize_w)):
            y, xx = bp.boffset_h + by * bp.bstride_h + i, bp.boffset_w + bx * bp.bstride_w + j
            if 0 <= y < H and 0 <= xx < W:
                out[k, :, i, j] = x[n, :, y, xx]
    return out


def oracle_scatter(blocks: np.ndarray, idx: list, base: np.ndarray, bp, add: bool) -> np.ndarray:
    """Per output pixel: which block's tile holds it (tiles partition the map)."""
    where = {tuple(r): k for k, r in enumerate(idx)}
    out = base.copy()
    N, _, Ho, Wo = base.shape
    for n, y, x in itertools.product(range(N), range(Ho), range(Wo)):
        k = where.get((n, y // bp.obsize_h, x // bp.obsize_w))
        if k is not None:
            tile = blocks[k, :, y % bp.obsize_h, x % bp.obsize_w]
            out[n, :, y, x] = out[n, :, y, x] + tile if add else tile
    return out


def random_indices(N: int, bp, frac: float, gen: torch.Generator) -> torch.Tensor:
    active = torch.rand((N, bp.bcount_h, bp.bcount_w), generator=gen) < frac
    return active.nonzero().to(torch.int32)


# ---------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("geom", cases.params(*CASES))
@pytest.mark.parametrize("avgpool", [False, True])
def test_reduce_mask_and_block_activity_match_brute_force(impl, geom, avgpool):
    """reduce_mask lists exactly the blocks the rule activates; block_activity flags exactly those (one flag per
    block of the grid) and its sum counts them."""
    H, W, bsize, ksize, stride, padding = geom
    bp = calc_block_params(H, W, bsize, ksize, stride, padding)
    gen = torch.Generator().manual_seed(10 * GEOMETRIES.index(geom) + avgpool)
    # quarter steps: means are exact in float64, so the comparison with tol is exact too
    mask = (torch.rand((2, 1, H, W), generator=gen) ** 3 * 4).floor() / 4
    for tol in (0.0, 0.2, 0.5):
        expected = oracle_reduce_mask(mask.numpy(), bp, tol, avgpool)
        got = impl.reduce_mask(mask, bp, tol, avgpool)
        assert got.dtype == torch.int32 and got.shape[1] == 3
        assert [tuple(r) for r in got.tolist()] == expected
        flags = impl.block_activity(mask, bp, tol, avgpool)
        assert flags.dtype == torch.bool and flags.shape == (2, bp.bcount_h, bp.bcount_w)
        assert [tuple(r) for r in flags.nonzero().tolist()] == expected
        assert int(flags.sum()) == len(expected)


def test_block_activity_by_hand(impl):
    """A 6 x 6 map, 4 x 4 blocks with a halo of 1 (ksize 3): block b covers pixels -1 + 2b .. 2 + 2b, three per
    axis. One hot pixel at (row 4, column 1): rows 4 lie in block rows 1 (1..4) and 2 (3..6), column 1 in block
    columns 0 (-1..2) and 1 (1..4), so exactly those four blocks are active."""
    bp = calc_block_params(6, 6, bsize=4, ksize=3)
    assert (bp.bcount_h, bp.bcount_w, bp.boffset_h, bp.bstride_h, bp.bsize_h) == (3, 3, -1, 2, 4)
    mask = torch.zeros((1, 1, 6, 6))
    mask[0, 0, 4, 1] = 1.0
    expected = torch.zeros((1, 3, 3), dtype=torch.bool)
    expected[0, 1:3, 0:2] = True
    assert torch.equal(impl.block_activity(mask, bp, 0.5), expected)


def test_reduce_mask_mean_ignores_out_of_map_pixels(impl):
    # a border block whose in-map part is all ones has mean 1 (padding pixels are not counted)
    bp = calc_block_params(8, 8, bsize=6, ksize=3, stride=1, padding=1)
    mask = torch.zeros((1, 1, 8, 8))
    mask[0, 0, :5, :5] = 1.0  # block (0, 0) reads rows/cols -1..4: its in-map part is rows/cols 0..4
    got = impl.reduce_mask(mask, bp, 0.99, True).tolist()
    assert [0, 0, 0] in got


def test_reduce_mask_strict_threshold_and_empty(impl):
    bp = calc_block_params(10, 10, bsize=6, ksize=3)
    mask = torch.full((3, 1, 10, 10), 0.5)
    assert impl.reduce_mask(mask, bp, 0.5, False).shape == (0, 3)  # strictly greater than tol
    assert impl.reduce_mask(mask, bp, 0.49, False).shape == (3 * bp.num_blocks, 3)


@pytest.mark.parametrize("geom", cases.params(*CASES))
def test_gather_matches_brute_force(impl, geom):
    H, W, bsize, ksize, stride, padding = geom
    bp = calc_block_params(H, W, bsize, ksize, stride, padding)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn((2, 3, H, W), generator=gen)
    idx = random_indices(2, bp, 0.6, gen)
    got = impl.sparse_gather(x, idx, bp)
    assert got.shape == (idx.shape[0], 3, bp.bsize_h, bp.bsize_w)
    np.testing.assert_array_equal(got.numpy(), oracle_gather(x.numpy(), idx.tolist(), bp))


@pytest.mark.parametrize("geom", cases.params(*CASES))
@pytest.mark.parametrize("add", [True, False])
def test_scatter_matches_brute_force(impl, geom, add):
    H, W, bsize, ksize, stride, padding = geom
    bp = calc_block_params(H, W, bsize, ksize, stride, padding)
    gen = torch.Generator().manual_seed(2)
    idx = random_indices(2, bp, 0.6, gen)
    blocks = torch.randn((idx.shape[0], 3, bp.obsize_h, bp.obsize_w), generator=gen)
    base = torch.randn((2, 3, bp.out_h, bp.out_w), generator=gen)
    expected = oracle_scatter(blocks.numpy(), idx.tolist(), base.numpy(), bp, add)
    got = impl.sparse_scatter(blocks, idx, base, bp, add)
    np.testing.assert_array_equal(got.numpy(), expected)
    inplace = base.clone()
    assert impl.sparse_scatter_(blocks, idx, inplace, bp, add) is inplace
    np.testing.assert_array_equal(inplace.numpy(), expected)


@pytest.mark.parametrize("geom", cases.params(*CASES))
def test_sparse_conv_equals_dense_conv_on_active_tiles(impl, geom):
    """gather -> VALID conv -> scatter(add=False) equals the dense conv on active tiles, base elsewhere;
    with every block active it equals the dense conv everywhere."""
    H, W, bsize, ksize, stride, padding = geom
    bp = calc_block_params(H, W, bsize, ksize, stride, padding)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn((2, 3, H, W), generator=gen, dtype=torch.float64)
    w = torch.randn((4, 3, bp.ksize_h, bp.ksize_w), generator=gen, dtype=torch.float64)
    dense = F.conv2d(x, w, stride=bp.stride, padding=bp.padding)
    base = torch.zeros_like(dense)
    for frac in (0.5, 1.0):
        idx = random_indices(2, bp, frac, gen)
        y = impl.sparse_scatter(F.conv2d(impl.sparse_gather(x, idx, bp), w, stride=bp.stride), idx, base, bp,
                                False)
        covered = torch.zeros_like(dense, dtype=torch.bool)
        oh, ow = bp.obsize
        for n, by, bx in idx.tolist():
            covered[n, :, by * oh:(by + 1) * oh, bx * ow:(bx + 1) * ow] = True
        torch.testing.assert_close(y[covered], dense[covered], rtol=1e-12, atol=1e-12)
        assert (y[~covered] == 0).all()
        if frac == 1.0:
            assert covered.all()
