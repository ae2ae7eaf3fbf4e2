"""Block lists of a bounded capacity (detector.ops.capacity): the same blocks as reduce_mask, padding rows that are
distinct inactive blocks, the overflow flag, and a scatter that leaves the map unchanged at padding rows."""

from __future__ import annotations

import pytest
import torch

from detector.ops import calc_block_params, reduce_mask, sparse_scatter
from detector.ops.capacity import bucket_for, capacity_buckets, reduce_mask_capacity, scatter_padded


def _mask(n=2, h=23, w=19, p=0.9, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, 1, h, w, generator=g) > p).float()


@pytest.mark.parametrize("capacity", [0, 3, 9, 17, 40, 1000])
@pytest.mark.parametrize("p", [0.0, 0.93, 1.0])
def test_rows_are_reduce_mask_then_inactive_padding(capacity, p):
    mask = _mask(p=p)
    bp = calc_block_params(23, 19, bsize=6, ksize=3, stride=1, padding=1)
    exact = reduce_mask(mask, bp, tol=0.5)
    bl = reduce_mask_capacity(mask, bp, capacity, tol=0.5)
    total = 2 * bp.num_blocks
    k = exact.shape[0]
    assert bl.capacity == min(capacity, total) and bl.indices.dtype == torch.int32 and bl.indices.is_contiguous()
    assert int(bl.count) == k
    assert bool(bl.overflow) == (k > bl.capacity)
    used = min(k, bl.capacity)
    assert torch.equal(bl.indices[:used], exact[:used])  # the first active blocks, in reduce_mask's order
    assert torch.equal(bl.valid, torch.arange(bl.capacity) < k)
    rows = {tuple(r) for r in bl.indices.tolist()}
    assert len(rows) == bl.capacity  # unique: padding rows are distinct blocks
    active = {tuple(r) for r in exact.tolist()}
    assert not rows & active - set(map(tuple, exact[:used].tolist()))  # padding is never an active block
    assert all(0 <= n < 2 and 0 <= by < bp.bcount_h and 0 <= bx < bp.bcount_w for n, by, bx in rows)


def test_buckets():
    assert capacity_buckets(100) == (8, 16, 32, 64, 100)
    assert capacity_buckets(5) == (5,)
    assert bucket_for(0, 100) == 8 and bucket_for(17, 100) == 32 and bucket_for(100, 100) == 100
    with pytest.raises(ValueError):
        capacity_buckets(0)


@pytest.mark.parametrize("add,relu", [(True, False), (True, True), (False, False), (False, True)])
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("inplace", [False, True])
def test_scatter_padded_leaves_padding_rows_alone(add, relu, layout, inplace):
    g = torch.Generator().manual_seed(1)
    mask = _mask(p=0.99, seed=2)
    bp = calc_block_params(23, 19, bsize=6, ksize=3, stride=1, padding=1)
    bl = reduce_mask_capacity(mask, bp, 40)
    k = int(bl.count)
    assert 0 < k < 40
    base = torch.randn(2, 3, *bp.out_size, generator=g).contiguous(memory_format=layout)
    tiles = torch.randn(40, 3, *bp.obsize, generator=g)
    want = sparse_scatter(tiles[:k], bl.indices[:k], base, bp, add=add, relu=relu)
    got = scatter_padded(tiles, bl, base.clone(memory_format=layout), add=add, relu=relu, inplace=inplace)
    assert torch.equal(got, want)
