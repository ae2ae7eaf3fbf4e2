// sparse_gather and its adjoint on CUDA.
//
// Gather: one thread per output element (k, c, i, j); coalesced writes; out-of-map pixels read 0.
// Adjoint: zeros like x, then the blocks added in phases (by mod P, bx mod Q). Blocks of one phase
// never overlap (P * bstride >= bsize), so within one launch every pixel is written by at most one
// thread: plain read-add-write, no atomics. Phases run in a fixed order on one stream, so every
// pixel's sum has the same order on every run (deterministic, also under
// torch.use_deterministic_algorithms), and the same order as the CPU kernel.
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "common.h"
#include "cuda/launch.cuh"

namespace sbnet {
namespace {

template <typename scalar_t>
__global__ void gather_kernel(const scalar_t* __restrict__ x, const int32_t* __restrict__ idx,
                              scalar_t* __restrict__ out, int64_t total, int64_t N, int64_t C, int64_t H,
                              int64_t W, Grid g) {
  SBNET_KERNEL_LOOP(i, total) {
    const int64_t j = i % g.size_w, r = (i / g.size_w) % g.size_h, kc = i / (g.size_w * g.size_h);
    const int64_t k = kc / C, c = kc % C;
    const int64_t n = idx[3 * k];
    const int64_t y = g.offset_h + idx[3 * k + 1] * g.stride_h + r;
    const int64_t xx = g.offset_w + idx[3 * k + 2] * g.stride_w + j;
    const bool inside = n >= 0 && n < N && y >= 0 && y < H && xx >= 0 && xx < W;
    out[i] = inside ? x[((n * C + c) * H + y) * W + xx] : scalar_t(0);
  }
}

template <typename scalar_t>
__global__ void gather_backward_phase_kernel(const scalar_t* __restrict__ grad_blocks,
                                             const int32_t* __restrict__ idx, scalar_t* __restrict__ out,
                                             int64_t total, int64_t N, int64_t C, int64_t H, int64_t W, Grid g,
                                             int64_t P, int64_t Q, int64_t py, int64_t px) {
  SBNET_KERNEL_LOOP(i, total) {
    const int64_t j = i % g.size_w, r = (i / g.size_w) % g.size_h, kc = i / (g.size_w * g.size_h);
    const int64_t k = kc / C, c = kc % C;
    const int64_t by = idx[3 * k + 1], bx = idx[3 * k + 2];
    if (phase_of(by, P) != py || phase_of(bx, Q) != px) continue;
    const int64_t n = idx[3 * k];
    const int64_t y = g.offset_h + by * g.stride_h + r, xx = g.offset_w + bx * g.stride_w + j;
    if (n < 0 || n >= N || y < 0 || y >= H || xx < 0 || xx >= W) continue;
    scalar_t* d = out + ((n * C + c) * H + y) * W + xx;
    *d = *d + grad_blocks[i];  // the only writer of this pixel in this phase
  }
}

at::Tensor sparse_gather_cuda(const at::Tensor& x, const at::Tensor& indices, c10::IntArrayRef bsize,
                              c10::IntArrayRef bstride, c10::IntArrayRef boffset) {
  const char* op = "sbnet::sparse_gather";
  const Grid g = make_grid(op, bsize, bstride, boffset);
  TORCH_CHECK(x.dim() == 4, op, ": x must be [N, C, H, W], got ", x.sizes());
  check_float(op, "x", x);
  check_indices(op, indices, x);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  const at::Tensor idx = indices.contiguous();
  const int64_t N = xc.size(0), C = xc.size(1), H = xc.size(2), W = xc.size(3), K = idx.size(0);
  at::Tensor out = at::empty({K, C, g.size_h, g.size_w}, xc.options());
  const int64_t total = out.numel();
  if (total == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, xc.scalar_type(), "sbnet_gather_cuda", [&] {
    gather_kernel<scalar_t><<<blocks_for(total), kThreads, 0, current_stream()>>>(
        xc.const_data_ptr<scalar_t>(), idx.const_data_ptr<int32_t>(), out.mutable_data_ptr<scalar_t>(), total,
        N, C, H, W, g);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor sparse_gather_backward_cuda(const at::Tensor& grad_blocks, const at::Tensor& indices,
                                       c10::IntArrayRef input_size, c10::IntArrayRef bstride,
                                       c10::IntArrayRef boffset) {
  const char* op = "sbnet::sparse_gather_backward";
  TORCH_CHECK(grad_blocks.dim() == 4, op, ": grad_blocks must be [K, C, bh, bw], got ", grad_blocks.sizes());
  TORCH_CHECK(input_size.size() == 4, op, ": input_size must be [N, C, H, W], got ", input_size);
  const Grid g = make_grid(op, grad_blocks.sizes().slice(2), bstride, boffset);
  check_float(op, "grad_blocks", grad_blocks);
  check_indices(op, indices, grad_blocks);
  const int64_t N = input_size[0], C = input_size[1], H = input_size[2], W = input_size[3];
  const int64_t K = indices.size(0);
  TORCH_CHECK(grad_blocks.size(0) == K && grad_blocks.size(1) == C, op, ": grad_blocks ", grad_blocks.sizes(),
              " does not match ", K, " indices and ", C, " channels");
  const c10::cuda::CUDAGuard guard(grad_blocks.device());
  at::Tensor out = at::zeros(input_size, grad_blocks.options().memory_format(at::MemoryFormat::Contiguous));
  const at::Tensor gb = grad_blocks.contiguous();
  const at::Tensor idx = indices.contiguous();
  const int64_t total = gb.numel();
  if (total == 0) return out;
  const int64_t P = num_phases(g.size_h, g.stride_h), Q = num_phases(g.size_w, g.stride_w);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, gb.scalar_type(), "sbnet_gather_bw_cuda", [&] {
    for (int64_t py = 0; py < P; ++py) {
      for (int64_t px = 0; px < Q; ++px) {
        gather_backward_phase_kernel<scalar_t>
            <<<blocks_for(total), kThreads, 0, current_stream()>>>(
                gb.const_data_ptr<scalar_t>(), idx.const_data_ptr<int32_t>(), out.mutable_data_ptr<scalar_t>(),
                total, N, C, H, W, g, P, Q, py, px);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    }
  });
  return out;
}

}  // namespace
}  // namespace sbnet

TORCH_LIBRARY_IMPL(sbnet, CUDA, m) {
  m.impl("sparse_gather", &sbnet::sparse_gather_cuda);
  m.impl("sparse_gather_backward", &sbnet::sparse_gather_backward_cuda);
}
