// sparse_scatter on the CPU: one copy of base (none for the in-place variant), then each block's
// tile written or added row by row (memcpy for writes), OpenMP over K * C (block, channel) planes.
// Tiles do not overlap (bstride >= tile size, unique indices), so the planes run without races and
// the result does not depend on the thread count.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#include "common.h"

namespace sbnet {
namespace {

void write_tiles(const char* op, const at::Tensor& blocks, const at::Tensor& indices, at::Tensor& out,
                 c10::IntArrayRef bstride, c10::IntArrayRef boffset, bool add) {
  TORCH_CHECK(blocks.dim() == 4 && out.dim() == 4, op, ": blocks [K, C, th, tw] and base [N, C, H, W] must be 4-D, got ",
              blocks.sizes(), " and ", out.sizes());
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
  if (K == 0 || C == 0) return;
  const at::Tensor bc = blocks.contiguous();
  const at::Tensor idx = indices.contiguous();
  const int32_t* ip = idx.const_data_ptr<int32_t>();
  check_batch_range_cpu(op, ip, K, N);
  const int64_t th = g.size_h, tw = g.size_w;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, bc.scalar_type(), "sbnet_scatter_cpu", [&] {
    const scalar_t* src = bc.const_data_ptr<scalar_t>();
    scalar_t* dst = out.mutable_data_ptr<scalar_t>();
    const int64_t grain = std::max<int64_t>(1, 16384 / (th * tw));
    at::parallel_for(0, K * C, grain, [&](int64_t begin, int64_t end) {
      for (int64_t kc = begin; kc < end; ++kc) {
        const int64_t k = kc / C, c = kc % C;
        const int64_t n = ip[3 * k], top = g.offset_h + ip[3 * k + 1] * g.stride_h,
                      left = g.offset_w + ip[3 * k + 2] * g.stride_w;
        int64_t y0, y1, x0, x1;
        clip(top, th, H, y0, y1);
        clip(left, tw, W, x0, x1);
        if (y0 >= y1 || x0 >= x1) continue;
        const scalar_t* tile = src + kc * th * tw;
        scalar_t* plane = dst + (n * C + c) * H * W;
        for (int64_t y = y0; y < y1; ++y) {
          const scalar_t* s = tile + (y - top) * tw + (x0 - left);
          scalar_t* d = plane + y * W + x0;
          if (add) {
            for (int64_t i = 0; i < x1 - x0; ++i) d[i] = d[i] + s[i];
          } else {
            std::memcpy(d, s, sizeof(scalar_t) * (x1 - x0));
          }
        }
      }
    });
  });
}

at::Tensor sparse_scatter_cpu(const at::Tensor& blocks, const at::Tensor& indices, const at::Tensor& base,
                              c10::IntArrayRef bstride, c10::IntArrayRef boffset, bool add) {
  at::Tensor out = base.clone(at::MemoryFormat::Contiguous);  // the one copy of base
  write_tiles("sbnet::sparse_scatter", blocks, indices, out, bstride, boffset, add);
  return out;
}

void sparse_scatter_inplace_cpu(const at::Tensor& blocks, const at::Tensor& indices, at::Tensor& base,
                                c10::IntArrayRef bstride, c10::IntArrayRef boffset, bool add) {
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

TORCH_LIBRARY_IMPL(sbnet, CPU, m) {
  m.impl("sparse_scatter", &sbnet::sparse_scatter_cpu);
  m.impl("sparse_scatter_", &sbnet::sparse_scatter_inplace_cpu);
}
