// sparse_gather and its adjoint on the CPU, for NCHW and channels-last (NHWC) maps.
//
// A map is a set of "planes" of H x W pixels with E contiguous values per pixel: NCHW has N * C planes
// (one per sample and channel, E = 1), NHWC has N planes (E = C: a pixel's channels are contiguous). A
// block row is then one contiguous run of bw * E values in the blocks and (x1 - x0) * E in the map, so
// both layouts are served by the same loops copying runs, not elements.
//
// Gather: OpenMP over block rows; each row is one memcpy of its in-map segment plus zero fills of the
// parts outside the map (the input is never padded).
// Adjoint (gather's gradient): zeros like x (or, in place, the gradient given) plus each block added at
// its window. Windows overlap by the halo; the work is split into (plane, row band) tasks in one parallel
// region (cpu/bands.h): a task zero-fills its rows, then adds the parts of the blocks that reach into
// them, sequentially in the fixed phase order (by mod P, bx mod Q). No races, and every pixel's sum has
// the same order whatever the thread count (deterministic) -- the same order as the CUDA kernel.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstring>

#include "common.h"
#include "cpu/bands.h"

namespace sbnet {
namespace {

// Planes of a [N, C, H, W] map (or [K, C, h, w] blocks) and values per pixel, by layout.
struct Planes {
  int64_t per_item;  // planes per sample (or block): C for NCHW, 1 for NHWC
  int64_t E;         // contiguous values per pixel: 1 for NCHW, C for NHWC
};

inline Planes planes_of(int64_t C, bool nhwc) { return nhwc ? Planes{1, C} : Planes{C, 1}; }

at::Tensor sparse_gather_cpu(const at::Tensor& x, const at::Tensor& indices, c10::IntArrayRef bsize,
                             c10::IntArrayRef bstride, c10::IntArrayRef boffset) {
  const char* op = "sbnet::sparse_gather";
  const Grid g = make_grid(op, bsize, bstride, boffset);
  TORCH_CHECK(x.dim() == 4, op, ": x must be [N, C, H, W], got ", dims(x.sizes()));
  check_float(op, "x", x);
  check_indices(op, indices, x);
  const bool nhwc = is_nhwc(op, "x", x);
  const at::Tensor idx = indices.contiguous();
  const int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3), K = idx.size(0);
  at::Tensor out = at::empty({K, C, g.size_h, g.size_w}, x.options().memory_format(format_of(nhwc)));
  if (K == 0 || C == 0) return out;
  const int32_t* ip = idx.const_data_ptr<int32_t>();
  check_batch_range_cpu(op, ip, K, N);
  const int64_t bh = g.size_h, bw = g.size_w;
  const Planes pl = planes_of(C, nhwc);
  const int64_t E = pl.E, run = bw * E;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "sbnet_gather_cpu", [&] {
    const scalar_t* src = x.const_data_ptr<scalar_t>();
    scalar_t* dst = out.mutable_data_ptr<scalar_t>();
    const int64_t rows = K * pl.per_item * bh;  // one task per block row of one plane
    at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / run), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t i = t % bh, kp = t / bh, k = kp / pl.per_item, p = kp % pl.per_item;
        const int64_t n = ip[3 * k], y = g.offset_h + ip[3 * k + 1] * g.stride_h + i,
                      left = g.offset_w + ip[3 * k + 2] * g.stride_w;
        scalar_t* row = dst + t * run;  // block plane kp, row i
        int64_t x0, x1;
        clip(left, bw, W, x0, x1);
        if (y < 0 || y >= H || x0 >= x1) {
          std::memset(row, 0, sizeof(scalar_t) * run);  // all-zero bits are 0.0 in every float type
          continue;
        }
        const int64_t lead = (x0 - left) * E, mid = (x1 - x0) * E;
        if (lead > 0) std::memset(row, 0, sizeof(scalar_t) * lead);
        std::memcpy(row + lead, src + ((n * pl.per_item + p) * H + y) * W * E + x0 * E, sizeof(scalar_t) * mid);
        if (lead + mid < run) std::memset(row + lead + mid, 0, sizeof(scalar_t) * (run - lead - mid));
      }
    });
  });
  return out;
}

// dst (a [N, C, H, W] map in the blocks' layout) = (zero_fill ? 0 : dst) + each block added at its window.
void gather_backward_impl(const char* op, const at::Tensor& grad_blocks, const at::Tensor& indices, at::Tensor& dst,
                          const Grid& g, bool nhwc, bool zero_fill) {
  const int64_t N = dst.size(0), C = dst.size(1), H = dst.size(2), W = dst.size(3), K = indices.size(0);
  const at::Tensor idx = indices.contiguous();
  const int32_t* ip = idx.const_data_ptr<int32_t>();
  check_batch_range_cpu(op, ip, K, N);
  const int64_t bh = g.size_h, bw = g.size_w;
  const Planes pl = planes_of(C, nhwc);
  const int64_t E = pl.E;
  // Block rows by in [j - P + 1, j] reach into band j; within a band, contributions are added in
  // phase order (by mod P, bx mod Q) -- the CUDA kernel's order, so both give the same bits.
  const int64_t P = num_phases(bh, g.stride_h), Q = num_phases(bw, g.stride_w);
  const RowBands bands(g, H, N, ip, K, P - 1);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad_blocks.scalar_type(), "sbnet_gather_bw_cpu", [&] {
    const scalar_t* src = grad_blocks.const_data_ptr<scalar_t>();
    scalar_t* out = dst.mutable_data_ptr<scalar_t>();
    const int64_t J = bands.count, NP = N * pl.per_item;
    at::parallel_for(0, NP * J, std::max<int64_t>(1, 16384 / (g.stride_h * W * E)), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t q = t / J, jj = t % J, j = bands.first + jj, n = q / pl.per_item, p = q % pl.per_item;
        int64_t r0, r1;
        bands.rows(g, H, jj, r0, r1);
        scalar_t* plane = out + q * H * W * E;
        if (zero_fill) std::memset(plane + r0 * W * E, 0, sizeof(scalar_t) * (r1 - r0) * W * E);
        for (int64_t py = 0; py < P; ++py) {
          const int64_t by = j - P + 1 + phase_of<int64_t>(py - (j - P + 1), P);  // the by in [j-P+1, j] of phase py
          int64_t lo, hi;
          bands.range(n, by, lo, hi);
          for (int64_t px = 0; px < Q; ++px) {
            for (int64_t i = lo; i < hi; ++i) {
              const int64_t k = bands.blocks[i];
              if (phase_of<int64_t>(ip[3 * k + 2], Q) != px) continue;
              const int64_t top = g.offset_h + by * g.stride_h, left = g.offset_w + ip[3 * k + 2] * g.stride_w;
              int64_t y0, y1, x0, x1;
              clip(top, bh, H, y0, y1);
              y0 = std::max(y0, r0);
              y1 = std::min(y1, r1);
              clip(left, bw, W, x0, x1);
              const scalar_t* block = src + (k * pl.per_item + p) * bh * bw * E;
              const int64_t len = (x1 - x0) * E;
              for (int64_t y = y0; y < y1; ++y) {
                const scalar_t* s = block + ((y - top) * bw + (x0 - left)) * E;
                scalar_t* d = plane + (y * W + x0) * E;
                for (int64_t e = 0; e < len; ++e) d[e] = d[e] + s[e];
              }
            }
          }
        }
      }
    });
  });
}

at::Tensor sparse_gather_backward_cpu(const at::Tensor& grad_blocks, const at::Tensor& indices,
                                      c10::IntArrayRef input_size, c10::IntArrayRef bstride,
                                      c10::IntArrayRef boffset, bool channels_last) {
  const char* op = "sbnet::sparse_gather_backward";
  TORCH_CHECK(grad_blocks.dim() == 4, op, ": grad_blocks must be [K, C, bh, bw], got ", dims(grad_blocks.sizes()));
  TORCH_CHECK(input_size.size() == 4, op, ": input_size must be [N, C, H, W], got ", dims(input_size));
  const Grid g = make_grid(op, grad_blocks.sizes().slice(2), bstride, boffset);
  check_float(op, "grad_blocks", grad_blocks);
  check_indices(op, indices, grad_blocks);
  const int64_t K = indices.size(0), C = input_size[1];
  TORCH_CHECK(grad_blocks.size(0) == K && grad_blocks.size(1) == C, op, ": grad_blocks ", dims(grad_blocks.sizes()),
              " does not match ", num(K), " indices and ", num(C), " channels");
  const at::TensorOptions opts = grad_blocks.options().memory_format(format_of(channels_last));
  at::Tensor out = at::empty(input_size, opts);
  if (K == 0 || C == 0) return out.zero_();
  // a block tensor in the other layout is converted (block-sized); the map is zero-filled band by band
  const at::Tensor gb = grad_blocks.contiguous(format_of(channels_last));
  gather_backward_impl(op, gb, indices, out, g, channels_last, /*zero_fill=*/true);
  return out;
}

void sparse_gather_backward_inplace_cpu(const at::Tensor& grad_blocks, const at::Tensor& indices, at::Tensor& grad_x,
                                        c10::IntArrayRef bstride, c10::IntArrayRef boffset) {
  const char* op = "sbnet::sparse_gather_backward_";
  TORCH_CHECK(grad_blocks.dim() == 4 && grad_x.dim() == 4, op, ": grad_blocks [K, C, bh, bw] and grad_x [N, C, H, W] ",
              "must be 4-D, got ", dims(grad_blocks.sizes()), " and ", dims(grad_x.sizes()));
  const Grid g = make_grid(op, grad_blocks.sizes().slice(2), bstride, boffset);
  check_float(op, "grad_blocks", grad_blocks);
  TORCH_CHECK(grad_blocks.scalar_type() == grad_x.scalar_type(), op, ": grad_blocks (", grad_blocks.scalar_type(),
              ") and grad_x (", grad_x.scalar_type(), ") must have the same dtype");
  check_indices(op, indices, grad_x);
  const int64_t K = indices.size(0), C = grad_x.size(1);
  TORCH_CHECK(grad_blocks.size(0) == K && grad_blocks.size(1) == C, op, ": grad_blocks ", dims(grad_blocks.sizes()),
              " does not match ", num(K), " indices and grad_x's ", num(C), " channels");
  const bool nhwc = is_nhwc(op, "grad_x", grad_x);
  check_layout(op, "grad_blocks", grad_blocks, nhwc);
  if (K == 0 || C == 0) return;
  gather_backward_impl(op, grad_blocks, indices, grad_x, g, nhwc, /*zero_fill=*/false);
}

}  // namespace
}  // namespace sbnet

TORCH_LIBRARY_IMPL(sbnet, CPU, m) {
  m.impl("sparse_gather", &sbnet::sparse_gather_cpu);
  m.impl("sparse_gather_backward", &sbnet::sparse_gather_backward_cpu);
  m.impl("sparse_gather_backward_", &sbnet::sparse_gather_backward_inplace_cpu);
}
