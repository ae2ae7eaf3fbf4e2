// sparse_scatter on CUDA: one copy of base (none for the in-place variant), then one thread per
// tile element writes or adds it. Tiles do not overlap (bstride >= tile size, unique indices), so
// each output element has at most one writer: plain stores/adds, no atomics, deterministic (also
// under torch.use_deterministic_algorithms).
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "common.h"
#include "cuda/launch.cuh"

namespace sbnet {
namespace {

template <typename scalar_t>
__global__ void scatter_kernel(const scalar_t* __restrict__ blocks, const int32_t* __restrict__ idx,
                               scalar_t* __restrict__ out, int64_t total, int64_t N, int64_t C, int64_t H,
                               int64_t W, Grid g, bool add) {
  SBNET_KERNEL_LOOP(i, total) {
    const int64_t j = i % g.size_w, r = (i / g.size_w) % g.size_h, kc = i / (g.size_w * g.size_h);
    const int64_t k = kc / C, c = kc % C;
    const int64_t n = idx[3 * k];
    const int64_t y = g.offset_h + idx[3 * k + 1] * g.stride_h + r;
    const int64_t xx = g.offset_w + idx[3 * k + 2] * g.stride_w + j;
    if (n < 0 || n >= N || y < 0 || y >= H || xx < 0 || xx >= W) continue;  // clipped to the map
    scalar_t* d = out + ((n * C + c) * H + y) * W + xx;
    *d = add ? *d + blocks[i] : blocks[i];  // the only writer of this element
  }
}

void write_tiles(const char* op, const at::Tensor& blocks, const at::Tensor& indices, at::Tensor& out,
                 c10::IntArrayRef bstride, c10::IntArrayRef boffset, bool add) {
  TORCH_CHECK(blocks.dim() == 4 && out.dim() == 4, op,
              ": blocks [K, C, th, tw] and base [N, C, H, W] must be 4-D, got ", blocks.sizes(), " and ",
              out.sizes());
  check_float(op, "blocks", blocks);
  TORCH_CHECK(blocks.scalar_type() == out.scalar_type(), op, ": blocks (", blocks.scalar_type(),
              ") and base (", out.scalar_type(), ") must have the same dtype");
  TORCH_CHECK(blocks.device() == out.device(), op, ": blocks and base must be on the same device");
  check_indices(op, indices, out);
  const Grid g = make_grid(op, blocks.sizes().slice(2), bstride, boffset);
  TORCH_CHECK(g.stride_h >= g.size_h && g.stride_w >= g.size_w, op, ": tiles ", blocks.sizes().slice(2),
              " would overlap with block stride ", bstride);
  const int64_t K = indices.size(0), C = out.size(1), N = out.size(0), H = out.size(2), W = out.size(3);
  TORCH_CHECK(blocks.size(0) == K && blocks.size(1) == C, op, ": blocks ", blocks.sizes(), " do not match ", K,
              " indices and base's ", C, " channels");
  const at::Tensor bc = blocks.contiguous();
  const at::Tensor idx = indices.contiguous();
  const int64_t total = bc.numel();
  if (total == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, bc.scalar_type(), "sbnet_scatter_cuda", [&] {
    scatter_kernel<scalar_t><<<blocks_for(total), kThreads, 0, current_stream()>>>(
        bc.const_data_ptr<scalar_t>(), idx.const_data_ptr<int32_t>(), out.mutable_data_ptr<scalar_t>(), total,
        N, C, H, W, g, add);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

at::Tensor sparse_scatter_cuda(const at::Tensor& blocks, const at::Tensor& indices, const at::Tensor& base,
                               c10::IntArrayRef bstride, c10::IntArrayRef boffset, bool add) {
  const c10::cuda::CUDAGuard guard(base.device());
  at::Tensor out = base.clone(at::MemoryFormat::Contiguous);  // the one copy of base
  write_tiles("sbnet::sparse_scatter", blocks, indices, out, bstride, boffset, add);
  return out;
}

void sparse_scatter_inplace_cuda(const at::Tensor& blocks, const at::Tensor& indices, at::Tensor& base,
                                 c10::IntArrayRef bstride, c10::IntArrayRef boffset, bool add) {
  const c10::cuda::CUDAGuard guard(base.device());
  if (base.is_contiguous()) {
    write_tiles("sbnet::sparse_scatter_", blocks, indices, base, bstride, boffset, add);
  } else {
    at::Tensor tmp = base.contiguous();
    write_tiles("sbnet::sparse_scatter_", blocks, indices, tmp, bstride, boffset, add);
    base.copy_(tmp);
  }
}

}  // namespace
}  // namespace sbnet

TORCH_LIBRARY_IMPL(sbnet, CUDA, m) {
  m.impl("sparse_scatter", &sbnet::sparse_scatter_cuda);
  m.impl("sparse_scatter_", &sbnet::sparse_scatter_inplace_cuda);
}
