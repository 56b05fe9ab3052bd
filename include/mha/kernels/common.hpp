// What both attention kernels share: where each head's rows live (HeadLayout), what is
// computed besides q, k and v (CoreOptions), causal masking of a block of scores, and attention
// dropout.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
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
// row_stride elements apart (or, for keys and values under grouped-query attention, a
// (B, H_kv) family read by H = H_kv * group query heads). It describes both a contiguous (B, H, L,
// D) tensor (batch_stride H*L*D, head_stride L*D, row_stride D) and the heads of a (B, L, E) tensor
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
  // Query heads per stored head: with grouped-query attention, query head h reads the keys and
  // values of stored head h / group (PyTorch SDPA's enable_gqa); 1 otherwise.
  Index group = 1;

  Map at(Index b, Index h) const {
    return Map(offset_pointer(data, b * batch_stride + (h / group) * head_stride), rows, cols,
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

// Attention dropout (training only): each weight P[b, h, i, j] is kept with probability 1 - p
// and then scaled by 1/(1 - p), as torch.nn.functional.dropout. Whether a weight is kept depends
// only on the seed and its position (a counter-based generator, as FlashAttention's Philox), so
// both kernels drop the same weights whatever their tile order or thread count, and the backward
// pass regenerates the mask instead of storing an [L, S'] one.
template <class T>
struct Dropout {
  double p = 0;
  std::uint64_t seed = 0;
  Index heads = 1, rows = 0, cols = 0;  // H, L, S': positions are numbered over (b, h, i, j)

  bool active() const { return p > 0; }
  // Weights are kept when a 32-bit hash is at least p * 2^32; p = 1 drops every weight.
  std::uint64_t threshold() const { return static_cast<std::uint64_t>(p * 4294967296.0); }
  T keep_scale() const { return p >= 1 ? T(0) : static_cast<T>(1.0 / (1.0 - p)); }

  bool keeps(Index b, Index h, Index i, Index j) const {
    const auto position = static_cast<std::uint64_t>(((b * heads + h) * rows + i) * cols + j);
    // splitmix64's finaliser of (seed, position): every output bit depends on every input bit.
    std::uint64_t z = seed + (position + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (z >> 32) >= threshold();
  }

  // tile holds weights of queries row0.. and keys col0.. of head (b, h): multiplies each by
  // 1/(1 - p) where kept and by 0 where dropped.
  template <class Tile>
  void apply(Index b, Index h, Index row0, Index col0, Tile& tile) const {
    const T scale = keep_scale();
    for (Index i = 0; i < tile.rows(); ++i) {
      for (Index j = 0; j < tile.cols(); ++j) {
        tile(i, j) *= keeps(b, h, row0 + i, col0 + j) ? scale : T(0);
      }
    }
  }
};

// What a kernel computes besides q, k, v: the masks (each may be kind none), causal masking,
// the window and ALiBi over the first causal_cols keys, the scale, softcap and dropout.
template <class T>
struct CoreOptions {
  MaskLayout<T> attn_mask;
  MaskLayout<T> key_padding_mask;
  Causal causal = Causal::none;
  Index causal_cols = 0;
  Window window;
  // ALiBi: null, or one slope per query head; adds -slope_h * |c - j| to the scores of the input
  // keys, c = i or i + S - L (alibi_alignment), as FlashAttention's alibi_slopes.
  const T* alibi_slopes = nullptr;
  Alignment alibi_alignment = Alignment::top_left;
  T scale = T(1);
  // Logit soft-capping (Gemma 2, FlashAttention's softcap): scale q kᵀ becomes
  // c tanh(scale q kᵀ / c) before masks and biases are added; 0 = none.
  T softcap = T(0);
  Dropout<T> dropout;

  // tile += the scaled (and capped) scores of q [rows, D] against k [cols, D]. With softcap, the
  // capped scores are left in the top-left corner of `capped` (which the caller sized to hold the
  // tile), where the backward pass reads them for the derivative.
  template <class Tile, class Q, class K>
  void add_scores(Tile& tile, const Q& q, const K& k, Matrix<T>& capped) const {
    if (softcap > T(0)) {
      auto corner = capped.topLeftCorner(tile.rows(), tile.cols());
      corner.noalias() = scale * (q * k.transpose());
      corner = (softcap * (corner.array() / softcap).tanh()).matrix();
      tile += corner;
    } else {
      tile.noalias() += scale * (q * k.transpose());
    }
  }
  // grad_scores, the gradient of the capped scores, becomes that of the uncapped ones:
  // d/ds c tanh(s / c) = 1 - tanh²(s / c) = 1 - (capped / c)².
  template <class Grad>
  void softcap_backward(Grad& grad_scores, const Matrix<T>& capped) const {
    if (softcap > T(0)) {
      const auto corner = capped.topLeftCorner(grad_scores.rows(), grad_scores.cols());
      grad_scores.array() *= T(1) - (corner.array() / softcap).square();
    }
  }

  // True when some tiles need masks() (anything besides the scaled scores).
  bool any_mask() const {
    return attn_mask.kind != MaskKind::none || key_padding_mask.kind != MaskKind::none ||
           causal != Causal::none || window.active() || alibi_slopes != nullptr;
  }

  // Query i of L may see input keys j in [visible_begin(i), visible_end(i)) as far as causal
  // masking and the window go (masks may block more). Both bounds never decrease with i, so a
  // block of queries sees at most [visible_begin(first row), visible_end(last row)).
  Index visible_begin(Index query_len, Index i) const {
    if (window.left < 0) return 0;
    return std::clamp<Index>(window_centre(query_len, i) - window.left, 0, causal_cols);
  }
  Index visible_end(Index query_len, Index i) const {
    const Index end = causal_visible_end(causal, causal_cols, query_len, i);
    if (window.right < 0) return end;
    return std::min(
        end, std::clamp<Index>(window_centre(query_len, i) + window.right + 1, 0, causal_cols));
  }

  // tile holds scores of queries row0.. and keys col0..: -inf where causal masking or the
  // window hides a key.
  template <class Tile>
  void apply_visible_range(Index query_len, Index row0, Index col0, Tile& tile) const {
    if (causal == Causal::none && !window.active()) return;
    const Index col_end = std::min(causal_cols, col0 + tile.cols());
    for (Index i = 0; i < tile.rows(); ++i) {
      const Index begin = visible_begin(query_len, row0 + i);
      const Index end = visible_end(query_len, row0 + i);
      for (Index j = col0; j < std::min(begin, col_end); ++j) {
        tile(i, j - col0) = -std::numeric_limits<T>::infinity();
      }
      for (Index j = std::max(end, col0); j < col_end; ++j) {
        tile(i, j - col0) = -std::numeric_limits<T>::infinity();
      }
      if (window.dilation > 1) {
        const Index centre = window_centre(query_len, row0 + i);
        for (Index j = std::max(begin, col0); j < std::min(end, col_end); ++j) {
          if ((centre - j) % window.dilation != 0) {
            tile(i, j - col0) = -std::numeric_limits<T>::infinity();
          }
        }
      }
    }
  }

  // tile <- the masks of queries row0.. and keys col0.. of head (b, h): 0, additive values, and
  // -inf where blocked. tile's columns from causal_cols on are always visible (left 0).
  template <class Tile>
  void masks(Index b, Index h, Index query_len, Index row0, Index col0, Tile& tile) const {
    tile.setZero();
    attn_mask.apply(b, h, row0, col0, tile);
    key_padding_mask.apply(b, h, row0, col0, tile);
    apply_visible_range(query_len, row0, col0, tile);
    if (alibi_slopes != nullptr) add_alibi(h, query_len, row0, col0, tile);
  }

 private:
  Index window_centre(Index query_len, Index i) const {
    return window.alignment == Alignment::bottom_right ? i + causal_cols - query_len : i;
  }

  template <class Tile>
  void add_alibi(Index h, Index query_len, Index row0, Index col0, Tile& tile) const {
    const T slope = alibi_slopes[h];
    const Index shift = alibi_alignment == Alignment::bottom_right ? causal_cols - query_len : 0;
    const Index width = std::min(causal_cols - col0, tile.cols());
    for (Index i = 0; i < tile.rows(); ++i) {
      const Index centre = row0 + i + shift;
      for (Index j = 0; j < width; ++j) {
        tile(i, j) -= slope * static_cast<T>(std::abs(centre - (col0 + j)));
      }
    }
  }
};

// Below this many multiply-adds a parallel region costs more than it saves, and far more on a
// loaded machine, where OpenMP's spinning threads wait for cores that other processes hold
// (measured: a test of tiny attention problems took 50 s instead of 0.4 s at load 3.7 on two
// cores). Eigen does not thread a product below about 10^5 either.
constexpr double kMinParallelWork = 65536;

// Whether work spread over `tasks` tasks is worth a parallel region.
inline bool worth_threads(Index tasks, double multiply_adds) {
  return tasks > 1 && multiply_adds >= kMinParallelWork;
}

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
// The backward kernels add a second tile (the gradient of the scores) and a per-row vector.
template <class T>
struct KernelScratch {
  Matrix<T> scores;
  Matrix<T> acc;
  Vector<T> row_max, row_sum;
  RowVector<T> exps;
  Matrix<T> grad_scores;
  Vector<T> row_dot;
  Matrix<T> capped;  // softcap's capped scores, as add_scores leaves them
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
