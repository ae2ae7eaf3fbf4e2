// Schemas of the sbnet sparse-block ops. Implementations register per device in cpu/*.cpp and
// cuda/*.cu (TORCH_LIBRARY_IMPL); fake kernels and autograd formulas are registered from Python
// (detector/ops/_library.py). Geometry arguments are (rows, columns) pairs; see kernels/README.md.
#include <torch/library.h>

TORCH_LIBRARY(sbnet, m) {
  // Active blocks of mask [N, 1, H, W] on the grid (bsize, bstride, boffset) with bcount blocks:
  // int32 [K, 3] rows (n, by, bx), ascending. Max (or mean, avgpool) over the in-map part > tol.
  m.def("reduce_mask(Tensor mask, int[2] bsize, int[2] bstride, int[2] boffset, int[2] bcount, "
        "float tol, bool avgpool) -> Tensor");
  // blocks[k] = x[n, :, boffset_h + by*bstride_h : ... + bsize_h, ...]; out-of-map pixels = 0.
  m.def("sparse_gather(Tensor x, Tensor indices, int[2] bsize, int[2] bstride, int[2] boffset) -> Tensor");
  // Adjoint of sparse_gather: zeros of input_size [N, C, H, W] plus each block added at its window
  // (overlapping windows add up; fixed summation order, so deterministic).
  m.def("sparse_gather_backward(Tensor grad_blocks, Tensor indices, int[] input_size, int[2] bstride, "
        "int[2] boffset) -> Tensor");
  // Copy of base with blocks [K, C, th, tw] written (or added) at boffset + (by, bx) * bstride,
  // clipped to the map. Requires bstride >= tile size (tiles do not overlap) and unique indices.
  m.def("sparse_scatter(Tensor blocks, Tensor indices, Tensor base, int[2] bstride, int[2] boffset, "
        "bool add) -> Tensor");
  // The same, writing into base itself.
  m.def("sparse_scatter_(Tensor blocks, Tensor indices, Tensor(a!) base, int[2] bstride, "
        "int[2] boffset, bool add) -> ()");
}
