// sparse_gather, sparse_gather_backward and sparse_gather_backward_ on CUDA. The host side (checks,
// allocation, the adjoint's phase launches) is cuda/sparse_gather.h, shared with the CPU emulation that
// `make test` runs; the kernels are loop_kernel (cuda/launch.cuh) over elements.h's gather_element and
// gather_backward_element.
#include <torch/library.h>

#include "cuda/launch.cuh"
#include "cuda/sparse_gather.h"

TORCH_LIBRARY_IMPL(sbnet, CUDA, m) {
  m.impl("sparse_gather", &sbnet::plan::sparse_gather<sbnet::CudaExec>);
  m.impl("sparse_gather_backward", &sbnet::plan::sparse_gather_backward<sbnet::CudaExec>);
  m.impl("sparse_gather_backward_", &sbnet::plan::sparse_gather_backward_<sbnet::CudaExec>);
}
