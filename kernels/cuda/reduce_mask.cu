// reduce_mask on CUDA: one thread per block of the grid reduces the in-map part of its window
// (max, or float64 mean over the in-map pixels) into a flag; at::nonzero then lists the active
// blocks in ascending (n, by, bx) order (deterministic).
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/nonzero.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <math.h>

#include "common.h"
#include "cuda/launch.cuh"

namespace sbnet {
namespace {

// float64 value of a mask element (exact for every supported dtype, like the CPU kernel).
template <typename scalar_t>
__device__ __forceinline__ double as_double(scalar_t v) {
  return static_cast<double>(static_cast<float>(v));
}
template <>
__device__ __forceinline__ double as_double<double>(double v) {
  return v;
}

template <typename scalar_t>
__global__ void reduce_mask_kernel(const scalar_t* __restrict__ mask, bool* __restrict__ active, int64_t total,
                                   int64_t H, int64_t W, int64_t bch, int64_t bcw, Grid g, double tol,
                                   bool avgpool) {
  SBNET_KERNEL_LOOP(i, total) {
    const int64_t bx = i % bcw, by = (i / bcw) % bch, n = i / (bcw * bch);
    int64_t y0, y1, x0, x1;
    clip(g.offset_h + by * g.stride_h, g.size_h, H, y0, y1);
    clip(g.offset_w + bx * g.stride_w, g.size_w, W, x0, x1);
    bool on = false;
    if (y0 < y1 && x0 < x1) {  // a window wholly outside the map is never active
      double value = avgpool ? 0.0 : -INFINITY;
      for (int64_t y = y0; y < y1; ++y) {
        const scalar_t* p = mask + (n * H + y) * W;
        for (int64_t x = x0; x < x1; ++x) {
          const double v = as_double(p[x]);
          value = avgpool ? value + v : (v > value ? v : value);
        }
      }
      if (avgpool) value /= static_cast<double>((y1 - y0) * (x1 - x0));
      on = value > tol;
    }
    active[i] = on;
  }
}

at::Tensor reduce_mask_cuda(const at::Tensor& mask, c10::IntArrayRef bsize, c10::IntArrayRef bstride,
                            c10::IntArrayRef boffset, c10::IntArrayRef bcount, double tol, bool avgpool) {
  const char* op = "sbnet::reduce_mask";
  const Grid g = make_grid(op, bsize, bstride, boffset);
  TORCH_CHECK(mask.dim() == 4 && mask.size(1) == 1, op, ": mask must be [N, 1, H, W], got ", mask.sizes());
  check_float(op, "mask", mask);
  TORCH_CHECK(bcount.size() == 2 && bcount[0] >= 0 && bcount[1] >= 0, op, ": bad bcount ", bcount);
  const c10::cuda::CUDAGuard guard(mask.device());
  const at::Tensor m = mask.contiguous();
  const int64_t N = m.size(0), H = m.size(2), W = m.size(3), bch = bcount[0], bcw = bcount[1];
  at::Tensor active = at::empty({N, bch, bcw}, m.options().dtype(at::kBool));
  const int64_t total = active.numel();
  if (total > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, m.scalar_type(), "sbnet_reduce_mask_cuda", [&] {
      reduce_mask_kernel<scalar_t><<<blocks_for(total), kThreads, 0, current_stream()>>>(
          m.const_data_ptr<scalar_t>(), active.mutable_data_ptr<bool>(), total, H, W, bch, bcw, g, tol,
          avgpool);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  return at::nonzero(active).to(at::kInt);
}

}  // namespace
}  // namespace sbnet

TORCH_LIBRARY_IMPL(sbnet, CUDA, m) { m.impl("reduce_mask", &sbnet::reduce_mask_cuda); }
