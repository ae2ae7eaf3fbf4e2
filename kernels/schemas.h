// The schemas of the sbnet ops, defined once: kernels/ops.cpp registers them as the sbnet library, the CUDA
// emulation (emulate/cuda_bodies.cpp) as sbnet_emu. Layouts: every map [N, C, H, W] may be NCHW-contiguous or
// channels-last (NHWC) contiguous; block tensors [K, C, h, w] take their map's layout (gather returns them so;
// scatter and the adjoints require it). Other stride patterns are rejected naming the op and the argument.
// Geometry arguments are (rows, columns) pairs; see kernels/README.md.
#pragma once

#include <torch/library.h>

namespace sbnet {

inline void define_schemas(torch::Library& m) {
  // Active blocks of mask [N, 1, H, W] on the grid (bsize, bstride, boffset) with bcount blocks:
  // int32 [K, 3] rows (n, by, bx), ascending. Max (or mean, avgpool) over the in-map part > tol.
  m.def("reduce_mask(Tensor mask, int[2] bsize, int[2] bstride, int[2] boffset, int[2] bcount, "
        "float tol, bool avgpool) -> Tensor");
  // The same rule as a flag per block: bool [N, bcount_h, bcount_w] (reduce_mask lists its true entries).
  // Counting active blocks this way needs no host sync (a sum on the device; the plan's measurements).
  m.def("block_activity(Tensor mask, int[2] bsize, int[2] bstride, int[2] boffset, int[2] bcount, "
        "float tol, bool avgpool) -> Tensor");
  // blocks[k] = x[n, :, boffset_h + by*bstride_h : ... + bsize_h, ...]; out-of-map pixels = 0.
  // The blocks have x's layout.
  m.def("sparse_gather(Tensor x, Tensor indices, int[2] bsize, int[2] bstride, int[2] boffset) -> Tensor");
  // Adjoint of sparse_gather: zeros of input_size [N, C, H, W] (channels-last when channels_last) plus each
  // block added at its window (overlapping windows add up in a fixed phase order: deterministic).
  m.def("sparse_gather_backward(Tensor grad_blocks, Tensor indices, int[] input_size, int[2] bstride, "
        "int[2] boffset, bool channels_last=False) -> Tensor");
  // The same, adding the blocks into grad_x itself (grad_x in the blocks' layout).
  m.def("sparse_gather_backward_(Tensor grad_blocks, Tensor indices, Tensor(a!) grad_x, int[2] bstride, "
        "int[2] boffset) -> ()");
  // Copy of base with each tile blocks[k] [K, C, th, tw] combined at boffset + (by, bx) * bstride, clipped
  // to the map: out = relu?(base (+ if add) tile) on the tile, base elsewhere. Requires bstride >= tile
  // size (tiles do not overlap) and unique indices. Output in base's layout.
  m.def("sparse_scatter(Tensor blocks, Tensor indices, Tensor base, int[2] bstride, int[2] boffset, "
        "bool add, bool relu=False) -> Tensor");
  // The same, writing into base itself.
  m.def("sparse_scatter_(Tensor blocks, Tensor indices, Tensor(a!) base, int[2] bstride, "
        "int[2] boffset, bool add, bool relu=False) -> ()");
  // Adjoint of sparse_scatter given grad_out (base's layout) and, for relu, out_tiles: the scatter's
  // output at the tiles [K, C, th, tw] (on = out_tiles > 0; ignored without relu):
  //   grad_blocks = grad_out at the tiles * on   (0 outside the map)
  //   grad_base   = grad_out with each in-map tile pixel replaced by (add ? grad_out * on : 0)
  // Either is skipped (an undefined tensor returned) when its need_* flag is false.
  m.def("sparse_scatter_backward(Tensor grad_out, Tensor indices, Tensor? out_tiles, int[2] tile, "
        "int[2] bstride, int[2] boffset, bool add, bool relu, bool need_blocks, bool need_base) "
        "-> (Tensor, Tensor)");
  // Batch-norm over tile regions (CPU only; detector/nn/norm.py composes torch ops elsewhere). Blocks
  // [K, C, e_h, e_w]; region: rows offset .. offset + size of each block; pixels: int64 indices into the
  // [K * size_h * size_w] region pixels that count (all when absent). Float64 [2, C]: with u = a - center
  // (a without center), the sums over the counted pixels of u and of u * b (u * u without b).
  m.def("region_sums(Tensor a, Tensor? b, Tensor? center, int[2] offset, int[2] size, Tensor? pixels) -> Tensor");
  // dz = g * scale everywhere, plus z * c1 + c0 at the counted region pixels (per channel; the [C] coefficients
  // of any floating dtype, applied in z's opmath type); dz in g's layout and z's dtype.
  m.def("region_norm_grad(Tensor g, Tensor z, Tensor scale, Tensor c0, Tensor c1, int[2] offset, int[2] size, "
        "Tensor? pixels) -> Tensor");
}

}  // namespace sbnet
