"""Compiled sbnet kernels (CPU) against the pure-PyTorch reference; autograd, opcheck, determinism,
and the public functions' errors on bad input.

The extension is built on first use (about a minute on a fresh checkout) by the session fixture.
"""

import os
import subprocess
import sys
import warnings

import pytest
import torch

import detector.ops as ops
from detector.ops import _library, calc_block_params, reference
from tests.ops import cases
from tests.paths import REPO

CASES = ("halo2", "big-block", "stride2", "k5", "1x1", "rect-kernel", "many-blocks", "overlap3")
GEOMETRIES = cases.select(*CASES)  # a geometry's position here seeds its data


@pytest.fixture(scope="session")
def kernels():
    """The compiled ops (builds them on first use); skips only where there is no compiler."""
    if not _library.load(verbose=False):
        reason = _library.unavailable_reason("cpu")
        if "no C++ compiler" in reason or "DETECTOR_NO_KERNELS" in reason:
            pytest.skip(f"sbnet kernels not available: {reason}")
        pytest.fail(f"sbnet kernels failed to build: {reason}")
    return torch.ops.sbnet


def _rand(shape, dtype, seed, layout="contiguous"):
    """Random tensor of ``shape``; 'permuted' (channels-last strides) or 'sliced' gives a
    non-contiguous tensor with the same values semantics."""
    gen = torch.Generator().manual_seed(seed)
    if layout == "permuted":
        N, C, H, W = shape
        return torch.randn((N, H, W, C), generator=gen).to(dtype).permute(0, 3, 1, 2)
    if layout == "sliced":
        N, C, H, W = shape
        return torch.randn((N, 2 * C, H, W + 3), generator=gen).to(dtype)[:, ::2, :, 1 : W + 1]
    return torch.randn(shape, generator=gen).to(dtype)


# ------------------------------------------------------------------------- kernels == reference
@pytest.mark.parametrize("geom", cases.params(*CASES))
@pytest.mark.parametrize("dtype", cases.DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "permuted", "sliced"])
def test_gather_scatter_match_reference(kernels, geom, dtype, layout):
    """Copies and single adds: bit-identical to the reference in every dtype."""
    H, W, bsize, ksize, stride, padding = geom
    bp = calc_block_params(H, W, bsize, ksize, stride, padding)
    seed = GEOMETRIES.index(geom)
    N, C = 3, 5
    x = _rand((N, C, H, W), dtype, seed, layout)
    idx = cases.indices(bp, N, 0.5, seed)
    assert layout == "contiguous" or not x.is_contiguous()
    got = ops.sparse_gather(x, idx, bp)
    assert torch.equal(got, reference.sparse_gather(x, idx, bp))
    assert got.dtype == dtype and got.shape == (idx.shape[0], C, bp.bsize_h, bp.bsize_w)

    blocks = _rand((idx.shape[0], C, bp.obsize_h, bp.obsize_w), dtype, seed + 1, layout)
    base = _rand((N, C, bp.out_h, bp.out_w), dtype, seed + 2, layout)
    for add in (True, False):
        expected = reference.sparse_scatter(blocks, idx, base, bp, add)
        assert torch.equal(ops.sparse_scatter(blocks, idx, base, bp, add), expected)
        inplace = base.clone()  # keeps the layout: exercises the non-contiguous in-place path
        assert ops.sparse_scatter_(blocks, idx, inplace, bp, add) is inplace
        assert torch.equal(inplace, expected)


@pytest.mark.parametrize("geom", cases.params(*CASES))
@pytest.mark.parametrize("dtype", cases.DTYPES, ids=str)
@pytest.mark.parametrize("avgpool", [False, True])
def test_reduce_mask_matches_reference(kernels, geom, dtype, avgpool):
    H, W, bsize, ksize, stride, padding = geom
    bp = calc_block_params(H, W, bsize, ksize, stride, padding)
    gen = torch.Generator().manual_seed(GEOMETRIES.index(geom))
    # eighths: exact in every dtype, and their means are exact in float64
    mask = ((torch.rand((3, 1, H, W), generator=gen) ** 4) * 8).floor().div(8).to(dtype)
    for tol in (0.0, 0.1, 0.25, 0.5):
        got = ops.reduce_mask(mask, bp, tol, avgpool)
        assert got.dtype == torch.int32
        assert torch.equal(got, reference.reduce_mask(mask, bp, tol, avgpool))
        assert torch.equal(ops.block_activity(mask, bp, tol, avgpool), reference.block_activity(mask, bp, tol, avgpool))


def test_reduce_mask_bool_and_noncontiguous(kernels):
    bp = calc_block_params(30, 26, bsize=8, ksize=3)
    gen = torch.Generator().manual_seed(0)
    mask = torch.rand((2, 1, 26, 30), generator=gen).transpose(2, 3) > 0.95
    assert not mask.is_contiguous()
    assert torch.equal(ops.reduce_mask(mask, bp, 0.5), reference.reduce_mask(mask.float(), bp, 0.5))


@pytest.mark.parametrize("geom", cases.params(*CASES))
def test_gather_backward_matches_reference(kernels, geom):
    """Overlapping halos add up: integer-valued gradients make every summation order exact."""
    H, W, bsize, ksize, stride, padding = geom
    bp = calc_block_params(H, W, bsize, ksize, stride, padding)
    seed = GEOMETRIES.index(geom)
    idx = cases.indices(bp, 2, 0.7, seed)
    gen = torch.Generator().manual_seed(seed)
    grad = torch.randint(-8, 9, (idx.shape[0], 3, bp.bsize_h, bp.bsize_w), generator=gen).float()
    x = torch.zeros((2, 3, H, W), requires_grad=True)
    (ops.sparse_gather(x, idx, bp) * grad).sum().backward()
    x_ref = torch.zeros((2, 3, H, W), requires_grad=True)
    (reference.sparse_gather(x_ref, idx, bp) * grad).sum().backward()
    assert torch.equal(x.grad, x_ref.grad)


@pytest.mark.parametrize("dtype", cases.LOW_PRECISION, ids=str)
def test_gather_backward_low_precision(kernels, dtype):
    bp = calc_block_params(20, 18, bsize=8, ksize=5, stride=1, padding=2)  # halo 4: up to 4 overlaps
    idx = cases.indices(bp, 2, 0.8, 3)
    grad = torch.randn((idx.shape[0], 4, 8, 8), generator=torch.Generator().manual_seed(3))
    x = torch.zeros((2, 4, 20, 18), dtype=dtype, requires_grad=True)
    (ops.sparse_gather(x, idx, bp) * grad.to(dtype)).sum().backward()
    x64 = torch.zeros((2, 4, 20, 18), dtype=torch.float64, requires_grad=True)
    (reference.sparse_gather(x64, idx, bp) * grad.to(dtype).double()).sum().backward()
    assert x.grad.dtype == dtype
    tol = 1e-2 if dtype == torch.float16 else 5e-2
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=tol, atol=tol)


def test_scatter_backward_matches_reference(kernels):
    bp = calc_block_params(17, 15, bsize=(7, 5), ksize=3, stride=2, padding=1)
    idx = cases.indices(bp, 2, 0.6, 5)
    for add in (True, False):
        grads = []
        for fn in (ops.sparse_scatter, reference.sparse_scatter):
            blocks = _rand((idx.shape[0], 3, bp.obsize_h, bp.obsize_w), torch.float32, 6).requires_grad_()
            base = _rand((2, 3, bp.out_h, bp.out_w), torch.float32, 7).requires_grad_()
            g = _rand((2, 3, bp.out_h, bp.out_w), torch.float32, 8)
            (fn(blocks, idx, base, bp, add) * g).sum().backward()
            grads.append((blocks.grad, base.grad))
        assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


@pytest.mark.parametrize(
    "bsize, bstride, boffset",
    [((5, 4), (3, 2), (2, 1)), ((4, 6), (4, 7), (-3, 5)), ((7, 3), (2, 3), (-6, -2))],
)
def test_raw_ops_on_arbitrary_grids(kernels, bsize, bstride, boffset):
    """The raw ops take any grid (positive offsets, gaps, big overlaps): compare with direct loops."""
    N, C, H, W = 2, 3, 11, 13
    gen = torch.Generator().manual_seed(sum(bsize + bstride))
    x = torch.randn((N, C, H, W), generator=gen, dtype=torch.float64)
    idx = torch.tensor([[n, by, bx] for n in range(N) for by in range(-1, 6) for bx in range(-1, 5)
                        if (n + by + 2 * bx) % 3], dtype=torch.int32)
    (bh, bw), (sh, sw), (oh, ow) = bsize, bstride, boffset

    def window(k):  # (n, rows in map, cols in map, rows in block, cols in block)
        n, by, bx = idx[k].tolist()
        top, left = oh + by * sh, ow + bx * sw
        y0, y1, x0, x1 = max(top, 0), min(top + bh, H), max(left, 0), min(left + bw, W)
        return n, slice(y0, max(y0, y1)), slice(x0, max(x0, x1)), slice(y0 - top, max(y0, y1) - top), \
            slice(x0 - left, max(x0, x1) - left)

    blocks = kernels.sparse_gather(x, idx, list(bsize), list(bstride), list(boffset))
    expected = torch.zeros((idx.shape[0], C, bh, bw), dtype=torch.float64)
    for k in range(idx.shape[0]):
        n, ys, xs, bys, bxs = window(k)
        expected[k, :, bys, bxs] = x[n, :, ys, xs]
    assert torch.equal(blocks, expected)

    g = torch.randint(-4, 5, (idx.shape[0], C, bh, bw), generator=gen).double()
    adjoint = torch.zeros_like(x)
    for k in range(idx.shape[0]):
        n, ys, xs, bys, bxs = window(k)
        adjoint[n, :, ys, xs] += g[k, :, bys, bxs]
    got = kernels.sparse_gather_backward(g, idx, [N, C, H, W], list(bstride), list(boffset))
    assert torch.equal(got, adjoint)

    if sh >= bh and sw >= bw:  # non-overlapping tiles: scatter too
        for add in (True, False):
            expected = x.clone()
            for k in range(idx.shape[0]):
                n, ys, xs, bys, bxs = window(k)
                expected[n, :, ys, xs] = g[k, :, bys, bxs] + (expected[n, :, ys, xs] if add else 0)
            assert torch.equal(kernels.sparse_scatter(g, idx, x, list(bstride), list(boffset), add), expected)


def test_k_zero_everywhere(kernels):
    bp = calc_block_params(9, 9, bsize=5, ksize=3)
    idx = ops.reduce_mask(torch.zeros(2, 1, 9, 9), bp, 0.5)
    assert idx.shape == (0, 3) and idx.dtype == torch.int32
    x = torch.randn(2, 3, 9, 9, requires_grad=True)
    blocks = ops.sparse_gather(x, idx, bp)
    assert blocks.shape == (0, 3, 5, 5)
    base = torch.randn(2, 3, 9, 9, requires_grad=True)
    y = ops.sparse_scatter(blocks[:, :, 1:-1, 1:-1], idx, base, bp, add=True)
    assert torch.equal(y, base)
    y.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x)) and torch.equal(base.grad, torch.ones_like(base))
    with torch.no_grad():
        assert torch.equal(ops.sparse_scatter_(blocks[:, :, 1:-1, 1:-1], idx, base.clone(), bp), base)
    # the reference (the fallback) agrees
    assert reference.reduce_mask(torch.zeros(2, 1, 9, 9), bp, 0.5).shape == (0, 3)
    assert reference.sparse_gather(x, idx, bp).shape == (0, 3, 5, 5)
    assert torch.equal(reference.sparse_scatter(blocks[:, :, 1:-1, 1:-1].detach(), idx, base.detach(), bp), base)


# ------------------------------------------------------------------------------ autograd checks
@pytest.mark.parametrize("geom", cases.params("tiny-halo2", "tiny-stride2", "tiny-k5"))
def test_gradcheck_float64(kernels, geom):
    H, W, bsize, ksize, stride, padding = geom
    bp = calc_block_params(H, W, bsize, ksize, stride, padding)
    idx = cases.indices(bp, 2, 0.6, 11)
    x = _rand((2, 1, H, W), torch.float64, 12).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: ops.sparse_gather(t, idx, bp), (x,))
    assert torch.autograd.gradgradcheck(lambda t: ops.sparse_gather(t, idx, bp), (x,), fast_mode=True)
    blocks = _rand((idx.shape[0], 1, bp.obsize_h, bp.obsize_w), torch.float64, 13).requires_grad_()
    base = _rand((2, 1, bp.out_h, bp.out_w), torch.float64, 14).requires_grad_()
    for add in (True, False):
        def scatter(b, s, add=add):
            return ops.sparse_scatter(b, idx, s, bp, add)

        assert torch.autograd.gradcheck(scatter, (blocks, base))
        assert torch.autograd.gradgradcheck(scatter, (blocks, base), fast_mode=True)


def _opcheck_cases(kernels):
    bp = calc_block_params(*cases.GEOMETRIES["halo2"])  # 13 x 11
    idx = cases.indices(bp, 2, 0.5, 21)
    x = _rand((2, 3, 13, 11), torch.float32, 22).requires_grad_()
    mask = (_rand((2, 1, 13, 11), torch.float32, 23) > 1.0).float()
    blocks = _rand((idx.shape[0], 3, bp.obsize_h, bp.obsize_w), torch.float32, 24).requires_grad_()
    base = _rand((2, 3, 13, 11), torch.float32, 25).requires_grad_()
    grad_blocks = _rand((idx.shape[0], 3, bp.bsize_h, bp.bsize_w), torch.float32, 26).requires_grad_()
    g, s, o = list(bp.bsize), list(bp.bstride), list(bp.boffset)
    calls = [
        (kernels.sparse_gather, (x, idx, g, s, o)),
        (kernels.sparse_gather_backward, (grad_blocks, idx, [2, 3, 13, 11], s, o)),
        (kernels.sparse_scatter, (blocks, idx, base, list(bp.obsize), [0, 0], True)),
        (kernels.sparse_scatter, (blocks, idx, base, list(bp.obsize), [0, 0], False)),
        (kernels.sparse_scatter_, (blocks.detach(), idx, base.detach().clone(), list(bp.obsize), [0, 0],
                                   True)),
    ]
    return calls + [(kernels.reduce_mask, (mask, g, s, o, list(bp.bcount), 0.5, False)),
                    (kernels.block_activity, (mask, g, s, o, list(bp.bcount), 0.5, False))]


def test_opcheck(kernels):
    """Schema, autograd registration and fake kernels of every op (reduce_mask's fake allocates an
    unbacked, data-dependent K)."""
    for op, args in _opcheck_cases(kernels):
        torch.library.opcheck(op, args,
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@pytest.mark.slow
def test_opcheck_aot_dispatch(kernels):
    """AOT-autograd tracing through the fake kernels and autograd formulas (first use compiles: slow)."""
    for op, args in _opcheck_cases(kernels)[:3]:
        torch.library.opcheck(op, args, test_utils=("test_aot_dispatch_dynamic",))


# -------------------------------------------------------------------------------- determinism
def test_deterministic_bit_identical(kernels, deterministic):
    bp = calc_block_params(64, 56, bsize=12, ksize=5, stride=1, padding=2)
    mask = (_rand((2, 1, 64, 56), torch.float32, 31) > 1.2).float()
    x = _rand((2, 16, 64, 56), torch.float32, 32)
    g = _rand((2, 16, 64, 56), torch.float32, 33)

    def run():
        xx = x.clone().requires_grad_()
        idx = ops.reduce_mask(mask, bp, 0.5)
        blocks = ops.sparse_gather(xx, idx, bp)
        out = ops.sparse_scatter(blocks[:, :, 2:-2, 2:-2] * 1.5, idx, xx, bp, add=True)
        (out * g).sum().backward()
        return idx, out.detach(), xx.grad

    deterministic(run)  # the current thread count twice, 1, at least 2


# ------------------------------------------------------------------------------------ errors
@pytest.fixture
def setup():
    bp = calc_block_params(12, 10, bsize=6, ksize=3)
    idx = torch.tensor([[0, 0, 0], [1, 2, 1]], dtype=torch.int32)
    x = torch.randn(2, 3, 12, 10)
    blocks = torch.randn(2, 3, bp.obsize_h, bp.obsize_w)
    return bp, idx, x, blocks


_G, _R, _S, _S_ = ops.sparse_gather, ops.reduce_mask, ops.sparse_scatter, ops.sparse_scatter_
_I32 = torch.int32


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda bp, i, x, b: _G(x[0], i, bp), ValueError, "x must be 4-D"),
        (lambda bp, i, x, b: _G(x[:, :, :11], i, bp), ValueError, r"x must be \[N, C, 12, 10\]"),
        (lambda bp, i, x, b: _G(x.int(), i, bp), TypeError, "x must be float16"),
        (lambda bp, i, x, b: _G(x, i.float(), bp), TypeError, "indices must be int32"),
        (lambda bp, i, x, b: _G(x, i[:, :2], bp), ValueError, r"indices must have shape \[K, 3\]"),
        (lambda bp, i, x, b: _G(x[:1], i, bp), ValueError, "column n out of range"),
        (lambda bp, i, x, b: _G(x, i + torch.tensor([0, 5, 0], dtype=_I32), bp), ValueError, "column by out"),
        (lambda bp, i, x, b: _G(x, i - torch.tensor([0, 0, 1], dtype=_I32), bp), ValueError, "column bx out"),
        (lambda bp, i, x, b: _G(x, torch.cat([i, i[:1]]), bp), ValueError, "repeated rows"),
        (lambda bp, i, x, b: _G(x, i, (6, 6)), TypeError, "bp must be a BlockParams"),
        (lambda bp, i, x, b: _R(x, bp), ValueError, r"mask must have shape \[N, 1, 12, 10\]"),
        (lambda bp, i, x, b: _R(x[:, :1, :, :9], bp), ValueError, "mask must have shape"),
        (lambda bp, i, x, b: _R(x[:, :1].long(), bp), TypeError, "mask must be float16"),
        (lambda bp, i, x, b: _R(x[:, :1], bp, tol="0.5"), TypeError, "tol must be a float"),
        (lambda bp, i, x, b: _S(b.double(), i, x, bp), TypeError, "same dtype"),
        (lambda bp, i, x, b: _S(b[:, :2], i, x, bp), ValueError, r"blocks must be \[K, 3, 4, 4\]"),
        (lambda bp, i, x, b: _S(b[:1], i, x, bp), ValueError, "1 blocks but indices has 2"),
        (lambda bp, i, x, b: _S(b, i, x[..., :9], bp), ValueError, r"base must be \[N, C, 12, 10\]"),
        (lambda bp, i, x, b: _S(b, i, x[:1], bp), ValueError, "column n out of range"),
        (lambda bp, i, x, b: _S_(b, i, x.requires_grad_(), bp), RuntimeError, "leaf that requires grad"),
        (lambda bp, i, x, b: _S_(b, i, x.transpose(2, 3).contiguous().transpose(2, 3), bp), ValueError,
         r"sparse_scatter_: base must be NCHW-contiguous or channels-last to be written in place"),
        (lambda bp, i, x, b: _S(b, i, x.to(memory_format=torch.channels_last).half(), bp), TypeError, "same dtype"),
    ],
)
def test_clear_errors(kernels, setup, call, exc, match):
    with pytest.raises(exc, match=match):
        call(*setup)


def test_index_checks_are_remembered_until_an_inplace_change(kernels, setup):
    """Checked (or reduce_mask-made) indices skip the re-check (a device sync) on later calls; an
    in-place change bumps their version, so the next call checks again."""
    bp, idx, x, blocks = setup
    idx = idx.clone()
    ops.sparse_gather(x, idx, bp)
    idx[1, 0] = 5
    with pytest.raises(ValueError, match="column n out of range"):
        ops.sparse_gather(x, idx, bp)
    made = ops.reduce_mask(torch.ones(2, 1, 12, 10), bp, 0.5)
    assert ops.sparse_gather(x, made, bp).shape[0] == bp.num_blocks * 2
    with pytest.raises(ValueError, match="column n out of range"):
        ops.sparse_gather(x[:1], made, bp)  # remembered for batch 2 only
    made[0, 2] = -1
    with pytest.raises(ValueError, match="column bx out of range"):
        ops.sparse_gather(x, made, bp)


def test_raw_op_checks_batch_index(kernels, setup):
    """The C++ ops re-check what memory safety needs even when called directly."""
    bp, idx, x, blocks = setup
    bad = idx.clone()
    bad[1, 0] = 7
    with pytest.raises(RuntimeError, match="outside"):
        kernels.sparse_gather(x, bad, list(bp.bsize), list(bp.bstride), list(bp.boffset))
    with pytest.raises(RuntimeError, match="outside"):
        kernels.sparse_scatter(blocks, bad, x, list(bp.obsize), [0, 0], True)
    with pytest.raises(RuntimeError, match="would overlap"):
        kernels.sparse_scatter(blocks, idx, x, [2, 2], [0, 0], True)


def test_fallback_warns_once_and_matches_reference(kernels, monkeypatch):
    """Without kernels for a device the functional layer warns once (naming the reason) and runs the
    reference."""
    from detector.ops import functional

    monkeypatch.setattr(_library, "has_kernels", lambda device_type: False)
    monkeypatch.setattr(_library, "unavailable_reason", lambda device_type: "test: pretend no build")
    monkeypatch.setattr(functional, "_warned_devices", set())
    bp = calc_block_params(12, 10, bsize=6, ksize=3)
    mask = (_rand((2, 1, 12, 10), torch.float32, 41) > 1.0).float()
    x = _rand((2, 3, 12, 10), torch.float32, 42)
    with pytest.warns(RuntimeWarning, match="pretend no build.*reference") as record:
        idx = ops.reduce_mask(mask, bp, 0.5)
        blocks = ops.sparse_gather(x, idx, bp)
    assert len(record) == 1
    assert torch.equal(idx, reference.reduce_mask(mask, bp, 0.5))
    assert torch.equal(blocks, reference.sparse_gather(x, idx, bp))


@pytest.mark.slow
def test_no_kernels_env_var_in_fresh_process():
    """DETECTOR_NO_KERNELS=1: the reference runs, with one warning naming the reason."""
    code = (
        "import warnings, torch\n"
        "from detector.ops import calc_block_params, reduce_mask, sparse_gather\n"
        "bp = calc_block_params(12, 10, bsize=6, ksize=3)\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    idx = reduce_mask(torch.ones(1, 1, 12, 10), bp)\n"
        "    b = sparse_gather(torch.ones(1, 2, 12, 10), idx, bp)\n"
        "print(len(w), str(w[0].message) if w else '', tuple(idx.shape), float(b.sum()))\n"
    )
    env = dict(os.environ, DETECTOR_NO_KERNELS="1")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                         cwd=REPO)
    assert res.returncode == 0, res.stderr
    count, _, rest = res.stdout.strip().partition(" ")
    assert count == "1" and "DETECTOR_NO_KERNELS" in rest and "reference" in rest
    bp = calc_block_params(12, 10, bsize=6, ksize=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = float(reference.sparse_gather(torch.ones(1, 2, 12, 10), reference.reduce_mask(
            torch.ones(1, 1, 12, 10), bp, 0.5), bp).sum())
    assert rest.endswith(f"({bp.num_blocks}, 3) {expected}")
