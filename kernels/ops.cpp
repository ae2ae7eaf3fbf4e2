// The sbnet library: its schemas (kernels/schemas.h). Implementations register per device in cpu/*.cpp and
// cuda/*.cu (TORCH_LIBRARY_IMPL); fake kernels and autograd formulas are registered from Python
// (detector/ops/_library.py).
#include <torch/library.h>

#include "schemas.h"

TORCH_LIBRARY(sbnet, m) { sbnet::define_schemas(m); }
