// Per-element bodies of the sbnet CUDA kernels, as __host__ __device__ functions.
//
// Every CUDA kernel in cuda/*.cu is a grid-stride loop over its elements that calls ONE body from this
// header; the CPU emulation library (emulate/cuda_bodies.cpp, built only for the tests) runs the same
// bodies in a serial loop, launch by launch in the same order (the adjoint's phases), so `make test`
// checks the CUDA kernels' index math, border handling and phase order against the reference on a
// machine without a GPU. The CPU kernels (cpu/*.cpp) are a separate, row-copying implementation.
//
// Memory layouts. A map [N, C, H, W] is NCHW-contiguous or channels-last (NHWC) contiguous; a block
// tensor [K, C, h, w] is in the same layout as its map (the public functions convert blocks).
#pragma once

#include <cstdint>

#include "common.h"

namespace sbnet {

// A [N, C, H, W] tensor stored NCHW-contiguous (nhwc = false) or channels-last contiguous (nhwc = true).
struct Layout {
  int64_t N, C, H, W;
  bool nhwc;
};

// Index arithmetic runs in the integer type I: int32_t when every offset of the launch fits (the host
// decides, cuda/host.h's with_index_type), int64_t otherwise. A GPU divides 64-bit integers in software,
// several times slower than 32-bit ones, and block_elem divides three times per element.
template <typename I>
SBNET_HD I map_offset(const Layout& m, I n, I c, I y, I x) {
  const I C = static_cast<I>(m.C), H = static_cast<I>(m.H), W = static_cast<I>(m.W);
  return m.nhwc ? ((n * H + y) * W + x) * C + c : ((n * C + c) * H + y) * W + x;
}

// Element i of a block tensor [K, C, h, w] in its memory order (channels-last when nhwc).
template <typename I>
struct BlockElem {
  I k, c, r, j;  // block, channel, row, column
};

template <typename I>
SBNET_HD BlockElem<I> block_elem(I i, I C, I h, I w, bool nhwc) {
  BlockElem<I> e;
  if (nhwc) {
    e.c = i % C;
    e.j = (i / C) % w;
    e.r = (i / (C * w)) % h;
    e.k = i / (C * w * h);
  } else {
    e.j = i % w;
    e.r = (i / w) % h;
    e.c = (i / (w * h)) % C;
    e.k = i / (w * h * C);
  }
  return e;
}

// Offset in the map of block element e on grid g (block (by, bx) starts at offset + (by, bx) * stride),
// or -1 when that pixel lies outside the map (or n outside [0, N)).
template <typename I>
SBNET_HD I block_pixel(const int32_t* idx, const BlockElem<I>& e, const Grid& g, const Layout& m) {
  const I n = idx[3 * e.k];
  const I y = static_cast<I>(g.offset_h) + idx[3 * e.k + 1] * static_cast<I>(g.stride_h) + e.r;
  const I x = static_cast<I>(g.offset_w) + idx[3 * e.k + 2] * static_cast<I>(g.stride_w) + e.j;
  if (n < 0 || n >= m.N || y < 0 || y >= m.H || x < 0 || x >= m.W) return -1;
  return map_offset<I>(m, n, e.c, y, x);
}

// Block element i of a launch over block tensors [K, C, h, w] of grid g, in index type I.
template <typename I>
SBNET_HD BlockElem<I> block_elem_of(int64_t i, const Grid& g, const Layout& m) {
  return block_elem<I>(static_cast<I>(i), static_cast<I>(m.C), static_cast<I>(g.size_h), static_cast<I>(g.size_w),
                       m.nhwc);
}

// relu as torch computes it: NaN stays NaN.
template <typename T>
SBNET_HD T relu_of(T v) {
  return v < T(0) ? T(0) : v;
}

// --- sparse_gather: out[i] = x at block element i (0 outside the map). g: gather grid (size = block).
template <typename I, typename T>
SBNET_HD void gather_element(int64_t i, const T* x, const int32_t* idx, T* out, const Grid& g, const Layout& m) {
  const I s = block_pixel<I>(idx, block_elem_of<I>(i, g, m), g, m);
  out[i] = s < 0 ? T(0) : x[s];
}

// --- sparse_gather_backward (adjoint of gather), one launch per phase (py, px) in row-major phase
// order: blocks of one phase never overlap (P * stride >= size), so each map element has at most one
// writer per launch; plain read-add-write, no atomics. `dst` starts as zeros (or, for the accumulating
// variant, the gradient to add to).
template <typename I, typename T>
SBNET_HD void gather_backward_element(int64_t i, const T* grad_blocks, const int32_t* idx, T* dst, const Grid& g,
                                      const Layout& m, int64_t P, int64_t Q, int64_t py, int64_t px) {
  const BlockElem<I> e = block_elem_of<I>(i, g, m);
  if (phase_of<I>(idx[3 * e.k + 1], static_cast<I>(P)) != py) return;
  if (phase_of<I>(idx[3 * e.k + 2], static_cast<I>(Q)) != px) return;
  const I d = block_pixel<I>(idx, e, g, m);
  if (d >= 0) dst[d] = dst[d] + grad_blocks[i];
}

// --- sparse_scatter: tile element i combined into the map (tiles never overlap: one writer per element).
// g: tile grid (size = tile, stride >= tile). out[t] = relu?(out[t] (+ if add) tile[i]); `out` starts as
// base (a copy of it, or base itself for the in-place variant).
template <typename I, typename T>
SBNET_HD void scatter_element(int64_t i, const T* tiles, const int32_t* idx, T* out, const Grid& g, const Layout& m,
                              bool add, bool relu) {
  const I t = block_pixel<I>(idx, block_elem_of<I>(i, g, m), g, m);
  if (t < 0) return;
  T v = add ? T(out[t] + tiles[i]) : tiles[i];
  out[t] = relu ? relu_of(v) : v;
}

// --- sparse_scatter_backward, for tile element i, given grad_out and (relu only) the scatter's output at
// the tiles, out_tiles [K, C, th, tw] (the tile is "on" where out_tiles > 0):
//   grad_blocks[i] = grad_out[t] * on          (0 where the tile pixel lies outside the map)
//   grad_base[t]   = add ? grad_out[t] * on : 0   (grad_base starts as a copy of grad_out; may be null)
// where on = relu ? out_tiles[i] > 0 : 1.
template <typename I, typename T>
SBNET_HD void scatter_backward_element(int64_t i, const T* grad_out, const T* out_tiles, const int32_t* idx,
                                       T* grad_blocks, T* grad_base, const Grid& g, const Layout& m, bool add,
                                       bool relu) {
  const I t = block_pixel<I>(idx, block_elem_of<I>(i, g, m), g, m);
  const bool on = !relu || out_tiles[i] > T(0);
  if (grad_blocks != nullptr) grad_blocks[i] = (t < 0 || !on) ? T(0) : grad_out[t];
  if (grad_base != nullptr && t >= 0 && (!add || !on)) grad_base[t] = T(0);
}

// --- reduce_mask: block i of the grid (n, by, bx in row-major order) of mask [N, 1, H, W] (contiguous):
// active if the max (or float64 mean, avgpool) of its in-map window is > tol; never for an empty window.
template <typename T>
SBNET_HD bool reduce_mask_element(int64_t i, const T* mask, int64_t H, int64_t W, int64_t bcount_h,
                                  int64_t bcount_w, const Grid& g, double tol, bool avgpool) {
  const int64_t bx = i % bcount_w, by = (i / bcount_w) % bcount_h, n = i / (bcount_w * bcount_h);
  int64_t y0, y1, x0, x1;
  clip(g.offset_h + by * g.stride_h, g.size_h, H, y0, y1);
  clip(g.offset_w + bx * g.stride_w, g.size_w, W, x0, x1);
  if (y0 >= y1 || x0 >= x1) return false;
  double value = 0.0;
  bool first = true;
  for (int64_t y = y0; y < y1; ++y) {
    const T* p = mask + (n * H + y) * W;
    for (int64_t x = x0; x < x1; ++x) {
      const double v = static_cast<double>(p[x]);
      if (avgpool) {
        value += v;
      } else if (first || v > value) {
        value = v;
      }
      first = false;
    }
  }
  if (avgpool) value /= static_cast<double>((y1 - y0) * (x1 - x0));
  return value > tol;
}

}  // namespace sbnet
