// reduce_mask and block_activity on CUDA. The host side (checks, the flag per block, at::nonzero) is cuda/reduce_mask.h,
// shared with the CPU emulation that `make test` runs; the kernel is loop_kernel (cuda/launch.cuh) over
// elements.h's reduce_mask_element.
#include <torch/library.h>

#include "cuda/launch.cuh"
#include "cuda/reduce_mask.h"

TORCH_LIBRARY_IMPL(sbnet, CUDA, m) {
  m.impl("reduce_mask", &sbnet::plan::reduce_mask<sbnet::CudaExec>);
  m.impl("block_activity", &sbnet::plan::block_activity<sbnet::CudaExec>);
}
