// Host side of sparse_scatter.cu (shared with the emulator; see cuda/host.h): sparse_scatter,
// sparse_scatter_ and sparse_scatter_backward.
//
// Scatter: one copy of base in its layout (none for the in-place variant), then one kernel with one
// element per tile element. Tiles never overlap (bstride >= tile, unique indices), so each map element
// has at most one writer: plain stores, no atomics, deterministic. The adjoint is one kernel too:
// grad_blocks gathered at the tiles, and grad_base (a copy of grad_out) zeroed where the tile's
// gradient went to the blocks only.
#pragma once

#include <optional>
#include <tuple>

#include "cuda/host.h"

namespace sbnet {
namespace plan {

template <typename T, typename I>
struct ScatterFn {
  const T* tiles;
  const int32_t* idx;
  T* out;
  Grid g;
  Layout m;
  bool add, relu;
  SBNET_HD void operator()(int64_t i) const { scatter_element<I>(i, tiles, idx, out, g, m, add, relu); }
};

template <typename T, typename I>
struct ScatterBackwardFn {
  const T* grad_out;
  const T* out_tiles;  // null without relu
  const int32_t* idx;
  T* grad_blocks;  // null when not needed
  T* grad_base;    // null when not needed
  Grid g;
  Layout m;
  bool add, relu;
  SBNET_HD void operator()(int64_t i) const {
    scatter_backward_element<I>(i, grad_out, out_tiles, idx, grad_blocks, grad_base, g, m, add, relu);
  }
};

// The tile grid (size = tile, stride >= tile) of a scatter into map [N, C, H, W].
inline Grid tile_grid(const char* op, c10::IntArrayRef tile, c10::IntArrayRef bstride, c10::IntArrayRef boffset) {
  const Grid g = make_grid(op, tile, bstride, boffset);
  TORCH_CHECK(g.stride_h >= g.size_h && g.stride_w >= g.size_w, op, ": tiles ", dims(tile),
              " would overlap with block stride ", dims(bstride));
  return g;
}

// Checks of scatter and scatter_: base is the map, blocks [K, C, th, tw] in its layout.
inline Layout check_scatter(const char* op, const at::Tensor& blocks, const at::Tensor& indices,
                            const at::Tensor& base) {
  check_dim4(op, "base", base, "[N, C, H, W]");
  check_float(op, "base", base);
  const bool nhwc = is_nhwc(op, "base", base);
  check_dim4(op, "blocks", blocks, "[K, C, th, tw]");
  check_like(op, "blocks", blocks, "base", base);
  check_indices(op, indices, base);
  check_blocks(op, "blocks", blocks, indices.size(0), base.size(1));
  check_layout(op, "blocks", blocks, nhwc);
  return layout_of(base.sizes(), nhwc);
}

template <class Exec>
void write_tiles(const at::Tensor& blocks, const at::Tensor& indices, const at::Tensor& out, const Grid& g,
                 const Layout& m, bool add, bool relu) {
  const int64_t total = blocks.numel();
  if (total == 0) return;
  const at::Tensor idx = indices.contiguous();
  SBNET_DISPATCH_FLOAT(blocks.scalar_type(), "sbnet::sparse_scatter", [&] {
    with_index_type<Exec>({total, out.numel()}, [&](auto index) {
      Exec::launch(total, ScatterFn<scalar_t, decltype(index)>{blocks.const_data_ptr<scalar_t>(),
                                                               idx.const_data_ptr<int32_t>(),
                                                               out.mutable_data_ptr<scalar_t>(), g, m, add, relu});
    });
  });
}

template <class Exec>
at::Tensor sparse_scatter(const at::Tensor& blocks, const at::Tensor& indices, const at::Tensor& base,
                          c10::IntArrayRef bstride, c10::IntArrayRef boffset, bool add, bool relu) {
  const char* op = "sbnet::sparse_scatter";
  const Layout m = check_scatter(op, blocks, indices, base);
  const Grid g = tile_grid(op, blocks.sizes().slice(2), bstride, boffset);
  const typename Exec::Guard guard(base.device());
  at::Tensor out = base.clone(format_of(m.nhwc));  // the one copy of base
  write_tiles<Exec>(blocks, indices, out, g, m, add, relu);
  return out;
}

template <class Exec>
void sparse_scatter_(const at::Tensor& blocks, const at::Tensor& indices, at::Tensor& base,
                     c10::IntArrayRef bstride, c10::IntArrayRef boffset, bool add, bool relu) {
  const char* op = "sbnet::sparse_scatter_";
  const Layout m = check_scatter(op, blocks, indices, base);
  const Grid g = tile_grid(op, blocks.sizes().slice(2), bstride, boffset);
  const typename Exec::Guard guard(base.device());
  write_tiles<Exec>(blocks, indices, base, g, m, add, relu);  // in place
}

template <class Exec>
std::tuple<at::Tensor, at::Tensor> sparse_scatter_backward(const at::Tensor& grad_out, const at::Tensor& indices,
                                                           const std::optional<at::Tensor>& out_tiles,
                                                           c10::IntArrayRef tile, c10::IntArrayRef bstride,
                                                           c10::IntArrayRef boffset, bool add, bool relu,
                                                           bool need_blocks, bool need_base) {
  const char* op = "sbnet::sparse_scatter_backward";
  check_dim4(op, "grad_out", grad_out, "[N, C, H, W]");
  check_float(op, "grad_out", grad_out);
  const bool nhwc = is_nhwc(op, "grad_out", grad_out);
  const Grid g = tile_grid(op, tile, bstride, boffset);
  check_indices(op, indices, grad_out);
  const int64_t K = indices.size(0), C = grad_out.size(1);
  const at::Tensor* on = nullptr;  // out_tiles, used with relu only
  if (relu) {
    TORCH_CHECK(out_tiles.has_value() && out_tiles->defined(), op,
                ": out_tiles (the scatter's output at the tiles) is required with relu");
    on = &*out_tiles;
    check_dim4(op, "out_tiles", *on, "[K, C, th, tw]");
    check_like(op, "out_tiles", *on, "grad_out", grad_out);
    check_blocks(op, "out_tiles", *on, K, C);
    TORCH_CHECK(on->size(2) == g.size_h && on->size(3) == g.size_w, op, ": out_tiles ", dims(on->sizes()),
                " does not match the tile ", dims(tile));
    check_layout(op, "out_tiles", *on, nhwc);
  }
  const typename Exec::Guard guard(grad_out.device());
  const at::TensorOptions options = grad_out.options().memory_format(format_of(nhwc));
  at::Tensor grad_blocks = need_blocks ? at::empty({K, C, g.size_h, g.size_w}, options) : at::Tensor();
  at::Tensor grad_base = need_base ? grad_out.clone(format_of(nhwc)) : at::Tensor();
  const bool base_changes = need_base && !(add && !relu);  // add without relu passes grad_out through
  const int64_t total = K * C * g.size_h * g.size_w;
  if (total == 0 || !(need_blocks || base_changes)) return {grad_blocks, grad_base};
  const at::Tensor idx = indices.contiguous();
  const Layout m = layout_of(grad_out.sizes(), nhwc);
  SBNET_DISPATCH_FLOAT(grad_out.scalar_type(), "sbnet::sparse_scatter_backward", [&] {
    with_index_type<Exec>({total, grad_out.numel()}, [&](auto index) {
      Exec::launch(total, ScatterBackwardFn<scalar_t, decltype(index)>{
                              grad_out.const_data_ptr<scalar_t>(), on ? on->const_data_ptr<scalar_t>() : nullptr,
                              idx.const_data_ptr<int32_t>(),
                              need_blocks ? grad_blocks.mutable_data_ptr<scalar_t>() : nullptr,
                              base_changes ? grad_base.mutable_data_ptr<scalar_t>() : nullptr, g, m, add, relu});
    });
  });
  return {grad_blocks, grad_base};
}

}  // namespace plan
}  // namespace sbnet
