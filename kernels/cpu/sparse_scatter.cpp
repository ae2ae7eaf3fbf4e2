// sparse_scatter on the CPU, in one parallel region of (n, c, row band) tasks (cpu/bands.h): a task
// copies its rows of base into the output (skipped by the in-place variant) and then writes or adds
// the tiles of its block row into them, so the rows are still in cache for the tiles and base is
// read once. Tiles do not overlap (bstride >= tile size, unique indices) and each task owns its rows:
// no races, and the result does not depend on the thread count.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstring>

#include "common.h"
#include "cpu/bands.h"

namespace sbnet {
namespace {

// out = (base ? copy of base : out) with the tiles written or added. base and out are contiguous
// [N, C, H, W] (base may be null: in place).
void scatter_impl(const char* op, const at::Tensor& blocks, const at::Tensor& indices, const at::Tensor* base,
                  at::Tensor& out, c10::IntArrayRef bstride, c10::IntArrayRef boffset, bool add) {
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
  if (K == 0 || C == 0) {
    if (base != nullptr) out.copy_(*base);
    return;
  }
  const at::Tensor bc = blocks.contiguous();
  const at::Tensor idx = indices.contiguous();
  const int32_t* ip = idx.const_data_ptr<int32_t>();
  check_batch_range_cpu(op, ip, K, N);
  const RowBands bands(g, H, N, ip, K, 0);  // a tile lies within its own block row's band
  const int64_t th = g.size_h, tw = g.size_w, J = bands.count;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, bc.scalar_type(), "sbnet_scatter_cpu", [&] {
    const scalar_t* src = bc.const_data_ptr<scalar_t>();
    const scalar_t* from = base != nullptr ? base->const_data_ptr<scalar_t>() : nullptr;
    scalar_t* dst = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, N * C * J, std::max<int64_t>(1, 16384 / (g.stride_h * W)), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t n = t / (C * J), c = (t / J) % C, jj = t % J, by = bands.first + jj;
        int64_t r0, r1;
        bands.rows(g, H, jj, r0, r1);
        scalar_t* plane = dst + (n * C + c) * H * W;
        if (from != nullptr) {
          std::memcpy(plane + r0 * W, from + (n * C + c) * H * W + r0 * W, sizeof(scalar_t) * (r1 - r0) * W);
        }
        int64_t lo, hi;
        bands.range(n, by, lo, hi);
        for (int64_t i = lo; i < hi; ++i) {
          const int64_t k = bands.blocks[i];
          const int64_t top = g.offset_h + by * g.stride_h, left = g.offset_w + ip[3 * k + 2] * g.stride_w;
          int64_t y0, y1, x0, x1;
          clip(top, th, H, y0, y1);
          clip(left, tw, W, x0, x1);
          if (y0 >= y1 || x0 >= x1) continue;
          const scalar_t* tile = src + (k * C + c) * th * tw;
          for (int64_t y = y0; y < y1; ++y) {
            const scalar_t* s = tile + (y - top) * tw + (x0 - left);
            scalar_t* d = plane + y * W + x0;
            if (add) {
              for (int64_t x = 0; x < x1 - x0; ++x) d[x] = d[x] + s[x];
            } else {
              std::memcpy(d, s, sizeof(scalar_t) * (x1 - x0));
            }
          }
        }
      }
    });
  });
}

at::Tensor sparse_scatter_cpu(const at::Tensor& blocks, const at::Tensor& indices, const at::Tensor& base,
                              c10::IntArrayRef bstride, c10::IntArrayRef boffset, bool add) {
  TORCH_CHECK(base.dim() == 4, "sbnet::sparse_scatter: base must be [N, C, H, W], got ", base.sizes());
  const at::Tensor b = base.contiguous();
  at::Tensor out = at::empty(b.sizes(), b.options());  // filled band by band from base: one copy
  scatter_impl("sbnet::sparse_scatter", blocks, indices, &b, out, bstride, boffset, add);
  return out;
}

void sparse_scatter_inplace_cpu(const at::Tensor& blocks, const at::Tensor& indices, at::Tensor& base,
                                c10::IntArrayRef bstride, c10::IntArrayRef boffset, bool add) {
  TORCH_CHECK(base.dim() == 4, "sbnet::sparse_scatter_: base must be [N, C, H, W], got ", base.sizes());
  if (base.is_contiguous()) {
    scatter_impl("sbnet::sparse_scatter_", blocks, indices, nullptr, base, bstride, boffset, add);
  } else {
    at::Tensor tmp = base.contiguous();
    scatter_impl("sbnet::sparse_scatter_", blocks, indices, nullptr, tmp, bstride, boffset, add);
    base.copy_(tmp);
  }
}

}  // namespace
}  // namespace sbnet

TORCH_LIBRARY_IMPL(sbnet, CPU, m) {
  m.impl("sparse_scatter", &sbnet::sparse_scatter_cpu);
  m.impl("sparse_scatter_", &sbnet::sparse_scatter_inplace_cpu);
}
