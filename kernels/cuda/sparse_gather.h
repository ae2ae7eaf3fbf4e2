// Host side of sparse_gather.cu (shared with the emulator; see cuda/host.h): sparse_gather,
// sparse_gather_backward and sparse_gather_backward_.
//
// Gather: one kernel, one element per block element, in the blocks' memory order (coalesced writes).
// Adjoint: one kernel per phase (py, px) of P x Q (P = ceil(bsize_h / bstride_h)), in row-major phase
// order on one stream. Blocks of one phase never overlap, so each map element has at most one writer
// per kernel: plain read-add-write, no atomics; every element's sum has the same order on every run
// (deterministic, also under torch.use_deterministic_algorithms) and the same order as the CPU kernel.
#pragma once

#include "cuda/host.h"

namespace sbnet {
namespace plan {

template <typename T, typename I>
struct GatherFn {
  const T* x;
  const int32_t* idx;
  T* out;
  Grid g;
  Layout m;
  SBNET_HD void operator()(int64_t i) const { gather_element<I>(i, x, idx, out, g, m); }
};

template <typename T, typename I>
struct GatherBackwardFn {
  const T* grad_blocks;
  const int32_t* idx;
  T* dst;
  Grid g;
  Layout m;
  int64_t P, Q, py, px;
  SBNET_HD void operator()(int64_t i) const {
    gather_backward_element<I>(i, grad_blocks, idx, dst, g, m, P, Q, py, px);
  }
};

template <class Exec>
at::Tensor sparse_gather(const at::Tensor& x, const at::Tensor& indices, c10::IntArrayRef bsize,
                         c10::IntArrayRef bstride, c10::IntArrayRef boffset) {
  const char* op = "sbnet::sparse_gather";
  const Grid g = make_grid(op, bsize, bstride, boffset);
  check_dim4(op, "x", x, "[N, C, H, W]");
  check_float(op, "x", x);
  const bool nhwc = is_nhwc(op, "x", x);
  check_indices(op, indices, x);
  const typename Exec::Guard guard(x.device());
  const at::Tensor idx = indices.contiguous();
  const Layout m = layout_of(x.sizes(), nhwc);
  at::Tensor out = at::empty({idx.size(0), m.C, g.size_h, g.size_w}, x.options().memory_format(format_of(nhwc)));
  const int64_t total = out.numel();
  if (total == 0) return out;
  SBNET_DISPATCH_FLOAT(x.scalar_type(), "sbnet::sparse_gather", [&] {
    with_index_type<Exec>({total, x.numel()}, [&](auto index) {
      Exec::launch(total, GatherFn<scalar_t, decltype(index)>{x.const_data_ptr<scalar_t>(), idx.const_data_ptr<int32_t>(),
                                                              out.mutable_data_ptr<scalar_t>(), g, m});
    });
  });
  return out;
}

// Adds grad_blocks (checked: the map's layout, K and C) into dst, phase by phase.
template <class Exec>
void add_blocks(const at::Tensor& grad_blocks, const at::Tensor& idx, const at::Tensor& dst, const Grid& g,
                const Layout& m) {
  const int64_t total = grad_blocks.numel();
  if (total == 0) return;
  const int64_t P = num_phases(g.size_h, g.stride_h), Q = num_phases(g.size_w, g.stride_w);
  SBNET_DISPATCH_FLOAT(grad_blocks.scalar_type(), "sbnet::sparse_gather_backward", [&] {
    with_index_type<Exec>({total, dst.numel()}, [&](auto index) {
      for (int64_t py = 0; py < P; ++py) {
        for (int64_t px = 0; px < Q; ++px) {
          Exec::launch(total, GatherBackwardFn<scalar_t, decltype(index)>{
                                  grad_blocks.const_data_ptr<scalar_t>(), idx.const_data_ptr<int32_t>(),
                                  dst.mutable_data_ptr<scalar_t>(), g, m, P, Q, py, px});
        }
      }
    });
  });
}

template <class Exec>
at::Tensor sparse_gather_backward(const at::Tensor& grad_blocks, const at::Tensor& indices,
                                  c10::IntArrayRef input_size, c10::IntArrayRef bstride, c10::IntArrayRef boffset,
                                  bool channels_last) {
  const char* op = "sbnet::sparse_gather_backward";
  check_dim4(op, "grad_blocks", grad_blocks, "[K, C, bh, bw]");
  check_float(op, "grad_blocks", grad_blocks);
  TORCH_CHECK(input_size.size() == 4 && input_size[0] >= 0 && input_size[1] >= 0 && input_size[2] >= 0 &&
                  input_size[3] >= 0,
              op, ": input_size must be 4 sizes [N, C, H, W], got ", dims(input_size));
  const Grid g = make_grid(op, grad_blocks.sizes().slice(2), bstride, boffset);
  check_indices(op, indices, grad_blocks);
  check_blocks(op, "grad_blocks", grad_blocks, indices.size(0), input_size[1]);
  check_layout(op, "grad_blocks", grad_blocks, channels_last);
  const typename Exec::Guard guard(grad_blocks.device());
  const at::Tensor idx = indices.contiguous();
  at::Tensor out = at::empty(input_size, grad_blocks.options().memory_format(format_of(channels_last)));
  out.zero_();
  add_blocks<Exec>(grad_blocks, idx, out, g, layout_of(input_size, channels_last));
  return out;
}

template <class Exec>
void sparse_gather_backward_(const at::Tensor& grad_blocks, const at::Tensor& indices, at::Tensor& grad_x,
                             c10::IntArrayRef bstride, c10::IntArrayRef boffset) {
  const char* op = "sbnet::sparse_gather_backward_";
  check_dim4(op, "grad_x", grad_x, "[N, C, H, W]");
  check_float(op, "grad_x", grad_x);
  const bool nhwc = is_nhwc(op, "grad_x", grad_x);
  check_dim4(op, "grad_blocks", grad_blocks, "[K, C, bh, bw]");
  check_like(op, "grad_blocks", grad_blocks, "grad_x", grad_x);
  const Grid g = make_grid(op, grad_blocks.sizes().slice(2), bstride, boffset);
  check_indices(op, indices, grad_x);
  check_blocks(op, "grad_blocks", grad_blocks, indices.size(0), grad_x.size(1));
  check_layout(op, "grad_blocks", grad_blocks, nhwc);
  const typename Exec::Guard guard(grad_x.device());
  const at::Tensor idx = indices.contiguous();
  add_blocks<Exec>(grad_blocks, idx, grad_x, g, layout_of(grad_x.sizes(), nhwc));  // in place
}

}  // namespace plan
}  // namespace sbnet
