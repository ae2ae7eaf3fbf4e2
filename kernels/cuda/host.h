// Host side of the sbnet CUDA kernels, shared with their CPU emulation (emulate/cuda_bodies.cpp).
//
// Each op's host code (argument checks, allocation, dtype dispatch, the sequence of launches: the
// adjoint's phase loop) is a function template `plan::op<Exec>` in cuda/<op>.h. Exec is the device:
//
//   struct Exec {
//     using Guard = ...;                       // device guard, constructed from a c10::Device
//     template <class F>
//     static void launch(int64_t total, const F& f);  // one kernel: f(i) for every i in [0, total)
//     static bool index64();                            // force 64-bit index arithmetic (with_index_type)
//   };
//
// cuda/launch.cuh's CudaExec launches a grid-stride loop (SBNET_KERNEL_LOOP) on the current stream;
// the emulator's EmuExec runs the same loop serially on the host. Every functor F below calls exactly
// one body from elements.h, so the CUDA build and the emulated build differ only in Exec.
//
// The plans' C++ signatures must equal the CPU kernels' (the dispatcher checks it when the library loads):
// const at::Tensor& for inputs, at::Tensor& for the Tensor(a!) arguments of the in-place ops.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <initializer_list>

#include "common.h"
#include "elements.h"

namespace sbnet {
namespace plan {

// Every float dtype the ops take: float16, bfloat16, float32, float64.
#define SBNET_DISPATCH_FLOAT(type, name, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, type, name, __VA_ARGS__)

inline void check_dim4(const char* op, const char* name, const at::Tensor& t, const char* shape) {
  TORCH_CHECK(t.dim() == 4, op, ": ", name, " must be 4-D ", shape, ", got ", dims(t.sizes()));
}

// A second data tensor (blocks, a second map) must match the first one's dtype and device.
inline void check_like(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                       const at::Tensor& ref) {
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), op, ": ", name, " (", t.scalar_type(), ") and ", ref_name,
              " (", ref.scalar_type(), ") must have the same dtype");
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " is on ", t.device(), " but ", ref_name, " is on ",
              ref.device());
}

// A block tensor [K, C, h, w] must have one row per index and its map's channels.
inline void check_blocks(const char* op, const char* name, const at::Tensor& blocks, int64_t K, int64_t C) {
  TORCH_CHECK(blocks.size(0) == K && blocks.size(1) == C, op, ": ", name, " ", dims(blocks.sizes()),
              " does not match ", num(K), " indices and the map's ", num(C), " channels");
}

// Calls fn(I{}) with the index type of a launch's element bodies (elements.h): int32_t when every offset
// it computes (elements of the launch and of the maps it reads or writes) stays below 2^31, else int64_t.
// Exec::index64() forces int64_t (the emulator's SBNET_EMU_INDEX64=1, so that the tests cover both).
template <class Exec, class Fn>
void with_index_type(std::initializer_list<int64_t> numels, const Fn& fn) {
  int64_t most = 0;
  for (const int64_t n : numels) most = n > most ? n : most;
  if (most < (int64_t{1} << 31) && !Exec::index64()) {
    fn(int32_t{0});
  } else {
    fn(int64_t{0});
  }
}

inline Layout layout_of(c10::IntArrayRef size, bool nhwc) {
  return Layout{size[0], size[1], size[2], size[3], nhwc};
}

}  // namespace plan
}  // namespace sbnet
