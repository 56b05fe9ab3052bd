// What both attention kernels share: where each head's rows live (HeadLayout), what is
// computed besides q, k and v (CoreOptions), causal masking of a block of scores, and attention
// dropout.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "mha/kernels/flash_panels.hpp"
#include "mha/kernels/tile_product.hpp"
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

namespace mha::detail {

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

// A checked SparsePattern (mask.hpp) as the kernels read it: global positions strictly
// increasing, and the block layout's (h, row, col) entry at blocks[h * head_stride + row *
// block_cols + col] (head_stride 0 when all heads share it).
struct PatternLayout {
  const Index* global = nullptr;
  Index global_count = 0;
  const bool* blocks = nullptr;
  Index block = 1, block_cols = 0, head_stride = 0;
  Alignment alignment = Alignment::top_left;

  bool active() const { return global_count > 0 || blocks != nullptr; }

  // The position of query `row` of query_len when key_len input keys follow the alignment.
  Index position(Index row, Index query_len, Index key_len) const {
    return alignment == Alignment::bottom_right ? row + key_len - query_len : row;
  }
  // Whether a global position lies in [first, last].
  bool any_global(Index first, Index last) const {
    const Index* end = global + global_count;
    const Index* next = std::lower_bound(global, end, first);
    return next != end && *next <= last;
  }
  bool block_allows(Index h, Index query_position, Index key) const {
    return blocks == nullptr ||
           blocks[h * head_stride + (query_position / block) * block_cols + key / block];
  }
  // Whether the layout computes any block of queries at positions [first, last] and keys
  // [key_begin, key_end).
  bool any_block(Index h, Index first, Index last, Index key_begin, Index key_end) const {
    if (blocks == nullptr) return true;
    for (Index row = first / block; row <= last / block; ++row) {
      const bool* layout_row = blocks + h * head_stride + row * block_cols;
      for (Index col = key_begin / block; col <= (key_end - 1) / block; ++col) {
        if (layout_row[col]) return true;
      }
    }
    return false;
  }
};

// The kernels' view of `pattern` for query_len queries, key_len input keys and `heads` query
// heads, with query positions by `alignment` (pattern.alignment, or bottom_right when decoding);
// throws naming the part of the pattern that does not fit. Points into `pattern`.
inline PatternLayout checked_pattern(const SparsePattern& pattern, Index heads, Index query_len,
                                     Index key_len, Alignment alignment) {
  PatternLayout layout;
  layout.alignment = alignment;
  if (!pattern.active()) return layout;
  for (std::size_t g = 0; g < pattern.global_tokens.size(); ++g) {
    if (pattern.global_tokens[g] < 0 ||
        (g > 0 && pattern.global_tokens[g] <= pattern.global_tokens[g - 1])) {
      throw_argument("pattern.global_tokens", "must be strictly increasing positions >= 0, got " +
                                                  std::to_string(pattern.global_tokens[g]) +
                                                  " at index " + std::to_string(g));
    }
  }
  layout.global = pattern.global_tokens.data();
  layout.global_count = static_cast<Index>(pattern.global_tokens.size());
  if (pattern.block_layout.is_null()) return layout;
  // (A query at a negative position is simply never a global token.)
  if (alignment == Alignment::bottom_right && query_len > key_len) {
    throw_argument("pattern.alignment",
                   "bottom_right puts queries at negative positions, which a block_layout has no "
                   "rows for, when L (" +
                       std::to_string(query_len) + ") > S (" + std::to_string(key_len) + ")");
  }
  const Index block = pattern.block_size;
  if (block < 1) {
    throw_argument("pattern.block_size",
                   "must be at least 1 with a block_layout, got " + std::to_string(block));
  }
  // Blocks covering every query position and every input key.
  const Index last_position = layout.position(query_len - 1, query_len, key_len);
  const Index rows_needed = std::max<Index>(last_position / block + 1, 1);
  const Index cols_needed = (key_len + block - 1) / block;
  const Shape& shape = pattern.block_layout.shape();
  const std::size_t rank = shape.size();
  const bool covers = (rank == 2 || rank == 3) && shape[rank - 2] >= rows_needed &&
                      shape[rank - 1] >= cols_needed &&
                      (rank == 2 || shape[0] == 1 || shape[0] == heads);
  if (!covers) {
    throw_shape("pattern.block_layout",
                "[R, C] or [H = " + std::to_string(heads) +
                    ", R, C] with R >= " + std::to_string(rows_needed) +
                    ", C >= " + std::to_string(cols_needed) + " (blocks of " +
                    std::to_string(block) + " covering L = " + std::to_string(query_len) +
                    " query positions and S = " + std::to_string(key_len) + " keys)",
                shape);
  }
  layout.blocks = pattern.block_layout.data();
  layout.block = block;
  layout.block_cols = shape[rank - 1];
  layout.head_stride = rank == 3 && shape[0] == heads && heads > 1 ? shape[1] * shape[2] : 0;
  return layout;
}

// Talking heads' [H, H] row-major mixes of the logits (pre) and of the weights (post); null =
// no mixing at that stage. See kernels/talking_heads.hpp.
template <class T>
struct TalkingHeads {
  const T* pre = nullptr;
  const T* post = nullptr;
  bool active() const { return pre != nullptr || post != nullptr; }
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
  PatternLayout pattern;  // global tokens and block layout over the first causal_cols keys
  // ALiBi: null, or one slope per query head; adds -slope_h * |c - j| to the scores of the input
  // keys, c = i or i + S - L (alibi_alignment), as FlashAttention's alibi_slopes.
  const T* alibi_slopes = nullptr;
  Alignment alibi_alignment = Alignment::top_left;
  T scale = T(1);
  // Logit soft-capping (Gemma 2, FlashAttention's softcap): scale q kᵀ becomes
  // c tanh(scale q kᵀ / c) before masks and biases are added; 0 = none.
  T softcap = T(0);
  Dropout<T> dropout;
  // Talking heads: only the talking-heads kernel (attention_talking_heads) reads it.
  TalkingHeads<T> talking_heads;
  // Precision::bf16: the flash kernel's products in bf16 with fp32 sums where it can (FlashPath).
  bool bf16_products = false;
  // Learnable attention sinks (kernels/sinks.hpp): null, or one logit per query head [H] that
  // joins each row's softmax normaliser.
  const T* sinks = nullptr;

  // tile += the scaled (and capped) scores of q [rows, D] against k [cols, D]. With softcap, the
  // capped scores are left in the top-left corner of `capped` (which the caller sized to hold the
  // tile), where the backward pass reads them for the derivative.
  template <class Tile, class Q, class K>
  void add_scores(Tile& tile, const Q& q, const K& k, Matrix<T>& capped) const {
    if (softcap > T(0)) {
      auto corner = capped.topLeftCorner(tile.rows(), tile.cols());
      tile_product<T>(strided(corner), const_strided(q), Operand::as_stored, const_strided(k),
                      Operand::transposed, Accumulate::no, scale);
      corner = (softcap * (corner.array() / softcap).tanh()).matrix();
      tile += corner;
    } else {
      tile_product<T>(strided(tile), const_strided(q), Operand::as_stored, const_strided(k),
                      Operand::transposed, Accumulate::yes, scale);
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
           causal != Causal::none || window.active() || pattern.active() || alibi_slopes != nullptr;
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

  // Whether causal masking, the window and the pattern let any query of rows
  // [first_row, last_row] see any input key of [key_begin, key_end) (masks may block more): the
  // flash kernels skip the key blocks for which it is false.
  bool may_see(Index h, Index query_len, Index first_row, Index last_row, Index key_begin,
               Index key_end) const {
    if (key_begin >= causal_visible_end(causal, causal_cols, query_len, last_row)) return false;
    if (pattern.active()) {
      const Index first = pattern.position(first_row, query_len, causal_cols);
      const Index last = pattern.position(last_row, query_len, causal_cols);
      if (pattern.any_global(first, last) || pattern.any_global(key_begin, key_end - 1)) {
        return true;
      }
      if (!pattern.any_block(h, first, last, key_begin, key_end)) return false;
    }
    return key_end > visible_begin(query_len, first_row) &&
           key_begin < visible_end(query_len, last_row);
  }

  // tile, which holds only zeros (masks() calls this first), becomes -inf for queries row0.. and
  // keys col0.. of head h where causal masking, the window or the pattern hides a key; a row at
  // a time: ranges outside the window and blocks the layout drops become -inf, then the global
  // keys that causal masking allows are set back to 0 (global tokens reopen what the window and
  // the layout close, but not what causal masking closes).
  template <class Tile>
  void apply_visible_range(Index h, Index query_len, Index row0, Index col0, Tile& tile) const {
    if (causal == Causal::none && !window.active() && !pattern.active()) return;
    constexpr T kBlocked = -std::numeric_limits<T>::infinity();
    const Index col_end = std::min(causal_cols, col0 + tile.cols());
    const Index* global_end = pattern.global + pattern.global_count;
    const Index* first_global_key = std::lower_bound(pattern.global, global_end, col0);
    for (Index i = 0; i < tile.rows(); ++i) {
      const Index row = row0 + i;
      auto tile_row = tile.row(i);
      const auto block_out = [&](Index from, Index to) {  // keys [from, to) of the tile
        if (from < to) tile_row.segment(from - col0, to - from).setConstant(kBlocked);
      };
      const Index causal_end =
          std::min(col_end, causal_visible_end(causal, causal_cols, query_len, row));
      const Index position = pattern.position(row, query_len, causal_cols);
      block_out(std::max(causal_end, col0), col_end);
      if (causal_end <= col0 || pattern.any_global(position, position)) continue;
      const Index begin = std::clamp(visible_begin(query_len, row), col0, causal_end);
      const Index end = std::clamp(visible_end(query_len, row), begin, causal_end);
      block_out(col0, begin);
      block_out(end, causal_end);
      if (window.dilation > 1) {
        const Index centre = window_centre(query_len, row);
        for (Index j = begin; j < end; ++j) {
          if ((centre - j) % window.dilation != 0) tile_row(j - col0) = kBlocked;
        }
      }
      if (pattern.blocks != nullptr) {
        for (Index j = begin; j < end;) {
          const Index next = std::min(end, (j / pattern.block + 1) * pattern.block);
          if (!pattern.block_allows(h, position, j)) block_out(j, next);
          j = next;
        }
      }
      for (const Index* g = first_global_key; g != global_end && *g < causal_end; ++g) {
        tile_row(*g - col0) = T(0);
      }
    }
  }

  // tile <- the masks of queries row0.. and keys col0.. of head (b, h): 0, additive values, and
  // -inf where blocked. tile's columns from causal_cols on are always visible (left 0).
  template <class Tile>
  void masks(Index b, Index h, Index query_len, Index row0, Index col0, Tile& tile) const {
    tile.setZero();
    // Positions first, while the tile holds only zeros: a pattern's global tokens set keys back
    // to 0 (see apply_visible_range); the masks then add to 0 or leave -inf.
    apply_visible_range(h, query_len, row0, col0, tile);
    attn_mask.apply(b, h, row0, col0, tile);
    key_padding_mask.apply(b, h, row0, col0, tile);
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

// Calls visit(j0, cols) for each key block that queries first_row..last_row of head h may see:
// the input keys within causal masking's, the window's and the pattern's limits, then the extra
// keys (bias_k, zero attention). Key blocks outside those limits are never visited: a window of
// w keys costs O(L·w), not O(L·S), and a block layout costs what its kept blocks cost.
template <class T, class Visit>
void for_each_key_block(const CoreOptions<T>& options, Index h, Index key_len, Index query_len,
                        Index first_row, Index last_row, Index block, Visit&& visit) {
  if (!options.pattern.active()) {
    const Index begin = options.visible_begin(query_len, first_row);
    const Index end = options.visible_end(query_len, last_row);
    for (Index j0 = begin; j0 < end; j0 += block) visit(j0, std::min(block, end - j0));
  } else {
    // Runs of the layout's blocks (or of 64 keys, so that a global key brings few others with
    // it) that some of the queries may see, cut into visits of at most `block` keys.
    const Index end = causal_visible_end(options.causal, options.causal_cols, query_len, last_row);
    const Index unit =
        options.pattern.blocks != nullptr ? options.pattern.block : std::min<Index>(block, 64);
    Index run_begin = 0, run_end = 0;
    const auto flush = [&] {
      for (Index j0 = run_begin; j0 < run_end; j0 += block) {
        visit(j0, std::min(block, run_end - j0));
      }
    };
    for (Index j0 = 0; j0 < end; j0 += unit) {
      const Index j1 = std::min(end, j0 + unit);
      if (!options.may_see(h, query_len, first_row, last_row, j0, j1)) continue;
      if (j0 != run_end || run_end - run_begin + (j1 - j0) > block) {
        flush();
        run_begin = j0;
      }
      run_end = j1;
    }
    flush();
  }
  for (Index j0 = options.causal_cols; j0 < key_len; j0 += block) {
    visit(j0, std::min(block, key_len - j0));
  }
}

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
// The threads of the parallel region this thread is in (1 outside one).
inline int team_size() {
#ifdef _OPENMP
  return omp_get_num_threads();
#else
  return 1;
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
  // With a user's score_mod (flex_tile.hpp): the built-in masks of a tile, kept apart until the
  // score_mod has seen the scores; and in the backward, its derivatives and (with learned
  // parameters) its inputs.
  Matrix<T> flex_masks, mod_derivatives, mod_inputs;
  // A decoding task's rows' covers of its chunk by the user's mask (a BlockCover each).
  std::vector<unsigned char> row_covers;
  Matrix<T> queries;  // the small-head flash kernel's scaled query block; a decoding task's queries
  // A decoding task's queries as the packed GEMM's panels, or as a q4 cache's products read
  // them (decode_q4.hpp: int8 codes, in its bytes).
  Matrix<T> packed_queries;
  // Talking heads (kernels/talking_heads.hpp) mixes across heads, so it keeps all H heads of one
  // query block at once: logits, probabilities and mixed weights, each [H * rows, S'] (head h's
  // [rows, S'] block at rows h * rows).
  Matrix<T> head_logits, head_probs, head_weights;
  // 16-bit storage (see compute_t): a block of cached keys and values, converted to T where the
  // products read them; and converted weight rows (gemm.hpp's product_transposed), a plain
  // vector that only grows, since one forward converts weights of several shapes (a decoding
  // task also keeps its transposed scores there, or a q4 cache's bf16 weights of P·V).
  Matrix<T> key_tile, value_tile;
  std::vector<T> weight_rows;
  // The float flash kernel's operands packed for the library's own GEMM (flash_panels.hpp).
  FlashPanels panels;
};

// A user's callbacks (flex_attention's mods, kernels/flex_tile.hpp) run inside the kernels'
// parallel regions, which an escaping exception would end with std::terminate. TaskExceptions<true>
// runs each task under a try: the first exception is kept, the region's later tasks are skipped,
// and rethrow() throws it once the region has ended. TaskExceptions<false> only runs the task:
// the library's own code throws nothing inside a region.
template <bool Guard>
class TaskExceptions {
 public:
  template <class Task>
  void run(Task&& task) {
    if constexpr (Guard) {
      if (failed_.load(std::memory_order_relaxed)) return;
      try {
        task();
      } catch (...) {
        MHA_OMP_PRAGMA(omp critical(mha_task_exceptions)) {
          if (!first_) first_ = std::current_exception();
        }
        failed_.store(true, std::memory_order_relaxed);
      }
    } else {
      task();
    }
  }
  void rethrow() const {
    if (first_) std::rethrow_exception(first_);
  }

 private:
  std::exception_ptr first_;
  std::atomic<bool> failed_{false};
};

// One KernelScratch per thread that the next parallel region can have.
template <class T>
std::vector<KernelScratch<T>>& scratch_for_threads(std::vector<KernelScratch<T>>& scratch) {
  const auto threads = static_cast<std::size_t>(max_threads());
  if (scratch.size() < threads) scratch.resize(threads);
  return scratch;
}

}  // namespace mha::detail
