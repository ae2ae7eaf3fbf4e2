"""Channels-last gather/scatter (detector.nn.layout) vs the detector.ops reference semantics."""

from __future__ import annotations

import pytest
import torch

from detector.nn.layout import gather_blocks, is_nhwc, scatter_blocks, zeros_like_layout
from detector.ops.blocks import calc_block_params
from detector.ops.functional import sparse_gather, sparse_scatter

CL = torch.channels_last
GEOMETRIES = [  # bsize, ksize, stride, padding
    (6, 3, 1, 1),
    (8, 5, 1, 2),
    (9, 3, 2, 1),
    (13, 7, 2, 3),
    (4, 1, 1, 0),
]


def gid(g) -> str:
    return "b{}k{}s{}p{}".format(*g)


def random_indices(bp, N, seed=0, frac=0.6):
    g = torch.Generator().manual_seed(seed)
    on = torch.rand(N * bp.num_blocks, generator=g) < frac
    on[0] = on[-1] = True  # include the first and the last (border) block
    lin = on.nonzero().flatten()
    n, r = lin // bp.num_blocks, lin % bp.num_blocks
    return torch.stack([n, r // bp.bcount_w, r % bp.bcount_w], 1).to(torch.int32)


@pytest.mark.parametrize("geo", GEOMETRIES, ids=gid)
def test_gather_nhwc_equals_op_values_and_gradient(geo):
    N, C, H, W = 2, 5, 11, 13
    bp = calc_block_params(H, W, *geo)
    idx = random_indices(bp, N)
    x = torch.randn(N, C, H, W, dtype=torch.float64)
    xl = x.contiguous(memory_format=CL).requires_grad_(True)
    xr = x.clone().requires_grad_(True)
    got, ref = gather_blocks(xl, idx, bp), sparse_gather(xr, idx, bp)
    assert got.is_contiguous(memory_format=CL)
    torch.testing.assert_close(got, ref, atol=0, rtol=0)
    g = torch.randn_like(ref)
    got.backward(g)
    ref.backward(g)
    torch.testing.assert_close(xl.grad, xr.grad, atol=1e-12, rtol=0)


@pytest.mark.parametrize("add", [False, True], ids=["write", "add"])
@pytest.mark.parametrize("geo", GEOMETRIES, ids=gid)
def test_scatter_nhwc_equals_op_values_and_gradients(geo, add):
    N, C, H, W = 2, 4, 11, 13
    bp = calc_block_params(H, W, *geo)
    idx = random_indices(bp, N, seed=1)
    blocks = torch.randn(idx.shape[0], C, bp.obsize_h, bp.obsize_w, dtype=torch.float64)
    base = torch.randn(N, C, bp.out_h, bp.out_w, dtype=torch.float64)
    bl = blocks.contiguous(memory_format=CL).requires_grad_(True)
    basel = base.contiguous(memory_format=CL).requires_grad_(True)
    br, baser = blocks.clone().requires_grad_(True), base.clone().requires_grad_(True)
    got = scatter_blocks(bl, idx, basel, bp, add=add, inplace=False)
    ref = sparse_scatter(br, idx, baser, bp, add=add)
    assert is_nhwc(got)
    torch.testing.assert_close(got, ref, atol=0, rtol=0)
    g = torch.randn_like(ref)
    got.backward(g)
    ref.backward(g)
    torch.testing.assert_close(bl.grad, br.grad, atol=0, rtol=0)
    torch.testing.assert_close(basel.grad, baser.grad, atol=0, rtol=0)
    with torch.no_grad():  # in place (inference)
        into = base.contiguous(memory_format=CL)
        assert scatter_blocks(blocks, idx, into, bp, add=add, inplace=True) is into
        torch.testing.assert_close(into, ref.detach(), atol=0, rtol=0)


def test_nchw_maps_go_through_the_ops_and_give_channels_last_blocks():
    bp = calc_block_params(9, 9, 6, 3, 1, 1)
    x = torch.randn(1, 3, 9, 9)
    idx = random_indices(bp, 1)
    got = gather_blocks(x, idx, bp)
    assert got.is_contiguous(memory_format=CL)
    torch.testing.assert_close(got, sparse_gather(x, idx, bp), atol=0, rtol=0)
    z = zeros_like_layout(x.contiguous(memory_format=CL), (2, 4, 5, 5))
    assert is_nhwc(z) and z.shape == (2, 4, 5, 5) and not z.any()
    assert not is_nhwc(zeros_like_layout(x, (2, 4, 5, 5)))


@pytest.mark.parametrize("grad_layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("mode", ["write", "add", "add_relu"])
def test_residual_blocks_equal_separate_gather_and_scatter(mode, grad_layout):
    """The fused residual gather/scatter: same values and gradients, and the output gradient untouched."""
    from detector.nn.layout import ResidualBlocks

    torch.manual_seed(0)
    bp = calc_block_params(9, 7, bsize=6, ksize=5, stride=1, padding=2)
    idx = random_indices(bp, 2, seed=2)
    x = torch.randn(2, 3, 9, 7, dtype=torch.float64).contiguous(memory_format=CL).requires_grad_(True)
    w = torch.randn(3, 3, 5, 5, dtype=torch.float64, requires_grad=True)

    def fused():
        rb = ResidualBlocks(x, idx, bp, bp)
        return rb.scatter(torch.nn.functional.conv2d(rb.gather(), w), mode)

    def separate():
        xb = gather_blocks(x, idx, bp)
        tiles = torch.nn.functional.conv2d(xb, w)
        if mode == "add_relu":  # relu(x + tile) on the tiles: x's tile pixels are the blocks' centres
            tiles = torch.relu(tiles + xb[:, :, 2:-2, 2:-2])
        return scatter_blocks(tiles, idx, x, bp, add=mode == "add", inplace=False)

    yf, ys = fused(), separate()
    torch.testing.assert_close(yf, ys, atol=0, rtol=0)
    v = torch.randn(yf.shape, dtype=torch.float64)
    if grad_layout == "nhwc":
        v = v.contiguous(memory_format=CL)
    v0 = v.clone()
    gf = torch.autograd.grad(yf, [x, w], v)
    gs = torch.autograd.grad(ys, [x, w], v)
    for a, b in zip(gf, gs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    assert torch.equal(v, v0)


def test_workspace_reuse_gives_the_same_blocks():
    """Gathering into a reused (and growing) workspace: each result equals a fresh gather while alive."""
    from detector.nn.layout import Workspace

    ws = Workspace()
    bp = calc_block_params(11, 13, 6, 3, 1, 1)
    x = torch.randn(2, 5, 11, 13).contiguous(memory_format=CL)
    for frac, seed in ((0.2, 0), (0.9, 1), (0.4, 2)):
        idx = random_indices(bp, 2, seed=seed, frac=frac)
        with torch.no_grad():
            got = gather_blocks(x, idx, bp, ws)
        torch.testing.assert_close(got, sparse_gather(x.contiguous(), idx, bp), atol=0, rtol=0)
    xr = x.clone().requires_grad_(True)  # with autograd the workspace is not used
    assert gather_blocks(xr, idx, bp, ws).data_ptr() != ws.rows(1, 5, x).data_ptr()
