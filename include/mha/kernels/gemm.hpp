// The layer's large products (projections and weight gradients), threaded so that their results
// do not depend on the number of threads.
//
// Why not Eigen's own OpenMP GEMM: it chooses its depth blocking (kc) from the number of threads,
// and so the order in which each element's sum is accumulated, and the rounding, change with the
// thread count (measured: outputs differing by 1e-7 between 1 and 2 threads at E = 512). Here the
// rows of the result are cut into chunks whose size depends only on the shape, and each chunk is
// one serial Eigen product (inside a parallel region Eigen never threads), whose blocking depends
// only on the depth: every element is summed the same way whatever the thread count.
#pragma once

#include <algorithm>

#include "mha/kernels/common.hpp"

namespace mha {
namespace detail {

enum class Accumulate { no, yes };

// dst [M, N] = (or +=) lhs [M, K] * rhs [K, N]; any Eigen expressions with row blocks (maps,
// transposes). The chunk size, a multiple of 8 rows from 32 to 256, gives about 8 chunks: enough
// for the threads, few enough that re-packing rhs per chunk stays a small cost (rhs is packed
// once per chunk, an extra K·N per 32..256·K·N multiply-adds).
template <class Dst, class Lhs, class Rhs>
void threaded_product(Dst&& dst, const Lhs& lhs, const Rhs& rhs, Accumulate accumulate) {
  const Index rows = dst.rows();
  const Index chunk = std::clamp<Index>((rows / 8 + 7) / 8 * 8, 32, 256);
  const Index chunks = (rows + chunk - 1) / chunk;
  // With more than one thread available, always inside a parallel region, even for one chunk:
  // outside one, Eigen would thread a large product itself. With one, Eigen does not thread.
  MHA_OMP_PRAGMA(omp parallel for schedule(static) if (max_threads() > 1))
  for (Index c = 0; c < chunks; ++c) {
    const Index row0 = c * chunk, count = std::min(chunk, rows - row0);
    auto dst_rows = dst.middleRows(row0, count);
    if (accumulate == Accumulate::yes) {
      dst_rows.noalias() += lhs.middleRows(row0, count) * rhs;
    } else {
      dst_rows.noalias() = lhs.middleRows(row0, count) * rhs;
    }
  }
}

}  // namespace detail
}  // namespace mha
