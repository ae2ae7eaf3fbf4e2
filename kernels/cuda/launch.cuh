// The CUDA device of the sbnet kernels (CudaExec, see cuda/host.h): every kernel is loop_kernel<F>, a
// grid-stride loop (SBNET_KERNEL_LOOP) calling the functor F, which calls exactly one body of elements.h.
// Only c10/cuda headers (no ATen/cuda/CUDAContext.h, which pulls in cuBLAS/cuSPARSE headers that a
// minimal CUDA toolkit lacks).
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace sbnet {

constexpr int kThreads = 256;

// Enough blocks to fill the device (32 per SM), fewer for small jobs.
inline unsigned int blocks_for(int64_t total) {
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, c10::cuda::current_device()));
  const int64_t wanted = (total + kThreads - 1) / kThreads;
  return static_cast<unsigned int>(std::max<int64_t>(1, std::min<int64_t>(wanted, int64_t{sms} * 32)));
}

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

#define SBNET_KERNEL_LOOP(i, total)                                                        \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (total); \
       i += static_cast<int64_t>(blockDim.x) * gridDim.x)

template <class F>
__global__ void __launch_bounds__(kThreads) loop_kernel(int64_t total, const F f) {
  SBNET_KERNEL_LOOP(i, total) { f(i); }
}

// Launches run in order on the current stream of the guarded device.
struct CudaExec {
  using Guard = c10::cuda::CUDAGuard;

  template <class F>
  static void launch(int64_t total, const F& f) {
    if (total <= 0) return;
    loop_kernel<F><<<blocks_for(total), kThreads, 0, current_stream()>>>(total, f);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  static bool index64() { return false; }
};

}  // namespace sbnet
