"""SparseBlockConv2d vs its dense twin (nn.Conv2d with the same parameters)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from detector.nn.chain import ActiveBlocks
from detector.nn.sparse_conv import SparseBlockConv2d

ATOL = 1e-10
N, C, H, W = 2, 5, 13, 11

CONFIGS = [  # kernel, stride, padding, bias
    (3, 1, 1, True),
    (3, 2, 1, False),
    (1, 1, 0, True),
    (5, 1, 2, True),
    (3, 1, 0, True),  # VALID-padded dense twin
]


def cid(c) -> str:
    return f"k{c[0]}s{c[1]}p{c[2]}{'b' if c[3] else ''}"


def make_conv(c, block_size=4, **kw) -> SparseBlockConv2d:
    torch.manual_seed(0)
    k, s, p, b = c
    return SparseBlockConv2d(C, 7, k, stride=s, padding=p, bias=b, block_size=block_size, **kw).double()


def tiles(blocks: ActiveBlocks, shape) -> torch.Tensor:
    bp = blocks.block
    grid = torch.zeros(shape[0], bp.bcount_h, bp.bcount_w, dtype=torch.float64)
    i = blocks.indices.long()
    grid[i[:, 0], i[:, 1], i[:, 2]] = 1
    m = grid.repeat_interleave(bp.obsize_h, 1).repeat_interleave(bp.obsize_w, 2)
    return m[:, None, : shape[2], : shape[3]]


def random_blocks(conv, frac=0.5, seed=1) -> ActiveBlocks:
    bp = conv.block_params(H, W)
    g = torch.Generator().manual_seed(seed)
    on = torch.rand(N * bp.num_blocks, generator=g) < frac
    on[0], on[-1] = True, False
    lin = on.nonzero().flatten()
    n, r = lin // bp.num_blocks, lin % bp.num_blocks
    idx = torch.stack([n, r // bp.bcount_w, r % bp.bcount_w], 1).to(torch.int32)
    return ActiveBlocks(indices=idx, block=bp)


def test_is_an_nn_conv2d_with_the_same_state_dict():
    conv = make_conv(CONFIGS[0])
    plain = torch.nn.Conv2d(C, 7, 3, padding=1).double()
    plain.load_state_dict(conv.state_dict())
    x = torch.randn(N, C, H, W, dtype=torch.float64)
    torch.testing.assert_close(conv(x), plain(x), atol=0, rtol=0)


@pytest.mark.parametrize("with_base", [False, True], ids=["zeros", "base"])
@pytest.mark.parametrize("c", CONFIGS, ids=cid)
def test_all_ones_equals_dense(c, with_base):
    conv = make_conv(c)
    x = torch.randn(N, C, H, W, dtype=torch.float64, requires_grad=True)
    yd = F.conv2d(x, conv.weight, conv.bias, conv.stride, conv.padding)
    base = torch.randn_like(yd) if with_base else None
    ys = conv(x, mask=torch.ones(N, 1, H, W), base=base)
    torch.testing.assert_close(ys, yd + (base if with_base else 0), atol=ATOL, rtol=0)


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("c", CONFIGS, ids=cid)
def test_random_blocks_active_tiles_and_gradients(c, layout):
    conv = make_conv(c)
    twin = copy.deepcopy(conv)
    blocks = random_blocks(conv)
    fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format
    x = torch.randn(N, C, H, W, dtype=torch.float64).contiguous(memory_format=fmt).requires_grad_(True)
    xd = x.detach().clone().requires_grad_(True)
    yd = twin(xd)
    base = torch.randn_like(yd).contiguous(memory_format=fmt).requires_grad_(True)
    based = base.detach().clone().requires_grad_(True)
    ys = conv(x, base=base, blocks=blocks)
    act = tiles(blocks, yd.shape)
    assert 0 < act.mean() < 1
    torch.testing.assert_close(ys * act, (yd + based) * act, atol=ATOL, rtol=0)
    torch.testing.assert_close(ys.detach() * (1 - act), base.detach() * (1 - act), atol=0, rtol=0)
    g = torch.randn_like(yd)
    ys.backward(g)
    # dense reference of the sparse semantics: base everywhere, conv on active tiles only
    (based + yd * act).backward(g)
    torch.testing.assert_close(x.grad, xd.grad, atol=ATOL, rtol=0)
    torch.testing.assert_close(base.grad, based.grad, atol=0, rtol=0)
    for p, pd in zip(conv.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, pd.grad, atol=ATOL, rtol=0)


@pytest.mark.parametrize("c", CONFIGS[:2], ids=cid)
def test_chunked_equals_unchunked(c):
    conv = make_conv(c)
    small = copy.deepcopy(conv)
    small.memory_budget_mb = 1e-6  # one block per chunk
    blocks = random_blocks(conv, frac=0.8)
    assert blocks.count > 2
    x = torch.randn(N, C, H, W, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y1, y2 = conv(x, blocks=blocks), small(x2, blocks=blocks)
    torch.testing.assert_close(y1, y2, atol=ATOL, rtol=0)
    g = torch.randn_like(y1)
    y1.backward(g)
    y2.backward(g)
    torch.testing.assert_close(x.grad, x2.grad, atol=ATOL, rtol=0)
    for p, p2 in zip(conv.parameters(), small.parameters(), strict=True):
        torch.testing.assert_close(p.grad, p2.grad, atol=ATOL, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(conv(x, blocks=blocks), small(x, blocks=blocks), atol=ATOL, rtol=0)


def test_empty_mask_returns_base():
    conv = make_conv(CONFIGS[0])
    x = torch.randn(N, C, H, W, dtype=torch.float64)
    y = conv(x, mask=torch.zeros(N, 1, H, W))
    assert y.shape == (N, 7, H, W) and torch.count_nonzero(y) == 0
    base = torch.randn(N, 7, H, W, dtype=torch.float64)
    assert conv(x, mask=torch.zeros(N, 1, H, W), base=base) is base


def test_gradcheck():
    torch.manual_seed(0)
    conv = SparseBlockConv2d(2, 3, 3, stride=2, block_size=2).double()
    x = torch.randn(1, 2, 7, 6, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(1, 1, 7, 6)
    mask[0, 0, 1, 1] = mask[0, 0, 5, 4] = 1
    names = [n for n, _ in conv.named_parameters()]

    def f(x_, *ps):
        return torch.func.functional_call(conv, dict(zip(names, ps, strict=True)), (x_,), {"mask": mask})

    params = [p.detach().clone().requires_grad_(True) for p in conv.parameters()]
    assert torch.autograd.gradcheck(f, (x, *params), eps=1e-6, atol=1e-6, fast_mode=True)


def test_bad_inputs():
    conv = make_conv(CONFIGS[0])
    x = torch.randn(N, C, H, W, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"SparseBlockConv2d: x must be \[N, 5, H, W\]"):
        conv(torch.randn(N, 4, H, W))
    with pytest.raises(ValueError, match="mask must be"):
        conv(x, mask=torch.ones(N, 1, H, W + 2))
    with pytest.raises(ValueError, match="base must have shape"):
        conv(x, mask=torch.ones(N, 1, H, W), base=torch.zeros(1, 7, H, W))
    with pytest.raises(ValueError, match="another geometry"):
        conv(x, blocks=random_blocks(make_conv(CONFIGS[0], block_size=3)))
