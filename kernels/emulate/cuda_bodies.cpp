// CPU emulation of the sbnet CUDA kernels, built only for the tests (tests/ops/cuda_emulation.py).
//
// Registers the ops of kernels/schemas.h under the namespace sbnet_emu (torch.ops.sbnet_emu.*, CPU
// tensors). Each op is the CUDA file's own host code (cuda/<op>.h: checks, allocation, dtype dispatch,
// the sequence of launches, e.g. the adjoint's phase order) instantiated with EmuExec instead of
// CudaExec: a launch runs the kernel's grid-stride loop serially on the host, calling the same functor,
// hence the same elements.h body. What it does not cover: the launch configuration, streams, the
// device guard, and concurrency itself (the kernels' one-writer-per-element argument is checked by
// running each launch's elements in reverse order too: SBNET_EMU_REVERSE=1).
#include <torch/library.h>

#include "schemas.h"

#include <cstdlib>
#include <cstring>

#include "cuda/reduce_mask.h"
#include "cuda/sparse_gather.h"
#include "cuda/sparse_scatter.h"

namespace sbnet {
namespace emulate {

struct NoGuard {
  explicit NoGuard(const c10::Device&) {}
};

struct EmuExec {
  using Guard = NoGuard;

  // One kernel launch: every element once. Within a launch the CUDA threads run in no set order, so the
  // result must not depend on it; SBNET_EMU_REVERSE=1 runs the elements last to first.
  template <class F>
  static void launch(int64_t total, const F& f) {
    const char* reverse = std::getenv("SBNET_EMU_REVERSE");
    if (reverse != nullptr && std::strcmp(reverse, "1") == 0) {
      for (int64_t i = total - 1; i >= 0; --i) f(i);
    } else {
      for (int64_t i = 0; i < total; ++i) f(i);
    }
  }

  // SBNET_EMU_INDEX64=1: the bodies' 64-bit index arithmetic even where 32 bits suffice (host.h).
  static bool index64() {
    const char* v = std::getenv("SBNET_EMU_INDEX64");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }
};

}  // namespace emulate
}  // namespace sbnet

// The schemas of the sbnet library (kernels/schemas.h), as sbnet_emu.
TORCH_LIBRARY(sbnet_emu, m) { sbnet::define_schemas(m); }

TORCH_LIBRARY_IMPL(sbnet_emu, CPU, m) {
  using sbnet::emulate::EmuExec;
  namespace plan = sbnet::plan;
  m.impl("reduce_mask", &plan::reduce_mask<EmuExec>);
  m.impl("block_activity", &plan::block_activity<EmuExec>);
  m.impl("sparse_gather", &plan::sparse_gather<EmuExec>);
  m.impl("sparse_gather_backward", &plan::sparse_gather_backward<EmuExec>);
  m.impl("sparse_gather_backward_", &plan::sparse_gather_backward_<EmuExec>);
  m.impl("sparse_scatter", &plan::sparse_scatter<EmuExec>);
  m.impl("sparse_scatter_", &plan::sparse_scatter_<EmuExec>);
  m.impl("sparse_scatter_backward", &plan::sparse_scatter_backward<EmuExec>);
}
