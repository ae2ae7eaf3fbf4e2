"""Sparse residual units vs their dense twins (detector.nn.resnet / detector.nn.chain).

The rule (DESIGN.md, "The mask defines the function"): given a binary mask ``M`` at the unit's input resolution
and ``M_out`` (``M`` max-pooled by the stride, ceil mode) at its output's, the unit computes
``where(M_out, unit(x), x)`` (identity shortcut) or ``where(M_out, unit(x), 0)`` (projection, none), ``unit`` being
the dense twin, whose training-mode batch norms take the statistics of their level's mask pixels (``M``
max-pooled by the level's stride). So:

- all-ones mask: the whole output, the running statistics and every gradient equal the dense unit's, in eval and
  in training mode;
- any mask: the output, every gradient and the running statistics equal ``dense_oracle`` below (written from the
  formulas: convolutions with zero padding, BN over the masked pixels, ReLU, shortcut, then the mask) - for every
  tile size and for the unit run dense with ``dense=True``: the tiles decide the time, never the values.
Everything in float64 so that the only differences are summation order.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from detector.nn.geometry import chain_geometry, level_masks, mask_at_stride
from detector.nn.resnet import SparseResidualUnit

ATOL = 1e-10

# (bottleneck, preact, stride, projection)
VARIANTS = [
    (b, p, s, proj)
    for b in (False, True)
    for p in (False, True)
    for s, proj in ((1, False), (1, True), (2, True))
]


def vid(v) -> str:
    b, p, s, proj = v
    return f"{'bottleneck' if b else 'basic'}-{'preact' if p else 'postact'}-s{s}-{'proj' if proj else 'id'}"


def make_unit(v, block_size=4, seed=0, **kw) -> SparseResidualUnit:
    b, p, s, proj = v
    torch.manual_seed(seed)
    cout = 6 if not proj else (10 if s == 1 else 8)
    u = SparseResidualUnit(
        6,
        cout,
        bottleneck=b,
        stride=s,
        preact=p,
        projection=proj,
        mid_channels=4,
        block_size=block_size,
        **kw,
    ).double()
    with torch.no_grad():  # non-trivial BN parameters and running statistics
        for bn in u.slots:
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
    return u


def random_mask(n, h, w, frac=0.12, seed=1) -> torch.Tensor:
    """[n, 1, h, w] float 0/1: scattered pixels and a 3x3 blob, so that tiles hold masked and unmasked pixels."""
    g = torch.Generator().manual_seed(seed)
    m = (torch.rand(n, 1, h, w, generator=g) < frac).double()
    m[0, 0, 5:8, 2:5] = 1.0
    return m


def pooled(mask: torch.Tensor, r: int) -> torch.Tensor:
    """The rule's mask at stride ``r``: max-pooled by ``r``, ceil mode."""
    return mask if r == 1 else F.max_pool2d(mask, r, r, ceil_mode=True)


def level_pixel_masks(u, mask: torch.Tensor) -> list[torch.Tensor]:
    """Per level of the unit's chain (input, after each conv): the mask at the level's stride."""
    r, out = 1, [mask]
    for c in u.convs:
        r *= c.stride[0]
        out.append(pooled(mask, r))
    return out


def masked_bn(z, bn, pm, record):
    """BatchNorm with training statistics over the pixels where ``pm`` is 1 (``pm`` None: all)."""
    if not (bn.training or not bn.track_running_stats):
        return F.batch_norm(z, bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.0, bn.eps)
    if pm is None:
        pm = torch.ones_like(z[:, :1])
    n = pm.sum() * 1.0
    mean = (z * pm).sum((0, 2, 3)) / n
    var = (((z - mean[None, :, None, None]) * pm) ** 2).sum((0, 2, 3)) / n
    record.append((bn, mean.detach(), var.detach(), int(n)))
    return (z - mean[None, :, None, None]) / torch.sqrt(var[None, :, None, None] + bn.eps) * bn.weight[
        None, :, None, None
    ] + bn.bias[None, :, None, None]


def dense_oracle(u, x, pms):
    """The unit's function with BN statistics over ``pms[level]`` (None entries: all pixels), the output kept where
    ``pms[-1]`` is set (``x`` or 0 elsewhere; no masks: the dense unit).

    Written from the unit's definition: convs with zero padding, BN, ReLU, shortcut. Returns the output
    and the expected running statistics after the step.
    """
    rec = []
    L = len(u.convs)
    conv = lambda c, a: F.conv2d(a, c.weight, None, c.stride, c.padding)  # noqa: E731
    if u.preact:
        a0 = F.relu(masked_bn(x, u.bns[0], pms[0], rec))
        a = a0
        for i in range(L - 1):
            a = F.relu(masked_bn(conv(u.convs[i], a), u.bns[i + 1], pms[i + 1], rec))
        out = conv(u.convs[L - 1], a)
        out = out + (x if u.shortcut == "identity" else conv(u.proj, a0))
    else:
        a = x
        for i in range(L):
            b = masked_bn(conv(u.convs[i], a), u.bns[i], pms[i + 1], rec)
            if i < L - 1:
                a = F.relu(b)
        sc = x if u.shortcut == "identity" else masked_bn(conv(u.proj, x), u.proj_bn, pms[L], rec)
        out = F.relu(b + sc)
    if pms[-1] is not None:
        out = torch.where(pms[-1] > 0, out, x if u.shortcut == "identity" else torch.zeros_like(out))
    expected = {}
    for bn, mean, var, n in rec:
        f = bn.momentum
        expected[id(bn)] = (
            (1 - f) * bn.running_mean + f * mean,
            (1 - f) * bn.running_var + f * var * n / (n - 1),
        )
    return out, expected


N, H, W = 2, 13, 11
LAYOUTS = [
    "nchw",
    "nhwc",
]  # both layouts go through the compiled ops natively
# the ways to run a unit: sparse at each tile size, and dense on the whole map
RUNS = [2, 3, 4, 8, "dense"]


def make_x(seed: int, layout: str, c: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """An input and an independent copy, both leaves requiring grad, in ``layout``."""
    torch.manual_seed(seed)
    x = torch.randn(N, c, H, W, dtype=torch.float64)
    if layout == "nhwc":
        x = x.contiguous(memory_format=torch.channels_last)
    return x.clone().requires_grad_(True), x.clone().requires_grad_(True)


def run(u, x, mask, how):
    """The unit on ``mask`` executed as ``how``: a tile size (sparse) or 'dense'."""
    if how == "dense":
        return u(x, mask=mask, dense=True)
    u.block_size = how
    return u(x, mask=mask)


# ------------------------------------------------------------------------------------- geometry
@pytest.mark.parametrize(
    "convs, tile, bsize, ksize, stride, padding",
    [
        (((3, 1, 1), (3, 1, 1)), 4, 8, 5, 1, 2),  # basic, stride 1
        (((3, 2, 1), (3, 1, 1)), 4, 13, 7, 2, 3),  # basic, stride 2
        (((1, 1, 0), (3, 1, 1), (1, 1, 0)), 16, 18, 3, 1, 1),  # bottleneck, stride 1
        (((1, 1, 0), (3, 2, 1), (1, 1, 0)), 8, 17, 3, 2, 1),  # bottleneck, stride 2
    ],
)
def test_chain_geometry_known_answers(convs, tile, bsize, ksize, stride, padding):
    from detector.nn.geometry import ConvSpec

    geo = chain_geometry(64, 48, tuple(ConvSpec(*c) for c in convs), tile)
    bp = geo.block
    assert (bp.bsize_h, bp.ksize_h, bp.stride_h, bp.padding_h) == (bsize, ksize, stride, padding)
    assert bp.bstride_h == tile * stride and bp.obsize_h == tile
    assert geo.levels[0].extent == (bsize, bsize) and geo.levels[-1].extent == (tile, tile)
    # dense output size of the chain
    assert bp.out_size == geo.levels[-1].map_size


@pytest.mark.parametrize("tile", [2, 3, 4, 8])
@pytest.mark.parametrize("v", VARIANTS, ids=vid)
def test_the_tiles_count_every_mask_pixel_of_every_level(v, tile):
    """The active tiles' regions hold every pixel of the mask at every level (so the statistics count all of them,
    once): the level's count is the mask's pixels there; an all-ones mask counts the whole map."""
    u = make_unit(v, block_size=tile)
    for mask in (torch.ones(N, 1, H, W, dtype=torch.float64), random_mask(N, H, W, seed=2)):
        blocks = u.active_blocks(mask)
        geo = u.geometry(H, W)
        for lv, pm in zip(geo.levels, level_pixel_masks(u, mask), strict=True):
            m = level_masks(blocks.indices, lv, mask_at_stride(u.binary(mask), lv.stride))
            assert tuple(pm.shape[2:]) == lv.map_size
            assert m.count == int(pm.sum())


# ------------------------------------------------------------------------- all-ones equals dense
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("v", VARIANTS, ids=vid)
def test_all_ones_mask_equals_dense(v, train, layout):
    u = make_unit(v).train(train)
    twin = copy.deepcopy(u)
    x, xd = make_x(2, layout)
    mask = torch.ones(N, 1, H, W, dtype=torch.float64)
    ys = u(x, mask=mask)
    yd = twin(xd)
    assert ys.shape == yd.shape
    torch.testing.assert_close(ys, yd, atol=ATOL, rtol=0)
    g = torch.randn_like(yd)
    ys.backward(g)
    yd.backward(g)
    torch.testing.assert_close(x.grad, xd.grad, atol=ATOL, rtol=0)
    for (name, p), pd in zip(u.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, pd.grad, atol=ATOL, rtol=0, msg=name)
    for (name, b), bd in zip(u.named_buffers(), twin.buffers(), strict=True):
        torch.testing.assert_close(b, bd, atol=ATOL, rtol=0, msg=name)
    if train:
        assert int(u.bns[0].num_batches_tracked) == 1


# ------------------------------------------------------------- a mask, every way of running it
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("v", VARIANTS, ids=vid)
def test_masked_unit_equals_the_oracle_whatever_the_tiles(v, train, layout):
    """Output, input and weight gradients and running statistics equal the oracle's, at every tile size and run
    dense: the same function every way."""
    mask = random_mask(N, H, W, seed=5)
    ref = make_unit(v).train(train)
    x_ref = make_x(4, layout)[0]
    yo, expected = dense_oracle(ref, x_ref, level_pixel_masks(ref, mask))
    g = torch.randn_like(yo)
    yo.backward(g)
    keep = pooled(mask, ref.stride)
    assert 0 < keep.mean() < 1
    for how in RUNS:
        u = make_unit(v).train(train)
        x = make_x(4, layout)[0]
        ys = run(u, x, mask, how)
        torch.testing.assert_close(ys, yo, atol=ATOL, rtol=0, msg=f"output, {how}")
        ys.backward(g)
        torch.testing.assert_close(x.grad, x_ref.grad, atol=ATOL, rtol=0, msg=f"input gradient, {how}")
        for (name, p), pr in zip(u.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, pr.grad, atol=ATOL, rtol=0, msg=f"{name}, {how}")
        for bn, bn_ref in zip(u.slots, ref.slots, strict=True):
            if train:
                rm, rv = expected[id(bn_ref)]
                torch.testing.assert_close(bn.running_mean, rm, atol=ATOL, rtol=0, msg=f"running mean, {how}")
                torch.testing.assert_close(bn.running_var, rv, atol=ATOL, rtol=0, msg=f"running var, {how}")
                assert int(bn.num_batches_tracked) == 1


def test_oracle_with_all_pixels_is_the_dense_unit():
    """The oracle itself: with no pixel masks it is the ordinary (nn.BatchNorm2d) training-mode unit."""
    for v in VARIANTS:
        u = make_unit(v).train()
        x = torch.randn(N, 6, H, W, dtype=torch.float64)
        yo, _ = dense_oracle(copy.deepcopy(u), x, [None] * (len(u.convs) + 1))
        torch.testing.assert_close(yo, u(x), atol=ATOL, rtol=0)


@pytest.mark.parametrize("stride", [1, 2])
def test_one_mask_pixel_activates_the_one_tile_that_holds_it(stride):
    """A tile is active if its output holds a pixel of the mask at the output resolution - not if only its halo or
    receptive field touches the mask - and the unit changes that one output pixel only."""
    v = (True, False, stride, stride == 2)
    u = make_unit(v, block_size=4).eval()
    mask = torch.zeros(1, 1, H, W, dtype=torch.float64)
    mask[0, 0, 4, 4] = 1.0  # output pixel (4, 4) at stride 1 (tile (1, 1)), (2, 2) at stride 2 (tile (0, 0))
    blocks = u.active_blocks(mask)
    assert blocks.indices.tolist() == ([[0, 1, 1]] if stride == 1 else [[0, 0, 0]])
    x = torch.randn(1, 6, H, W, dtype=torch.float64)
    y = u(x, mask=mask)
    torch.testing.assert_close(y, u(x, mask=mask, blocks=blocks), atol=0, rtol=0)
    base = x if u.shortcut == "identity" else torch.zeros_like(y)
    changed = (y != base).any(1)[0].nonzero().tolist()
    assert changed == ([[4, 4]] if stride == 1 else [[2, 2]])


# -------------------------------------------------------------------------------- K = 0
@pytest.mark.parametrize("v", VARIANTS, ids=vid)
def test_empty_mask(v):
    u = make_unit(v).train()
    before = copy.deepcopy(u.state_dict())
    x = torch.randn(N, 6, H, W, dtype=torch.float64, requires_grad=True)
    y = u(x, mask=torch.zeros(N, 1, H, W, dtype=torch.float64))
    if u.shortcut == "identity":
        torch.testing.assert_close(y, x, atol=0, rtol=0)
    else:
        bp = u.geometry(H, W).block
        assert torch.count_nonzero(y) == 0 and y.shape == (N, u.out_channels, bp.out_h, bp.out_w)
    for k, t in u.state_dict().items():  # no statistics from zero pixels
        assert torch.equal(t, before[k]), k
    if y.requires_grad:
        y.sum().backward()


# -------------------------------------------------------------------------------- gradcheck
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "v", [(True, False, 2, True), (False, True, 1, False), (True, False, 1, False)], ids=vid
)
def test_gradcheck_whole_unit(v, layout):
    torch.manual_seed(0)
    b, p, s, proj = v
    u = (
        SparseResidualUnit(
            3,
            3 if not proj else 4,
            bottleneck=b,
            stride=s,
            preact=p,
            projection=proj,
            mid_channels=2,
            block_size=2,
        )
        .double()
        .train()
    )
    h, w = 7, 6
    mask = random_mask(1, h, w, frac=0.3, seed=3)[:, :, :h, :w]
    blocks = u.active_blocks(mask)
    x = torch.randn(1, 3, h, w, dtype=torch.float64)
    if layout == "nhwc":
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_(True)
    names = [n for n, _ in u.named_parameters()]

    def f(x_, *ps):
        return torch.func.functional_call(u, dict(zip(names, ps, strict=True)), (x_,), {"mask": mask, "blocks": blocks})

    params = [q.detach().clone().requires_grad_(True) for q in u.parameters()]
    assert torch.autograd.gradcheck(f, (x, *params), eps=1e-6, atol=1e-6, fast_mode=True)


# -------------------------------------------------------------------------------- determinism
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("v", [(True, False, 2, True), (False, False, 1, False)], ids=vid)
def test_deterministic_bit_identical(v, layout):
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        results = []
        for _ in range(2):
            u = make_unit(v, seed=11).float().train()
            torch.manual_seed(12)
            x = torch.randn(N, 6, H, W)
            if layout == "nhwc":
                x = x.contiguous(memory_format=torch.channels_last)
            x.requires_grad_(True)
            mask = random_mask(N, H, W, seed=13).float()
            y = u(x, mask=mask, blocks=u.active_blocks(mask))
            y.backward(torch.ones_like(y))
            results.append([y.detach(), x.grad] + [p.grad for p in u.parameters()] + list(u.buffers()))
        for a, b in zip(*results, strict=True):
            assert torch.equal(a, b)
    finally:
        torch.use_deterministic_algorithms(prev)


# -------------------------------------------------------------------------------- bad input
def test_bad_inputs_raise_clear_errors():
    u = make_unit((True, False, 1, False))
    x = torch.randn(N, 6, H, W, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"SparseResidualUnit.*x must be \[N, 6, H, W\]"):
        u(torch.randn(N, 5, H, W, dtype=torch.float64))
    with pytest.raises(ValueError, match="mask must be"):
        u(x, mask=torch.ones(N, 1, H + 1, W))
    with pytest.raises(ValueError, match="another geometry"):
        other = make_unit((False, False, 1, False))
        ones = torch.ones(N, 1, H, W, dtype=torch.float64)
        u(x, mask=ones, blocks=other.active_blocks(ones))
    with pytest.raises(ValueError, match="identity shortcut needs stride 1"):
        SparseResidualUnit(6, 8, stride=1, projection=False)
    with pytest.raises(ValueError, match="stride must be 1 or 2"):
        SparseResidualUnit(6, 6, stride=3)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        u([1, 2, 3])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("v", [VARIANTS[0], VARIANTS[6]], ids=vid)
def test_inplace_inference_writes_into_x(v, layout):
    u = make_unit(v).eval()
    mask = random_mask(N, H, W)
    blocks = u.active_blocks(mask)
    x = make_x(9, layout)[0].detach()
    x0 = x.clone()
    with torch.no_grad():
        expected = u(x, mask=mask, blocks=blocks)
        assert torch.equal(x, x0) and not torch.equal(expected, x)  # the default path copies
        x2 = x.clone()
        y = u(x2, mask=mask, blocks=blocks, inplace=True)
    assert y is x2
    torch.testing.assert_close(y, expected, atol=0, rtol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cumulative_momentum_running_stats_over_steps(layout):
    """momentum=None (cumulative average) over two steps: the same running statistics as the dense unit."""
    v = (True, False, 2, True)
    u = make_unit(v).train()
    for bn in u.slots:
        bn.momentum = None
    twin = copy.deepcopy(u)
    for step in range(2):
        x, xd = make_x(20 + step, layout)
        u(x, mask=torch.ones(N, 1, H, W))
        twin(xd)
    for (name, b), bd in zip(u.named_buffers(), twin.buffers(), strict=True):
        torch.testing.assert_close(b, bd, atol=ATOL, rtol=0, msg=name)
    assert int(u.bns[0].num_batches_tracked) == 2


def test_dense_projection_trains_on_channels_last_maps():
    """The dense twin's stride-2 projection on a channels-last map: fwd+bwd runs (torch 2.13's CPU backward of a
    1x1 stride-2 convolution on such maps crashes the process, so the twin convolves every 2nd pixel instead;
    run in a subprocess so a crash fails this test instead of killing the suite) and equals the ordinary
    nn.Conv2d network computed on NCHW maps."""
    code = """
import torch
import torch.nn.functional as F
from detector.nn.resnet import SparseResidualUnit
torch.manual_seed(0)
u = SparseResidualUnit(8, 16, bottleneck=True, stride=2).train()
x = torch.randn(2, 8, 128, 128).contiguous(memory_format=torch.channels_last).requires_grad_()
for _ in range(5):
    u(x).sum().backward()
u.eval()
xn = x.detach().contiguous()  # the plain network from the unit's modules, nn.Conv2d with stride 2, NCHW
with torch.no_grad():
    a = xn
    for i, (conv, bn) in enumerate(zip(u.convs, u.bns)):
        a = bn(conv(a))
        a = F.relu(a) if i < 2 else a
    ref = F.relu(a + u.proj_bn(u.proj(xn)))
    got = u(x.detach())
torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.returncode, r.stderr[-2000:])
