// What both attention kernels share: where each head's rows live (HeadLayout), what is
// computed besides q, k and v (CoreOptions), and causal masking of a block of scores.
#pragma once

#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

#include "mha/mask.hpp"
#include "mha/tensor.hpp"

// OpenMP when the compiler has it enabled (-fopenmp, CMake option MHA_USE_OPENMP); without it
// the kernels run serially and the pragmas vanish (no -Wunknown-pragmas).
#ifdef _OPENMP
#include <omp.h>
#define MHA_OMP_PRAGMA(x) _Pragma(#x)
#else
#define MHA_OMP_PRAGMA(x)
#endif

namespace mha {

namespace detail {

// A (B, H) family of [rows, cols] matrices inside one buffer, each row-major with its rows
// row_stride elements apart. It describes both a contiguous (B, H, L, D) tensor
// (batch_stride H*L*D, head_stride L*D, row_stride D) and the heads of a (B, L, E) tensor
// without copying them (batch_stride L*E, head_stride D, row_stride E). T may be const.
template <class T>
struct HeadLayout {
  using Map = std::conditional_t<std::is_const_v<T>, ConstStridedMap<T>, StridedMap<T>>;
  T* data = nullptr;
  Index batch_stride = 0;
  Index head_stride = 0;
  Index row_stride = 0;
  Index rows = 0;
  Index cols = 0;

  Map at(Index b, Index h) const {
    return Map(offset_pointer(data, b * batch_stride + h * head_stride), rows, cols,
               Eigen::OuterStride<>(row_stride));
  }
};

template <class T>
HeadLayout<T> contiguous_heads(T* data, Index heads, Index rows, Index cols) {
  return {data, heads * rows * cols, rows * cols, cols, rows, cols};
}

// Query i may see keys j < causal_visible_end(i) among the first causal_cols keys (see Causal in
// mask.hpp); keys from causal_cols on (bias_k, zero attention) are always visible.
inline Index causal_visible_end(Causal causal, Index causal_cols, Index query_len, Index i) {
  if (causal == Causal::none) return causal_cols;
  const Index shift = causal == Causal::bottom_right ? causal_cols - query_len : 0;
  return std::clamp<Index>(i + shift + 1, 0, causal_cols);
}

// tile holds the scores of queries row0.. and keys col0..; blocks what causal masking hides.
template <class Tile>
void apply_causal(Causal causal, Index causal_cols, Index query_len, Index row0, Index col0,
                  Tile& tile) {
  if (causal == Causal::none) return;
  using T = typename Tile::Scalar;
  const Index col_end = std::min(causal_cols, col0 + tile.cols());
  for (Index i = 0; i < tile.rows(); ++i) {
    const Index first_blocked = causal_visible_end(causal, causal_cols, query_len, row0 + i);
    for (Index j = std::max(first_blocked, col0); j < col_end; ++j) {
      tile(i, j - col0) = -std::numeric_limits<T>::infinity();
    }
  }
}

// What a kernel computes besides q, k, v: the masks (each may be kind none), causal masking
// over the first causal_cols keys, and the scale.
template <class T>
struct CoreOptions {
  MaskLayout<T> attn_mask;
  MaskLayout<T> key_padding_mask;
  Causal causal = Causal::none;
  Index causal_cols = 0;
  T scale = T(1);
};

// The threads a parallel region of the kernels may use, and this thread's index in it.
inline int max_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}
inline int thread_index() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

// One thread's buffers for a kernel: the score tile (or, for the reference kernel, the whole
// [L, S'] scores), and for the flash kernel the accumulator and the running max and sum. Kept in
// a Workspace across calls, so that repeated calls of the same shapes allocate nothing.
template <class T>
struct KernelScratch {
  Matrix<T> scores;
  Matrix<T> acc;
  Vector<T> row_max, row_sum;
  RowVector<T> exps;
};

// One KernelScratch per thread that the next parallel region can have.
template <class T>
std::vector<KernelScratch<T>>& scratch_for_threads(std::vector<KernelScratch<T>>& scratch) {
  const auto threads = static_cast<std::size_t>(max_threads());
  if (scratch.size() < threads) scratch.resize(threads);
  return scratch;
}

}  // namespace detail
}  // namespace mha
