"""region_sums and region_norm_grad: batch-norm's sums and input gradient over the tile regions of blocks.

The rule (detector/ops/functional.py): blocks ``[K, C, e_h, e_w]``; the tile region of each block is rows
``offset_h .. offset_h + size_h`` and columns ``offset_w .. offset_w + size_w``; ``pixels`` lists the region
pixels that count as indices into the ``[K * size_h * size_w]`` region pixels in (block, row, column) order.
``region_sums`` -> float64 ``[2, C]``: with ``u = a - center`` (``a`` without a center), the sums of ``u`` and
of ``u * b`` (``u * u`` without ``b``) over the counted pixels; ``region_norm_grad`` -> ``g * scale`` everywhere
plus ``z * c1 + c0`` at the counted pixels.
Expectations come from explicit loops over (block, row, column) written from that rule, on the CPU kernel and
on the torch composition the other devices (and a machine without kernels) run.
"""

from __future__ import annotations

import pytest
import torch

from detector.ops import _library, reference, region_norm_grad, region_sums

pytestmark = pytest.mark.skipif(not _library.has_kernels("cpu"), reason="sbnet CPU kernels not built")

K, C, E = 4, 3, 6  # blocks, channels, block side
OFFSET, SIZE = (1, 2), (4, 3)


def _counted(pixels: list[int] | None) -> list[tuple[int, int, int]]:
    """(block, row, column) in the blocks of the counted region pixels."""
    out = []
    for k in range(K):
        for i in range(SIZE[0]):
            for j in range(SIZE[1]):
                p = (k * SIZE[0] + i) * SIZE[1] + j
                if pixels is None or p in pixels:
                    out.append((k, OFFSET[0] + i, OFFSET[1] + j))
    return out


# block 3's last region column and block 1's first region row do not count (a tile hanging over the map's edge)
PARTIAL = [p for p in range(K * SIZE[0] * SIZE[1])
           if not (p // (SIZE[0] * SIZE[1]) == 3 and p % SIZE[1] == SIZE[1] - 1)
           and not (p // (SIZE[0] * SIZE[1]) == 1 and (p // SIZE[1]) % SIZE[0] == 0)]


def _blocks(seed: int, dtype=torch.float64, channels_last=False, k: int = K) -> torch.Tensor:
    t = torch.randn(k, C, E, E, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2 + 0.5
    t = t.to(dtype)
    return t.contiguous(memory_format=torch.channels_last) if channels_last else t


def _impls():
    return {"kernel": lambda f, *a: getattr(torch.ops.sbnet, f)(*a),
            "composition": lambda f, *a: getattr(reference, f)(*a)}


CENTER = torch.tensor([0.25, -0.5, 1.0], dtype=torch.float64)


@pytest.mark.parametrize("impl", ["kernel", "composition"])
@pytest.mark.parametrize("pixels", [None, PARTIAL], ids=["all", "partial"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("with_b", [False, True], ids=["u*u", "u*b"])
@pytest.mark.parametrize("with_center", [False, True], ids=["plain", "centred"])
def test_region_sums_follow_the_rule(impl, pixels, channels_last, with_b, with_center):
    a, b = _blocks(0, channels_last=channels_last), _blocks(1, channels_last=channels_last)
    want = torch.zeros(2, C, dtype=torch.float64)
    for k, y, x in _counted(pixels):
        u = a[k, :, y, x] - (CENTER if with_center else 0)
        want[0] += u
        want[1] += u * (b[k, :, y, x] if with_b else u)
    index = None if pixels is None else torch.tensor(pixels)
    got = _impls()[impl]("region_sums", a, b if with_b else None, CENTER if with_center else None, list(OFFSET),
                         list(SIZE), index)
    assert got.dtype == torch.float64 and got.shape == (2, C)
    torch.testing.assert_close(got, want)


def test_region_batch_norm_keeps_the_variance_of_an_offset_signal():
    """Float32 values of mean 300 and standard deviation 0.5 (|mean| / std = 600), region pixels partly not
    counted: region_batch_norm's moments (shifted sums on the CPU kernel) are the float64 moments of the counted
    pixels to float32 precision."""
    from torch import nn

    from detector.nn.geometry import Level, LevelMasks
    from detector.nn.norm import region_batch_norm

    z = (torch.randn(500, 24, 10, 10, generator=torch.Generator().manual_seed(11), dtype=torch.float64) * 0.5
         + 300).float().contiguous(memory_format=torch.channels_last)
    keep = torch.arange(3, 500 * 64, 2)  # every other region pixel, the first three not
    level = Level(extent=(10, 10), offset=(1, 1), region=(8, 8), map_size=(999, 999))
    _, m = region_batch_norm(nn.BatchNorm2d(24), z, level, LevelMasks(None, keep, keep.numel()))
    ref = z[:, :, 1:9, 1:9].permute(0, 2, 3, 1).reshape(-1, 24).double()[keep]
    torch.testing.assert_close(m.mean.double(), ref.mean(0), rtol=1e-6, atol=0)
    torch.testing.assert_close(m.var.double(), ref.var(0, unbiased=False), rtol=1e-5, atol=0)


@pytest.mark.parametrize("impl", ["kernel", "composition"])
@pytest.mark.parametrize("pixels", [None, PARTIAL], ids=["all", "partial"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_region_norm_grad_follows_the_rule(impl, pixels, channels_last):
    g, z = _blocks(2, channels_last=channels_last), _blocks(3, channels_last=channels_last)
    scale, c0, c1 = (torch.tensor(v, dtype=torch.float64) for v in ([0.5, -1.0, 2.0], [0.1, 0.2, -0.3],
                                                                   [1.5, -0.25, 0.75]))
    want = torch.empty_like(g, memory_format=torch.contiguous_format)
    for k in range(K):
        for y in range(E):
            for x in range(E):
                want[k, :, y, x] = g[k, :, y, x] * scale
    for k, y, x in _counted(pixels):
        want[k, :, y, x] += z[k, :, y, x] * c1 + c0
    index = None if pixels is None else torch.tensor(pixels)
    got = _impls()[impl]("region_norm_grad", g, z, scale, c0, c1, list(OFFSET), list(SIZE), index)
    torch.testing.assert_close(got, want)
    assert got.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_low_precision_inputs(dtype):
    """The kernel's sums of low-precision blocks are their float64 sums to float rounding of a region row's
    partial sums; the gradient (kernel and composition) is the float64 rule's value rounded once to the dtype."""
    a, b = _blocks(4, dtype, True), _blocks(5, dtype, True)
    idx = torch.tensor(PARTIAL)
    for args in ((a, None), (a, b)):
        k = region_sums(*args, OFFSET, SIZE, idx)
        r = reference.region_sums(*args, None, list(OFFSET), list(SIZE), idx)
        torch.testing.assert_close(k, r, rtol=1e-6, atol=1e-5)
    # float32 coefficients (0.1 is not a bfloat16): applied unrounded, the result rounded once to the dtype
    v = [torch.tensor(x) for x in ([0.5, -1.0, 2.0], [0.1, 0.2, -0.3], [1.5, -0.25, 0.75])]
    want = reference.region_norm_grad(a.double(), b.double(), *(x.double() for x in v), list(OFFSET), list(SIZE),
                                      idx)
    eps = torch.finfo(dtype).eps
    for got in (region_norm_grad(a, b, *v, OFFSET, SIZE, idx),
                reference.region_norm_grad(a, b, *v, list(OFFSET), list(SIZE), idx)):
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want, rtol=eps, atol=eps * 8)


def test_sums_do_not_depend_on_the_thread_count(deterministic):
    """Large enough for many chunks: bit-identical with 1 and 2 threads (partial sums added in chunk order)."""
    a = torch.randn(900, 24, 10, 10, generator=torch.Generator().manual_seed(6)).contiguous(
        memory_format=torch.channels_last)
    (one,) = deterministic(lambda: region_sums(a, None, (1, 1), (8, 8)), threads=(1, 2))
    torch.testing.assert_close(one[0], a[:, :, 1:9, 1:9].double().sum((0, 2, 3)), rtol=1e-6, atol=1e-3)


def test_no_blocks():
    a = _blocks(7, channels_last=True, k=0)
    assert torch.equal(region_sums(a, None, OFFSET, SIZE), torch.zeros(2, C, dtype=torch.float64))
    v = torch.ones(C, dtype=torch.float64)
    assert region_norm_grad(a, a, v, v, v, OFFSET, SIZE).shape == a.shape


def test_opcheck():
    a, b = _blocks(8, torch.float32, True), _blocks(9, torch.float32, True)
    idx = torch.tensor(PARTIAL)
    torch.library.opcheck(torch.ops.sbnet.region_sums, (a, b, None, list(OFFSET), list(SIZE), idx))
    torch.library.opcheck(torch.ops.sbnet.region_sums, (a, None, torch.ones(C), list(OFFSET), list(SIZE), None))
    v = torch.tensor([0.5, -1.0, 2.0])
    torch.library.opcheck(torch.ops.sbnet.region_norm_grad, (a, b, v, v, v, list(OFFSET), list(SIZE), None))


def test_bad_input_names_the_op_and_the_argument():
    a = _blocks(10)
    with pytest.raises(ValueError, match=r"region_sums: region at \(4, 2\) of size \(4, 3\) does not fit"):
        region_sums(a, None, (4, 2), SIZE)
    with pytest.raises(ValueError, match="region_sums: pixels must be an int64 vector"):
        region_sums(a, None, OFFSET, SIZE, torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"region_sums: pixels\[1\] = 48 outside \[0, 48\)"):
        region_sums(a, None, OFFSET, SIZE, torch.tensor([0, 48]))
    with pytest.raises(ValueError, match="region_norm_grad: g must match z"):
        v = torch.ones(C, dtype=torch.float64)
        region_norm_grad(a[:2], a, v, v, v, OFFSET, SIZE)
    with pytest.raises(TypeError, match="region_sums: blocks must be float16, bfloat16, float32 or float64"):
        region_sums(a.long(), None, OFFSET, SIZE)
