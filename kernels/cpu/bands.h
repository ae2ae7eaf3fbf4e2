// Row bands for the CPU kernels that write into a dense map (scatter, gather's adjoint).
//
// Band j of a map is rows [offset_h + j * stride_h, offset_h + (j + 1) * stride_h) clipped to the map;
// the bands partition the rows. Work is split into (n, c, band) tasks: one parallel region, each
// task owning its rows of one channel plane (no races, and the rows stay in cache between the copy
// or zero fill and the block writes). Blocks are listed per (n, by) in index order (CSR).
#pragma once

#include <cstdint>
#include <vector>

#include "common.h"

namespace sbnet {

struct RowBands {
  int64_t first;  // index j of the first band that holds a map row
  int64_t count;  // number of such bands
  int64_t by_first, by_count;  // block rows listed in the CSR
  std::vector<int64_t> start;  // CSR offsets over (n, by - by_first), size N * by_count + 1
  std::vector<int64_t> blocks;  // block indices k, grouped by (n, by), in index order

  // Bands of a map of H rows on grid g; blocks with by in [first - extra, first + count) are listed
  // (extra = how many block rows above a band can still reach into it).
  RowBands(const Grid& g, int64_t H, int64_t N, const int32_t* idx, int64_t K, int64_t extra) {
    first = floor_div(-g.offset_h, g.stride_h);
    count = floor_div(H - 1 - g.offset_h, g.stride_h) - first + 1;
    by_first = first - extra;
    by_count = count + extra;
    start.assign(static_cast<size_t>(N * by_count + 1), 0);
    for (int64_t k = 0; k < K; ++k) {
      const int64_t r = idx[3 * k + 1] - by_first;
      if (r >= 0 && r < by_count) ++start[idx[3 * k] * by_count + r + 1];
    }
    for (size_t i = 1; i < start.size(); ++i) start[i] += start[i - 1];
    blocks.resize(static_cast<size_t>(start.back()));
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t k = 0; k < K; ++k) {
      const int64_t r = idx[3 * k + 1] - by_first;
      if (r >= 0 && r < by_count) blocks[fill[idx[3 * k] * by_count + r]++] = k;
    }
  }

  // Rows [r0, r1) of band first + jj.
  void rows(const Grid& g, int64_t H, int64_t jj, int64_t& r0, int64_t& r1) const {
    clip(g.offset_h + (first + jj) * g.stride_h, g.stride_h, H, r0, r1);
  }

  // Blocks of sample n in block row by: blocks[lo .. hi).
  void range(int64_t n, int64_t by, int64_t& lo, int64_t& hi) const {
    const int64_t r = by - by_first;
    if (r < 0 || r >= by_count) {
      lo = hi = 0;
      return;
    }
    lo = start[n * by_count + r];
    hi = start[n * by_count + r + 1];
  }
};

}  // namespace sbnet
