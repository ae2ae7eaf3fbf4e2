// Shared argument checks and geometry of the sbnet kernels (CPU and CUDA).
//
// A block grid along one axis is (size, stride, offset): block b covers pixels
// offset + b * stride ... offset + b * stride + size - 1; pixels outside the map read as 0 (gather)
// or are dropped (scatter). The public Python functions (detector/ops/functional.py) check
// everything, including index ranges and uniqueness; the kernels re-check what memory safety needs.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <string>

#if defined(__CUDACC__)
#define SBNET_HD __host__ __device__ __forceinline__
#else
#define SBNET_HD inline
#endif

namespace sbnet {

// Numbers in messages: formatted by std::to_string, never streamed. A compiler that links parts of libstdc++
// into the library statically (as some GPU machines' toolchains do) gives it its own copy of the stream's
// number formatting (std::ostream::_M_insert<long>), whose locale facets are not the process's: streaming a
// size list into a TORCH_CHECK message segfaulted there instead of raising (tests/ops/test_cuda.py). Strings
// and c10's own types (dtype, device) stream safely.
inline std::string num(int64_t v) { return std::to_string(v); }

// "[a, b, c]"
inline std::string dims(c10::IntArrayRef v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(v[i]);
  }
  return s + "]";
}

struct Grid {
  int64_t size_h, size_w;      // block size (rows, columns)
  int64_t stride_h, stride_w;  // distance between neighbouring blocks
  int64_t offset_h, offset_w;  // first pixel of block (0, 0)
};

inline Grid make_grid(const char* op, c10::IntArrayRef size, c10::IntArrayRef stride,
                      c10::IntArrayRef offset) {
  TORCH_CHECK(size.size() == 2 && stride.size() == 2 && offset.size() == 2, op,
              ": block size, stride and offset must be pairs");
  TORCH_CHECK(size[0] > 0 && size[1] > 0, op, ": block size must be positive, got ", dims(size));
  TORCH_CHECK(stride[0] > 0 && stride[1] > 0, op, ": block stride must be positive, got ", dims(stride));
  return Grid{size[0], size[1], stride[0], stride[1], offset[0], offset[1]};
}

inline void check_float(const char* op, const char* name, const at::Tensor& t) {
  const auto s = t.scalar_type();
  TORCH_CHECK(s == at::kFloat || s == at::kDouble || s == at::kHalf || s == at::kBFloat16, op, ": ",
              name, " must be float16, bfloat16, float32 or float64, got ", s);
}

inline void check_indices(const char* op, const at::Tensor& indices, const at::Tensor& data) {
  TORCH_CHECK(indices.dim() == 2 && indices.size(1) == 3, op,
              ": indices must have shape [K, 3] (n, by, bx), got ", dims(indices.sizes()));
  TORCH_CHECK(indices.scalar_type() == at::kInt, op, ": indices must be int32, got ",
              indices.scalar_type());
  TORCH_CHECK(indices.device() == data.device(), op, ": indices are on ", indices.device(),
              " but the data is on ", data.device());
}

// Whether the 4-D tensor t is stored channels-last (NHWC); NCHW-contiguous is false (a tensor that is both,
// e.g. C == 1, counts as NCHW). Any other stride pattern is an error naming the op and the argument.
inline bool is_nhwc(const char* op, const char* name, const at::Tensor& t) {
  if (t.is_contiguous()) return false;
  TORCH_CHECK(t.is_contiguous(at::MemoryFormat::ChannelsLast), op, ": ", name,
              " must be contiguous in NCHW or channels-last memory format, got strides ", dims(t.strides()));
  return true;
}

// Check that t (blocks or a second map) is stored in the layout nhwc (as its map). An empty t holds nothing to lay
// out (and ops that make one, e.g. torch.where on K = 0 blocks, drop channels-last strides): any strides pass.
inline void check_layout(const char* op, const char* name, const at::Tensor& t, bool nhwc) {
  TORCH_CHECK(t.numel() == 0 || (nhwc ? t.is_contiguous(at::MemoryFormat::ChannelsLast) : t.is_contiguous()), op,
              ": ", name,
              " must be ", nhwc ? "channels-last" : "NCHW-contiguous", " like its map, got strides ",
              dims(t.strides()));
}

inline at::MemoryFormat format_of(bool nhwc) {
  return nhwc ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
}

// Host-side check that every batch index n lies in [0, N) (what memory safety needs on the CPU).
inline void check_batch_range_cpu(const char* op, const int32_t* idx, int64_t K, int64_t N) {
  for (int64_t k = 0; k < K; ++k) {
    TORCH_CHECK(idx[3 * k] >= 0 && idx[3 * k] < N, op, ": indices row ", num(k), " has n = ",
                num(idx[3 * k]), ", outside [0, ", num(N), ")");
  }
}

// [lo, hi) = [start, start + len) clipped to [0, limit); empty when lo >= hi.
SBNET_HD void clip(int64_t start, int64_t len, int64_t limit, int64_t& lo, int64_t& hi) {
  lo = start > 0 ? start : 0;
  hi = start + len < limit ? start + len : limit;
}

// Floor division for possibly negative numerators (positive d).
SBNET_HD int64_t floor_div(int64_t a, int64_t d) { return a >= 0 ? a / d : -((-a + d - 1) / d); }

// Number of phases along one axis such that blocks of the same phase never overlap:
// blocks b and b + P are P * stride >= size apart.
inline int64_t num_phases(int64_t size, int64_t stride) { return (size + stride - 1) / stride; }

template <typename I>
SBNET_HD I phase_of(I b, I phases) { return ((b % phases) + phases) % phases; }

}  // namespace sbnet
