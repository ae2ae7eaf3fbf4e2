"""CUDA kernels against the CPU kernels and the reference; skip without a CUDA device.

(The compile check of the CUDA sources, which needs no GPU, is tests/test_ops_cuda_compile.py.)
"""

import pytest
import torch

import detector.ops as ops
from detector.ops import _library, calc_block_params, reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def cuda_kernels():
    _library.load()
    if not _library.has_kernels("cuda"):
        reason = _library.unavailable_reason("cuda")
        pytest.fail(f"CUDA is available but the sbnet CUDA kernels are not: {reason}")
    return torch.ops.sbnet


GEOMETRIES = [
    (13, 11, (6, 5), 3, 1, 1),
    (7, 9, 16, 3, 1, 1),
    (20, 14, (7, 5), 3, 2, 1),
    (40, 36, 10, 5, 1, 2),
    (97, 83, 16, 3, 1, 1),
]


def _idx(N, bp, frac, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand((N, bp.bcount_h, bp.bcount_w), generator=gen) < frac).nonzero().to(torch.int32)


@pytest.mark.parametrize("geom", GEOMETRIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("avgpool", [False, True])
def test_cuda_forward_matches_cpu(cuda_kernels, geom, dtype, avgpool):
    H, W, bsize, ksize, stride, padding = geom
    bp = calc_block_params(H, W, bsize, ksize, stride, padding)
    seed = GEOMETRIES.index(geom)
    gen = torch.Generator().manual_seed(seed)
    mask = ((torch.rand((3, 1, H, W), generator=gen) ** 4) * 8).floor().div(8).to(dtype)
    idx_cpu = ops.reduce_mask(mask, bp, 0.25, avgpool)
    idx = ops.reduce_mask(mask.cuda(), bp, 0.25, avgpool)
    assert torch.equal(idx.cpu(), idx_cpu)
    assert torch.equal(idx_cpu, reference.reduce_mask(mask, bp, 0.25, avgpool))
    if dtype == torch.float64:  # full-precision values: both devices sum in the same order in float64
        raw = torch.rand((3, 1, H, W), generator=gen, dtype=torch.float64)
        on_gpu = ops.reduce_mask(raw.cuda(), bp, 0.5, avgpool).cpu()
        assert torch.equal(on_gpu, ops.reduce_mask(raw, bp, 0.5, avgpool))

    x = torch.randn((3, 5, H, W), generator=gen).to(dtype)
    x_nc = x.cuda().permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)  # non-contiguous on the GPU
    assert torch.equal(ops.sparse_gather(x_nc, idx, bp).cpu(), ops.sparse_gather(x, idx_cpu, bp))
    blocks = torch.randn((idx.shape[0], 5, bp.obsize_h, bp.obsize_w), generator=gen).to(dtype)
    base = torch.randn((3, 5, bp.out_h, bp.out_w), generator=gen).to(dtype)
    for add in (True, False):
        expected = reference.sparse_scatter(blocks, idx_cpu, base, bp, add)
        assert torch.equal(ops.sparse_scatter(blocks.cuda(), idx, base.cuda(), bp, add).cpu(), expected)
        inplace = base.cuda()
        ops.sparse_scatter_(blocks.cuda(), idx, inplace, bp, add)
        assert torch.equal(inplace.cpu(), expected)


@pytest.mark.parametrize("geom", GEOMETRIES)
def test_cuda_backward_matches_cpu_bit_for_bit(cuda_kernels, geom):
    """Both devices add overlapping halos in the same phase order: float32 gradients agree exactly."""
    H, W, bsize, ksize, stride, padding = geom
    bp = calc_block_params(H, W, bsize, ksize, stride, padding)
    idx = _idx(2, bp, 0.7, GEOMETRIES.index(geom))
    gen = torch.Generator().manual_seed(1)
    g = torch.randn((idx.shape[0], 4, bp.bsize_h, bp.bsize_w), generator=gen)
    grads = []
    for device in ("cpu", "cuda"):
        x = torch.zeros((2, 4, H, W), device=device, requires_grad=True)
        (ops.sparse_gather(x, idx.to(device), bp) * g.to(device)).sum().backward()
        grads.append(x.grad.cpu())
    assert torch.equal(grads[0], grads[1])


def test_cuda_gradcheck_and_determinism(cuda_kernels):
    bp = calc_block_params(9, 8, bsize=(5, 4), ksize=3, stride=1, padding=1)
    idx = _idx(2, bp, 0.6, 3).cuda()
    x = torch.randn((2, 2, 9, 8), dtype=torch.float64, device="cuda", requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: ops.sparse_gather(t, idx, bp), (x,))
    blocks = torch.randn((idx.shape[0], 2, bp.obsize_h, bp.obsize_w), dtype=torch.float64, device="cuda",
                         requires_grad=True)
    base = torch.randn((2, 2, 9, 8), dtype=torch.float64, device="cuda", requires_grad=True)
    for add in (True, False):
        def scatter(b, s, add=add):
            return ops.sparse_scatter(b, idx, s, bp, add)

        assert torch.autograd.gradcheck(scatter, (blocks, base))

    big = calc_block_params(200, 176, bsize=16, ksize=5, stride=1, padding=2)
    mask = (torch.rand((4, 1, 200, 176), device="cuda") > 0.97).float()
    xb = torch.randn((4, 32, 200, 176), device="cuda")
    g = torch.randn((4, 32, 200, 176), device="cuda")

    def run():
        xx = xb.clone().requires_grad_()
        i = ops.reduce_mask(mask, big, 0.5)
        out = ops.sparse_scatter(ops.sparse_gather(xx, i, big)[:, :, 2:-2, 2:-2] * 1.5, i, xx, big, add=True)
        (out * g).sum().backward()
        return i, out.detach(), xx.grad

    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        first, second = run(), run()
    finally:
        torch.use_deterministic_algorithms(was)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_cuda_k_zero_and_device_mismatch(cuda_kernels):
    bp = calc_block_params(9, 9, bsize=5, ksize=3)
    idx = ops.reduce_mask(torch.zeros(2, 1, 9, 9, device="cuda"), bp, 0.5)
    assert idx.shape == (0, 3) and idx.is_cuda
    x = torch.randn(2, 3, 9, 9, device="cuda", requires_grad=True)
    blocks = ops.sparse_gather(x, idx, bp)
    y = ops.sparse_scatter(blocks[:, :, 1:-1, 1:-1], idx, x, bp)
    y.sum().backward()
    assert torch.equal(y, x) and torch.equal(x.grad, torch.ones_like(x))
    with pytest.raises(ValueError, match="indices are on cpu"):
        ops.sparse_gather(x, idx.cpu(), bp)
