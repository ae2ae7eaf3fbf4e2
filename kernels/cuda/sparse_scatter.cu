// sparse_scatter, sparse_scatter_ and sparse_scatter_backward on CUDA. The host side (checks, the one
// copy of base, launches) is cuda/sparse_scatter.h, shared with the CPU emulation that `make test` runs;
// the kernels are loop_kernel (cuda/launch.cuh) over elements.h's scatter_element and
// scatter_backward_element.
#include <torch/library.h>

#include "cuda/launch.cuh"
#include "cuda/sparse_scatter.h"

TORCH_LIBRARY_IMPL(sbnet, CUDA, m) {
  m.impl("sparse_scatter", &sbnet::plan::sparse_scatter<sbnet::CudaExec>);
  m.impl("sparse_scatter_", &sbnet::plan::sparse_scatter_<sbnet::CudaExec>);
  m.impl("sparse_scatter_backward", &sbnet::plan::sparse_scatter_backward<sbnet::CudaExec>);
}
