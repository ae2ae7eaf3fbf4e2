// block_activity and reduce_mask on the CPU: one pass per block over the in-map part of its window (OpenMP
// over block rows) into a flag per block; reduce_mask then compacts the flags into ascending (n, by, bx) rows.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <limits>

#include "common.h"

namespace sbnet {
namespace {

// bool [N, bcount_h, bcount_w]: whether each block is active (checks name op).
at::Tensor activity(const char* op, const at::Tensor& mask, c10::IntArrayRef bsize, c10::IntArrayRef bstride,
                    c10::IntArrayRef boffset, c10::IntArrayRef bcount, double tol, bool avgpool) {
  const Grid g = make_grid(op, bsize, bstride, boffset);
  TORCH_CHECK(mask.dim() == 4 && mask.size(1) == 1, op, ": mask must be [N, 1, H, W], got ", dims(mask.sizes()));
  check_float(op, "mask", mask);
  TORCH_CHECK(bcount.size() == 2 && bcount[0] >= 0 && bcount[1] >= 0, op, ": bad bcount ", dims(bcount));
  const at::Tensor m = mask.contiguous();
  const int64_t N = m.size(0), H = m.size(2), W = m.size(3), bch = bcount[0], bcw = bcount[1];
  at::Tensor flags = at::empty({N, bch, bcw}, m.options().dtype(at::kBool));
  bool* active = flags.mutable_data_ptr<bool>();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, m.scalar_type(), "sbnet_reduce_mask_cpu", [&] {
    const scalar_t* data = m.const_data_ptr<scalar_t>();
    at::parallel_for(0, N * bch, 1, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        const int64_t n = row / bch, by = row % bch;
        int64_t y0, y1;
        clip(g.offset_h + by * g.stride_h, g.size_h, H, y0, y1);
        for (int64_t bx = 0; bx < bcw; ++bx) {
          int64_t x0, x1;
          clip(g.offset_w + bx * g.stride_w, g.size_w, W, x0, x1);
          if (y0 >= y1 || x0 >= x1) {  // window wholly outside the map: never active
            active[row * bcw + bx] = false;
            continue;
          }
          double value;
          if (avgpool) {
            double sum = 0.0;  // float64 accumulation, divided by the in-map pixel count
            for (int64_t y = y0; y < y1; ++y) {
              const scalar_t* p = data + (n * H + y) * W;
              for (int64_t x = x0; x < x1; ++x) sum += static_cast<double>(p[x]);
            }
            value = sum / static_cast<double>((y1 - y0) * (x1 - x0));
          } else {
            double best = -std::numeric_limits<double>::infinity();
            for (int64_t y = y0; y < y1; ++y) {
              const scalar_t* p = data + (n * H + y) * W;
              for (int64_t x = x0; x < x1; ++x) best = std::max(best, static_cast<double>(p[x]));
            }
            value = best;
          }
          active[row * bcw + bx] = value > tol;
        }
      }
    });
  });

  return flags;
}

at::Tensor block_activity_cpu(const at::Tensor& mask, c10::IntArrayRef bsize, c10::IntArrayRef bstride,
                              c10::IntArrayRef boffset, c10::IntArrayRef bcount, double tol, bool avgpool) {
  return activity("sbnet::block_activity", mask, bsize, bstride, boffset, bcount, tol, avgpool);
}

at::Tensor reduce_mask_cpu(const at::Tensor& mask, c10::IntArrayRef bsize, c10::IntArrayRef bstride,
                           c10::IntArrayRef boffset, c10::IntArrayRef bcount, double tol, bool avgpool) {
  const at::Tensor flags = activity("sbnet::reduce_mask", mask, bsize, bstride, boffset, bcount, tol, avgpool);
  const bool* active = flags.const_data_ptr<bool>();
  const int64_t total = flags.numel(), bch = flags.size(1), bcw = flags.size(2);
  int64_t K = 0;
  for (int64_t i = 0; i < total; ++i) K += active[i];
  at::Tensor out = at::empty({K, 3}, flags.options().dtype(at::kInt));
  int32_t* o = out.mutable_data_ptr<int32_t>();
  for (int64_t i = 0, k = 0; i < total; ++i) {
    if (!active[i]) continue;
    o[3 * k] = static_cast<int32_t>(i / (bch * bcw));
    o[3 * k + 1] = static_cast<int32_t>((i / bcw) % bch);
    o[3 * k + 2] = static_cast<int32_t>(i % bcw);
    ++k;
  }
  return out;
}

}  // namespace
}  // namespace sbnet

TORCH_LIBRARY_IMPL(sbnet, CPU, m) {
  m.impl("reduce_mask", &sbnet::reduce_mask_cpu);
  m.impl("block_activity", &sbnet::block_activity_cpu);
}
