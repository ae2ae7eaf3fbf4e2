// Host side of reduce_mask.cu (shared with the emulator; see cuda/host.h): block_activity is one kernel
// with one element per block of the grid (its in-map window's max, or float64 mean, > tol) into a flag per
// block; reduce_mask lists the flagged blocks with at::nonzero in ascending (n, by, bx) order (deterministic).
#pragma once

#include <ATen/ops/nonzero.h>

#include "cuda/host.h"

namespace sbnet {
namespace plan {

template <typename T>
struct ReduceMaskFn {
  const T* mask;
  bool* active;
  int64_t H, W, bcount_h, bcount_w;
  Grid g;
  double tol;
  bool avgpool;
  SBNET_HD void operator()(int64_t i) const {
    active[i] = reduce_mask_element(i, mask, H, W, bcount_h, bcount_w, g, tol, avgpool);
  }
};

// bool [N, bcount_h, bcount_w]: whether each block is active (checks name op).
template <class Exec>
at::Tensor activity(const char* op, const at::Tensor& mask, c10::IntArrayRef bsize, c10::IntArrayRef bstride,
                    c10::IntArrayRef boffset, c10::IntArrayRef bcount, double tol, bool avgpool) {
  const Grid g = make_grid(op, bsize, bstride, boffset);
  TORCH_CHECK(mask.dim() == 4 && mask.size(1) == 1, op, ": mask must be [N, 1, H, W], got ", dims(mask.sizes()));
  check_float(op, "mask", mask);
  TORCH_CHECK(bcount.size() == 2 && bcount[0] >= 0 && bcount[1] >= 0, op,
              ": bcount must be a pair of non-negative block counts, got ", dims(bcount));
  const typename Exec::Guard guard(mask.device());
  const at::Tensor m = mask.contiguous();  // one channel: NCHW and channels-last are the same order
  const int64_t N = m.size(0), H = m.size(2), W = m.size(3);
  at::Tensor active = at::empty({N, bcount[0], bcount[1]}, m.options().dtype(at::kBool));
  const int64_t total = active.numel();
  if (total > 0) {
    SBNET_DISPATCH_FLOAT(m.scalar_type(), "sbnet::block_activity", [&] {
      Exec::launch(total, ReduceMaskFn<scalar_t>{m.const_data_ptr<scalar_t>(), active.mutable_data_ptr<bool>(), H, W,
                                                 bcount[0], bcount[1], g, tol, avgpool});
    });
  }
  return active;
}

template <class Exec>
at::Tensor block_activity(const at::Tensor& mask, c10::IntArrayRef bsize, c10::IntArrayRef bstride,
                          c10::IntArrayRef boffset, c10::IntArrayRef bcount, double tol, bool avgpool) {
  return activity<Exec>("sbnet::block_activity", mask, bsize, bstride, boffset, bcount, tol, avgpool);
}

template <class Exec>
at::Tensor reduce_mask(const at::Tensor& mask, c10::IntArrayRef bsize, c10::IntArrayRef bstride,
                       c10::IntArrayRef boffset, c10::IntArrayRef bcount, double tol, bool avgpool) {
  const at::Tensor active = activity<Exec>("sbnet::reduce_mask", mask, bsize, bstride, boffset, bcount, tol, avgpool);
  const typename Exec::Guard guard(mask.device());
  // CUDA's nonzero returns its [K, 3] result transposed (column-major); the indices must be row-major
  // contiguous like the CPU kernel's: every op copies non-contiguous indices, and the Python wrappers re-check
  // (sort + host sync) indices they cannot recognize as reduce_mask's own: a sort and a copy per op, every
  // forward (docs/gpu.md).
  return at::nonzero(active).to(at::kInt, /*non_blocking=*/false, /*copy=*/false, at::MemoryFormat::Contiguous);
}

}  // namespace plan
}  // namespace sbnet
