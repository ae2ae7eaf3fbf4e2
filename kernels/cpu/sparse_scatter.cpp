// sparse_scatter (copy and in place) and its adjoint on the CPU, for NCHW and channels-last maps.
//
// Maps are planes of H x W pixels with E contiguous values per pixel (NCHW: N * C planes, E = 1; NHWC:
// N planes, E = C; see cpu/sparse_gather.cpp), so a tile row is one contiguous run in both layouts.
// One parallel region of (plane, row band) tasks (cpu/bands.h): a task copies its rows of base into the
// output (skipped in place) and then combines the tiles of its block row into them, so the rows are
// still in cache for the tiles and base is read once. Tiles do not overlap (bstride >= tile size, unique
// indices) and each task owns its rows: no races, and the result does not depend on the thread count.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstring>
#include <tuple>

#include "common.h"
#include "cpu/bands.h"

namespace sbnet {
namespace {

// How a tile value combines with the map value under it.
enum class Combine { kWrite, kAdd, kWriteRelu, kAddRelu, kZero };

inline Combine combine_of(bool add, bool relu) {
  return add ? (relu ? Combine::kAddRelu : Combine::kAdd) : (relu ? Combine::kWriteRelu : Combine::kWrite);
}

template <typename T>
inline void combine_run(T* d, const T* s, int64_t len, Combine how) {
  switch (how) {
    case Combine::kWrite:
      std::memcpy(d, s, sizeof(T) * len);
      break;
    case Combine::kAdd:
      for (int64_t e = 0; e < len; ++e) d[e] = d[e] + s[e];
      break;
    case Combine::kWriteRelu:
      for (int64_t e = 0; e < len; ++e) d[e] = s[e] < T(0) ? T(0) : s[e];
      break;
    case Combine::kAddRelu:
      for (int64_t e = 0; e < len; ++e) {
        const T v = d[e] + s[e];
        d[e] = v < T(0) ? T(0) : v;
      }
      break;
    case Combine::kZero:
      std::memset(d, 0, sizeof(T) * len);
      break;
  }
}

struct MapArgs {
  int64_t N, C, H, W;
  bool nhwc;
};

// out = (from ? copy of from : out) with each tile combined (`how`). out, from and tiles share a layout.
// tiles may be null for kZero.
void scatter_impl(const char* op, const at::Tensor* tiles, const at::Tensor& indices, const at::Tensor* from,
                  at::Tensor& out, const Grid& g, const MapArgs& m, Combine how) {
  const int64_t K = indices.size(0);
  if (K == 0 || m.C == 0) {
    if (from != nullptr) out.copy_(*from);
    return;
  }
  const at::Tensor idx = indices.contiguous();
  const int32_t* ip = idx.const_data_ptr<int32_t>();
  check_batch_range_cpu(op, ip, K, m.N);
  const RowBands bands(g, m.H, m.N, ip, K, 0);  // a tile lies within its own block row's band
  const int64_t th = g.size_h, tw = g.size_w, J = bands.count, H = m.H, W = m.W;
  const int64_t per_item = m.nhwc ? 1 : m.C, E = m.nhwc ? m.C : 1;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "sbnet_scatter_cpu", [&] {
    const scalar_t* src = tiles != nullptr ? tiles->const_data_ptr<scalar_t>() : nullptr;
    const scalar_t* base = from != nullptr ? from->const_data_ptr<scalar_t>() : nullptr;
    scalar_t* dst = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, m.N * per_item * J, std::max<int64_t>(1, 16384 / (g.stride_h * W * E)),
                     [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t q = t / J, jj = t % J, by = bands.first + jj, n = q / per_item, p = q % per_item;
        int64_t r0, r1;
        bands.rows(g, H, jj, r0, r1);
        scalar_t* plane = dst + q * H * W * E;
        if (base != nullptr) {
          std::memcpy(plane + r0 * W * E, base + q * H * W * E + r0 * W * E, sizeof(scalar_t) * (r1 - r0) * W * E);
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
          const scalar_t* tile = src != nullptr ? src + (k * per_item + p) * th * tw * E : nullptr;
          for (int64_t y = y0; y < y1; ++y) {
            const scalar_t* s = tile != nullptr ? tile + ((y - top) * tw + (x0 - left)) * E : nullptr;
            combine_run(plane + (y * W + x0) * E, s, (x1 - x0) * E, how);
          }
        }
      }
    });
  });
}

// Common checks of the scatter ops; returns the map's layout arguments.
MapArgs check_scatter(const char* op, const at::Tensor& blocks, const at::Tensor& indices, const at::Tensor& base,
                      const Grid& g) {
  TORCH_CHECK(blocks.dim() == 4 && base.dim() == 4, op,
              ": blocks [K, C, th, tw] and base [N, C, H, W] must be 4-D, got ", dims(blocks.sizes()), " and ",
              dims(base.sizes()));
  check_float(op, "blocks", blocks);
  TORCH_CHECK(blocks.scalar_type() == base.scalar_type(), op, ": blocks (", blocks.scalar_type(), ") and base (",
              base.scalar_type(), ") must have the same dtype");
  TORCH_CHECK(blocks.device() == base.device(), op, ": blocks and base must be on the same device");
  check_indices(op, indices, base);
  TORCH_CHECK(g.stride_h >= g.size_h && g.stride_w >= g.size_w, op, ": tiles ", dims(blocks.sizes().slice(2)),
              " would overlap with block stride (", num(g.stride_h), ", ", num(g.stride_w), ")");
  const int64_t K = indices.size(0), C = base.size(1);
  TORCH_CHECK(blocks.size(0) == K && blocks.size(1) == C, op, ": blocks ", dims(blocks.sizes()), " do not match ",
              num(K), " indices and base's ", num(C), " channels");
  const bool nhwc = is_nhwc(op, "base", base);
  check_layout(op, "blocks", blocks, nhwc);
  return MapArgs{base.size(0), C, base.size(2), base.size(3), nhwc};
}

at::Tensor sparse_scatter_cpu(const at::Tensor& blocks, const at::Tensor& indices, const at::Tensor& base,
                              c10::IntArrayRef bstride, c10::IntArrayRef boffset, bool add, bool relu) {
  const char* op = "sbnet::sparse_scatter";
  TORCH_CHECK(blocks.dim() == 4, op, ": blocks must be [K, C, th, tw], got ", dims(blocks.sizes()));
  const Grid g = make_grid(op, blocks.sizes().slice(2), bstride, boffset);
  const MapArgs m = check_scatter(op, blocks, indices, base, g);
  at::Tensor out = at::empty(base.sizes(), base.options().memory_format(format_of(m.nhwc)));  // filled from base
  scatter_impl(op, &blocks, indices, &base, out, g, m, combine_of(add, relu));
  return out;
}

void sparse_scatter_inplace_cpu(const at::Tensor& blocks, const at::Tensor& indices, at::Tensor& base,
                                c10::IntArrayRef bstride, c10::IntArrayRef boffset, bool add, bool relu) {
  const char* op = "sbnet::sparse_scatter_";
  TORCH_CHECK(blocks.dim() == 4, op, ": blocks must be [K, C, th, tw], got ", dims(blocks.sizes()));
  const Grid g = make_grid(op, blocks.sizes().slice(2), bstride, boffset);
  const MapArgs m = check_scatter(op, blocks, indices, base, g);
  scatter_impl(op, &blocks, indices, nullptr, base, g, m, combine_of(add, relu));
}

std::tuple<at::Tensor, at::Tensor> sparse_scatter_backward_cpu(const at::Tensor& grad_out, const at::Tensor& indices,
                                                               const c10::optional<at::Tensor>& out_tiles,
                                                               c10::IntArrayRef tile, c10::IntArrayRef bstride,
                                                               c10::IntArrayRef boffset, bool add, bool relu,
                                                               bool need_blocks, bool need_base) {
  const char* op = "sbnet::sparse_scatter_backward";
  const Grid g = make_grid(op, tile, bstride, boffset);
  TORCH_CHECK(grad_out.dim() == 4, op, ": grad_out must be [N, C, H, W], got ", dims(grad_out.sizes()));
  check_float(op, "grad_out", grad_out);
  check_indices(op, indices, grad_out);
  TORCH_CHECK(g.stride_h >= g.size_h && g.stride_w >= g.size_w, op, ": tiles ", dims(tile),
              " would overlap with block stride ", dims(bstride));
  const bool nhwc = is_nhwc(op, "grad_out", grad_out);
  const int64_t K = indices.size(0), C = grad_out.size(1);
  const MapArgs m{grad_out.size(0), C, grad_out.size(2), grad_out.size(3), nhwc};
  const at::MemoryFormat fmt = format_of(nhwc);
  at::Tensor on;  // relu: 1 where the scatter's output tile is > 0, as grad_out's dtype
  if (relu) {
    TORCH_CHECK(out_tiles.has_value() && out_tiles->defined(), op, ": relu needs out_tiles");
    const at::Tensor& ot = *out_tiles;
    TORCH_CHECK(ot.dim() == 4 && ot.size(0) == K && ot.size(1) == C && ot.size(2) == g.size_h &&
                    ot.size(3) == g.size_w && ot.scalar_type() == grad_out.scalar_type() &&
                    ot.device() == grad_out.device(),
                op, ": out_tiles must be ", dims({K, C, g.size_h, g.size_w}), " like grad_out, got ",
                dims(ot.sizes()), " ", ot.scalar_type());
    check_layout(op, "out_tiles", ot, nhwc);
    on = ot.gt(0).to(grad_out.scalar_type());
  }
  at::Tensor grad_blocks, grad_base;
  // grad_blocks: gather of grad_out at the tiles (0 outside the map), times `on`
  at::Tensor gathered;
  if (need_blocks || (need_base && add && relu)) {
    gathered = at::empty({K, C, g.size_h, g.size_w}, grad_out.options().memory_format(fmt));
    if (K > 0 && C > 0) {
      static auto gather = c10::Dispatcher::singleton().findSchemaOrThrow("sbnet::sparse_gather", "")
                               .typed<at::Tensor(const at::Tensor&, const at::Tensor&, c10::IntArrayRef,
                                                 c10::IntArrayRef, c10::IntArrayRef)>();
      gathered = gather.call(grad_out, indices, tile, bstride, boffset);
    }
    if (relu) gathered.mul_(on);
    if (need_blocks) grad_blocks = gathered;
  }
  if (need_base) {
    grad_base = at::empty(grad_out.sizes(), grad_out.options().memory_format(fmt));
    if (!add) {
      scatter_impl(op, nullptr, indices, &grad_out, grad_base, g, m, Combine::kZero);
    } else if (relu) {
      scatter_impl(op, &gathered, indices, &grad_out, grad_base, g, m, Combine::kWrite);
    } else {
      grad_base.copy_(grad_out);
    }
  }
  return {grad_blocks, grad_base};
}

}  // namespace
}  // namespace sbnet

TORCH_LIBRARY_IMPL(sbnet, CPU, m) {
  m.impl("sparse_scatter", &sbnet::sparse_scatter_cpu);
  m.impl("sparse_scatter_", &sbnet::sparse_scatter_inplace_cpu);
  m.impl("sparse_scatter_backward", &sbnet::sparse_scatter_backward_cpu);
}
