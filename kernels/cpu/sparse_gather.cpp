// sparse_gather and its adjoint on the CPU.
//
// Gather: OpenMP over K * C (block, channel) planes; each block row is one memcpy of its in-map
// segment plus zero fills of the parts outside the map (the input is never padded).
// Adjoint (gather's gradient): zeros like x plus each block added at its window. Windows overlap by
// the halo; the work is split into (n, c, row band) tasks in one parallel region (cpu/bands.h): a
// task zero-fills its rows, then adds the parts of the blocks that reach into them, sequentially in
// the fixed phase order (by mod P, bx mod Q). No races, and every pixel's sum has the same order
// whatever the thread count (deterministic) -- the same order as the CUDA kernel.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "common.h"
#include "cpu/bands.h"

namespace sbnet {
namespace {

// Parallel chunks of at least ~16K elements.
inline int64_t grain_for(int64_t plane) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(plane, 1)); }

at::Tensor sparse_gather_cpu(const at::Tensor& x, const at::Tensor& indices, c10::IntArrayRef bsize,
                             c10::IntArrayRef bstride, c10::IntArrayRef boffset) {
  const char* op = "sbnet::sparse_gather";
  const Grid g = make_grid(op, bsize, bstride, boffset);
  TORCH_CHECK(x.dim() == 4, op, ": x must be [N, C, H, W], got ", x.sizes());
  check_float(op, "x", x);
  check_indices(op, indices, x);
  const at::Tensor xc = x.contiguous();
  const at::Tensor idx = indices.contiguous();
  const int64_t N = xc.size(0), C = xc.size(1), H = xc.size(2), W = xc.size(3), K = idx.size(0);
  at::Tensor out = at::empty({K, C, g.size_h, g.size_w}, xc.options());
  if (K == 0 || C == 0) return out;
  const int32_t* ip = idx.const_data_ptr<int32_t>();
  check_batch_range_cpu(op, ip, K, N);
  const int64_t bh = g.size_h, bw = g.size_w;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, xc.scalar_type(), "sbnet_gather_cpu", [&] {
    const scalar_t* src = xc.const_data_ptr<scalar_t>();
    scalar_t* dst = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, K * C, grain_for(bh * bw), [&](int64_t begin, int64_t end) {
      for (int64_t kc = begin; kc < end; ++kc) {
        const int64_t k = kc / C, c = kc % C;
        const int64_t n = ip[3 * k], top = g.offset_h + ip[3 * k + 1] * g.stride_h,
                      left = g.offset_w + ip[3 * k + 2] * g.stride_w;
        int64_t x0, x1;
        clip(left, bw, W, x0, x1);
        const scalar_t* plane = src + (n * C + c) * H * W;
        scalar_t* block = dst + kc * bh * bw;
        for (int64_t i = 0; i < bh; ++i) {
          scalar_t* row = block + i * bw;
          const int64_t y = top + i;
          if (y < 0 || y >= H || x0 >= x1) {
            std::memset(row, 0, sizeof(scalar_t) * bw);  // all-zero bits are 0.0 in every float type
            continue;
          }
          const int64_t lead = x0 - left, mid = x1 - x0;
          if (lead > 0) std::memset(row, 0, sizeof(scalar_t) * lead);
          std::memcpy(row + lead, plane + y * W + x0, sizeof(scalar_t) * mid);
          if (lead + mid < bw) std::memset(row + lead + mid, 0, sizeof(scalar_t) * (bw - lead - mid));
        }
      }
    });
  });
  return out;
}

at::Tensor sparse_gather_backward_cpu(const at::Tensor& grad_blocks, const at::Tensor& indices,
                                      c10::IntArrayRef input_size, c10::IntArrayRef bstride,
                                      c10::IntArrayRef boffset) {
  const char* op = "sbnet::sparse_gather_backward";
  TORCH_CHECK(grad_blocks.dim() == 4, op, ": grad_blocks must be [K, C, bh, bw], got ", grad_blocks.sizes());
  TORCH_CHECK(input_size.size() == 4, op, ": input_size must be [N, C, H, W], got ", input_size);
  const Grid g = make_grid(op, grad_blocks.sizes().slice(2), bstride, boffset);
  check_float(op, "grad_blocks", grad_blocks);
  check_indices(op, indices, grad_blocks);
  const int64_t N = input_size[0], C = input_size[1], H = input_size[2], W = input_size[3];
  const int64_t K = indices.size(0);
  TORCH_CHECK(grad_blocks.size(0) == K && grad_blocks.size(1) == C, op, ": grad_blocks ", grad_blocks.sizes(),
              " does not match ", K, " indices and ", C, " channels");
  const at::TensorOptions opts = grad_blocks.options().memory_format(at::MemoryFormat::Contiguous);
  if (K == 0 || C == 0) return at::zeros(input_size, opts);
  at::Tensor out = at::empty(input_size, opts);  // every band is zero-filled by its task below
  const at::Tensor gb = grad_blocks.contiguous();
  const at::Tensor idx = indices.contiguous();
  const int32_t* ip = idx.const_data_ptr<int32_t>();
  check_batch_range_cpu(op, ip, K, N);
  const int64_t bh = g.size_h, bw = g.size_w;
  // Block rows by in [j - P + 1, j] reach into band j; within a band, contributions are added in
  // phase order (by mod P, bx mod Q) -- the CUDA kernel's order, so both give the same bits.
  const int64_t P = num_phases(bh, g.stride_h), Q = num_phases(bw, g.stride_w);
  const RowBands bands(g, H, N, ip, K, P - 1);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, gb.scalar_type(), "sbnet_gather_bw_cpu", [&] {
    const scalar_t* src = gb.const_data_ptr<scalar_t>();
    scalar_t* dst = out.mutable_data_ptr<scalar_t>();
    const int64_t J = bands.count;
    at::parallel_for(0, N * C * J, std::max<int64_t>(1, 16384 / (g.stride_h * W)), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t n = t / (C * J), c = (t / J) % C, jj = t % J, j = bands.first + jj;
        int64_t r0, r1;
        bands.rows(g, H, jj, r0, r1);
        scalar_t* plane = dst + (n * C + c) * H * W;
        std::memset(plane + r0 * W, 0, sizeof(scalar_t) * (r1 - r0) * W);
        for (int64_t py = 0; py < P; ++py) {
          const int64_t by = j - P + 1 + phase_of(py - (j - P + 1), P);  // the by in [j-P+1, j] of phase py
          int64_t lo, hi;
          bands.range(n, by, lo, hi);
          for (int64_t px = 0; px < Q; ++px) {
            for (int64_t i = lo; i < hi; ++i) {
              const int64_t k = bands.blocks[i];
              if (phase_of(ip[3 * k + 2], Q) != px) continue;
              const int64_t top = g.offset_h + by * g.stride_h, left = g.offset_w + ip[3 * k + 2] * g.stride_w;
              int64_t y0, y1, x0, x1;
              clip(top, bh, H, y0, y1);
              y0 = std::max(y0, r0);
              y1 = std::min(y1, r1);
              clip(left, bw, W, x0, x1);
              const scalar_t* block = src + (k * C + c) * bh * bw;
              for (int64_t y = y0; y < y1; ++y) {
                const scalar_t* s = block + (y - top) * bw + (x0 - left);
                scalar_t* d = plane + y * W;
                for (int64_t xx = x0; xx < x1; ++xx) d[xx] = d[xx] + s[xx - x0];
              }
            }
          }
        }
      }
    });
  });
  return out;
}

}  // namespace
}  // namespace sbnet

TORCH_LIBRARY_IMPL(sbnet, CPU, m) {
  m.impl("sparse_gather", &sbnet::sparse_gather_cpu);
  m.impl("sparse_gather_backward", &sbnet::sparse_gather_backward_cpu);
}
