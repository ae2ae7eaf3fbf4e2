// Batch-norm statistics and gradient over the tile regions of blocks, on the CPU (detector/nn/norm.py).
//
// Blocks z [K, C, e_h, e_w] (NCHW-contiguous or channels-last) carry a halo around their tile region, rows
// offset_h ... offset_h + size_h and columns offset_w ... offset_w + size_w of each block. A region's
// pixels are numbered p = (k * size_h + i) * size_w + j; `pixels` (int64, optional) lists the ones that
// count (the in-map ones where a tile sticks out of the map), all of them when absent.
//
//   region_sums(a, b?, center?, offset, size, pixels?) -> float64 [2, C]; with u = a - center (a without center)
//       [0, c] = sum over the counted pixels of u[k, c, offset + (i, j)]
//       [1, c] = the same sum of u * b (u * u when b is absent)
//   region_norm_grad(g, z, scale, c0, c1, offset, size, pixels?) -> dz, in g's layout
//       dz = g * scale[c] at every pixel of the blocks, plus z * c1[c] + c0[c] at the counted region pixels
//
// One pass over the data each, where the composition of torch ops took five (moments) and six (gradient).
// Sums: each region row (a few pixels) in float (the dtype's opmath type), the rows in float64, over fixed chunks
// of rows whose partial sums are added in chunk order: the result does not depend on the thread count. Batch
// norm takes the variance as the centred sum of squares (a second pass with the mean as center), as precise as a
// two-pass float32 reduction. The gradient has one writer per element.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "common.h"

namespace sbnet {
namespace {

constexpr int64_t kChunkPixels = 2048;  // region pixels per partial sum (at least one region row)

struct Region {
  int64_t K, C, eh, ew, oh, ow, rh, rw;
  bool nhwc;
  std::vector<uint8_t> counts;  // per region pixel whether it counts; empty: all do

  int64_t rows() const { return K * rh; }  // region rows (k, i), row r = k * rh + i
  // offset of pixel (k, y, x) of the blocks (channel 0) and the distance between channels
  int64_t at(int64_t k, int64_t y, int64_t x) const {
    return nhwc ? ((k * eh + y) * ew + x) * C : (k * C * eh + y) * ew + x;
  }
  int64_t cstride() const { return nhwc ? 1 : eh * ew; }
  bool counted(int64_t row, int64_t j) const { return counts.empty() || counts[row * rw + j] != 0; }
};

Region region_of(const char* op, const at::Tensor& a, c10::IntArrayRef offset, c10::IntArrayRef size,
                 const c10::optional<at::Tensor>& pixels) {
  TORCH_CHECK(a.dim() == 4, op, ": blocks must be [K, C, e_h, e_w], got ", dims(a.sizes()));
  TORCH_CHECK(a.device().is_cpu(), op, ": the CPU kernel got a tensor on ", a.device());
  check_float(op, "blocks", a);
  TORCH_CHECK(offset.size() == 2 && size.size() == 2, op, ": offset and size must be pairs");
  const int64_t K = a.size(0), C = a.size(1), eh = a.size(2), ew = a.size(3);
  TORCH_CHECK(offset[0] >= 0 && offset[1] >= 0 && size[0] >= 0 && size[1] >= 0 && offset[0] + size[0] <= eh &&
                  offset[1] + size[1] <= ew,
              op, ": region at ", dims(offset), " of size ", dims(size), " does not fit blocks of ",
              num(eh), " x ", num(ew));
  Region r{K, C, eh, ew, offset[0], offset[1], size[0], size[1], is_nhwc(op, "blocks", a), {}};
  if (pixels.has_value()) {
    const at::Tensor& p = *pixels;
    TORCH_CHECK(p.dim() == 1 && p.scalar_type() == at::kLong && p.device().is_cpu(), op,
                ": pixels must be an int64 CPU vector");
    const at::Tensor pc = p.contiguous();
    const int64_t* pp = pc.const_data_ptr<int64_t>();
    const int64_t total = K * size[0] * size[1];
    r.counts.assign(static_cast<size_t>(total), 0);
    for (int64_t n = 0; n < pc.size(0); ++n) {
      TORCH_CHECK(pp[n] >= 0 && pp[n] < total, op, ": pixels[", num(n), "] = ", num(pp[n]), " outside [0, ",
                  num(total), ")");
      r.counts[pp[n]] = 1;
    }
  }
  return r;
}

at::Tensor region_sums_cpu(const at::Tensor& a, const c10::optional<at::Tensor>& b,
                           const c10::optional<at::Tensor>& center, c10::IntArrayRef offset, c10::IntArrayRef size,
                           const c10::optional<at::Tensor>& pixels) {
  const char* op = "region_sums";
  const Region r = region_of(op, a, offset, size, pixels);
  if (b.has_value()) {
    TORCH_CHECK(b->sizes() == a.sizes() && b->scalar_type() == a.scalar_type() && b->device() == a.device(), op,
                ": b must match a in shape, dtype and device");
    check_layout(op, "b", *b, r.nhwc);
  }
  const int64_t C = r.C, cs = r.cstride();
  if (center.has_value()) {
    TORCH_CHECK(center->dim() == 1 && center->size(0) == C && center->device().is_cpu(), op,
                ": center must be a [C] CPU vector");
  }
  const int64_t per = std::max<int64_t>(1, kChunkPixels / std::max<int64_t>(1, r.rw));  // region rows per chunk
  const int64_t chunks = (r.rows() + per - 1) / per;
  std::vector<double> part(static_cast<size_t>(chunks * 2 * C), 0.0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.scalar_type(), "sbnet_region_sums_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;  // a region row's partial sums (float for float and half types)
    const scalar_t* pa = a.const_data_ptr<scalar_t>();
    const scalar_t* pb = b.has_value() ? b->const_data_ptr<scalar_t>() : nullptr;
    std::vector<acc_t> m(C, acc_t(0));
    if (center.has_value()) {
      const at::Tensor cc = center->to(at::kDouble).contiguous();
      for (int64_t c = 0; c < C; ++c) m[c] = static_cast<acc_t>(cc.const_data_ptr<double>()[c]);
    }
    at::parallel_for(0, chunks, 1, [&](int64_t lo, int64_t hi) {
      std::vector<acc_t> row_sums(2 * C);
      acc_t* __restrict__ r0 = row_sums.data();
      acc_t* __restrict__ r1 = r0 + C;
      const acc_t* __restrict__ mc = m.data();
      for (int64_t q = lo; q < hi; ++q) {
        double* s0 = part.data() + q * 2 * C;
        double* s1 = s0 + C;
        for (int64_t row = q * per; row < std::min(r.rows(), (q + 1) * per); ++row) {
          const int64_t k = row / r.rh, y = r.oh + row % r.rh;
          std::fill(row_sums.begin(), row_sums.end(), acc_t(0));
          for (int64_t j = 0; j < r.rw; ++j) {
            if (!r.counted(row, j)) continue;
            const int64_t o = r.at(k, y, r.ow + j);
            const scalar_t* __restrict__ x = pa + o;
            if (r.nhwc && pb == nullptr) {  // a pixel's channels are contiguous: vectorizable loops
              for (int64_t c = 0; c < C; ++c) {
                const acc_t u = static_cast<acc_t>(x[c]) - mc[c];
                r0[c] += u;
                r1[c] += u * u;
              }
            } else if (r.nhwc) {
              const scalar_t* __restrict__ w = pb + o;
              for (int64_t c = 0; c < C; ++c) {
                const acc_t u = static_cast<acc_t>(x[c]) - mc[c];
                r0[c] += u;
                r1[c] += u * static_cast<acc_t>(w[c]);
              }
            } else {
              const scalar_t* w = pb != nullptr ? pb + o : nullptr;
              for (int64_t c = 0; c < C; ++c) {
                const acc_t u = static_cast<acc_t>(x[c * cs]) - mc[c];
                r0[c] += u;
                r1[c] += u * (w != nullptr ? static_cast<acc_t>(w[c * cs]) : u);
              }
            }
          }
          for (int64_t c = 0; c < C; ++c) {  // a few pixels in acc_t, the rest in float64
            s0[c] += static_cast<double>(r0[c]);
            s1[c] += static_cast<double>(r1[c]);
          }
        }
      }
    });
  });
  at::Tensor out = at::zeros({2, C}, a.options().dtype(at::kDouble));
  double* po = out.mutable_data_ptr<double>();
  for (int64_t q = 0; q < chunks; ++q) {  // chunk order: independent of the threads
    for (int64_t e = 0; e < 2 * C; ++e) po[e] += part[q * 2 * C + e];
  }
  return out;
}

at::Tensor region_norm_grad_cpu(const at::Tensor& g, const at::Tensor& z, const at::Tensor& scale,
                                const at::Tensor& c0, const at::Tensor& c1, c10::IntArrayRef offset,
                                c10::IntArrayRef size, const c10::optional<at::Tensor>& pixels) {
  const char* op = "region_norm_grad";
  const Region r = region_of(op, z, offset, size, pixels);
  TORCH_CHECK(g.sizes() == z.sizes() && g.scalar_type() == z.scalar_type() && g.device() == z.device(), op,
              ": g must match z in shape, dtype and device");
  check_layout(op, "g", g, r.nhwc);
  for (const at::Tensor* t : {&scale, &c0, &c1}) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == r.C && at::isFloatingType(t->scalar_type()) && t->device().is_cpu(),
                op, ": scale, c0 and c1 must be floating-point [C] CPU vectors");
  }
  at::Tensor dz = at::empty(z.sizes(), z.options().memory_format(format_of(r.nhwc)));
  const int64_t C = r.C, cs = r.cstride();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, z.scalar_type(), "sbnet_region_norm_grad_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* pg = g.const_data_ptr<scalar_t>();
    const scalar_t* pz = z.const_data_ptr<scalar_t>();
    scalar_t* pd = dz.mutable_data_ptr<scalar_t>();
    // the coefficients in the opmath type whatever their dtype (float ones for half-precision blocks)
    const at::Tensor s = scale.to(at::kDouble).contiguous(), v0 = c0.to(at::kDouble).contiguous(),
                     v1 = c1.to(at::kDouble).contiguous();
    std::vector<acc_t> sc(C), a0(C), a1(C);
    for (int64_t c = 0; c < C; ++c) {
      sc[c] = static_cast<acc_t>(s.const_data_ptr<double>()[c]);
      a0[c] = static_cast<acc_t>(v0.const_data_ptr<double>()[c]);
      a1[c] = static_cast<acc_t>(v1.const_data_ptr<double>()[c]);
    }
    // one task per block row (k, y): dz = g * scale, plus c0 + z * c1 at the row's counted region pixels
    const int64_t rows = r.K * r.eh;
    at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, r.ew * C)), [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        const int64_t k = t / r.eh, y = t % r.eh;
        const bool in_rows = y >= r.oh && y < r.oh + r.rh;
        const int64_t row = k * r.rh + (y - r.oh);
        for (int64_t x = 0; x < r.ew; ++x) {
          const bool corr = in_rows && x >= r.ow && x < r.ow + r.rw && r.counted(row, x - r.ow);
          const int64_t o = r.at(k, y, x);
          const scalar_t* __restrict__ gi = pg + o;
          const scalar_t* __restrict__ zi = pz + o;
          scalar_t* __restrict__ di = pd + o;
          const int64_t st = r.nhwc ? 1 : cs;  // 1: a vectorizable loop over a pixel's contiguous channels
          if (corr && st == 1) {
            for (int64_t c = 0; c < C; ++c)
              di[c] = static_cast<acc_t>(gi[c]) * sc[c] + static_cast<acc_t>(zi[c]) * a1[c] + a0[c];
          } else if (st == 1) {
            for (int64_t c = 0; c < C; ++c) di[c] = static_cast<acc_t>(gi[c]) * sc[c];
          } else if (corr) {
            for (int64_t c = 0; c < C; ++c)
              di[c * st] = static_cast<acc_t>(gi[c * st]) * sc[c] + static_cast<acc_t>(zi[c * st]) * a1[c] + a0[c];
          } else {
            for (int64_t c = 0; c < C; ++c) di[c * st] = static_cast<acc_t>(gi[c * st]) * sc[c];
          }
        }
      }
    });
  });
  return dz;
}

}  // namespace
}  // namespace sbnet

TORCH_LIBRARY_IMPL(sbnet, CPU, m) {
  m.impl("region_sums", &sbnet::region_sums_cpu);
  m.impl("region_norm_grad", &sbnet::region_norm_grad_cpu);
}
