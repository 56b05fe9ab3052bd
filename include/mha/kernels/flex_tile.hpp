// How the flash kernels apply a user's score_mod and mask_mod (flex.hpp) to a tile of scores.
// The kernels take the mods as a template parameter (Flex), so each call of a mod is inlined into
// the loop over the tile; NoFlex, the default, compiles every use away.
//
// A tile is queries i0 .. i0 + rows - 1 against input keys j0 .. j0 + cols - 1 of head (b, h).
// Its cover, from the block mask, says whether the mask_mod keeps all of its pairs (full: the
// mask_mod is not called), none (empty: the kernel skips the tile before any product) or some
// (partial: the mask_mod is called for each pair of the block mask's partial blocks in it).
// Order: the score_mod sees scale q kᵀ (capped by the built-in softcap); the built-in masks and
// biases are added to what it returns; the mask_mod's -inf comes last.
#pragma once

#include <algorithm>
#include <cstddef>
#include <limits>
#include <type_traits>
#include <utility>

#include "mha/dual.hpp"
#include "mha/tensor.hpp"

namespace mha {

enum class BlockCover : unsigned char { empty, partial, full };

// The score_mod that changes nothing (flex_attention with a mask alone): the kernels skip it.
struct NoScoreMod {
  template <class Score>
  Score operator()(Score score, Index /*b*/, Index /*h*/, Index /*q_idx*/, Index /*kv_idx*/) const {
    return score;
  }
};
inline constexpr NoScoreMod no_score_mod{};

// One query's scores of consecutive keys, as a score_mod's modify_row receives them.
template <class T>
using ScoreRow = Eigen::Map<Eigen::Array<T, 1, Eigen::Dynamic>>;

}  // namespace mha

namespace mha::detail {

struct NoFlex {
  static constexpr bool kActive = false;
  static constexpr bool kScoreMod = false;
  static constexpr bool kParameters = false;
  static bool may_block(BlockCover /*cover*/) { return false; }
};

// Whether a score_mod also has the row form: score_mod.modify_row(scores, b, h, q_idx, kv_first)
// rewrites the scores of keys kv_first, kv_first + 1, ... of one query in place (a ScoreRow), so
// that Eigen's vectorised array operations can do what a call per score would do one at a time.
template <class ScoreMod, class T, class = void>
struct HasRowForm : std::false_type {};
template <class ScoreMod, class T>
struct HasRowForm<ScoreMod, T,
                  std::void_t<decltype(std::declval<const ScoreMod&>().modify_row(
                      std::declval<ScoreRow<T>>(), Index{}, Index{}, Index{}, Index{}))>>
    : std::true_type {};

// Whether a score_mod has learned parameters: P = score_mod.parameter_count() of them, and
// score_mod.accumulate_gradient(gradient, grad_score, score, b, h, q_idx, kv_idx), which adds to
// gradient [P] what one pair's grad_score (the loss's derivative with respect to the score_mod's
// result) gives its parameters, score being its input.
template <class ScoreMod, class T, class = void>
struct HasParameters : std::false_type {};
template <class ScoreMod, class T>
struct HasParameters<
    ScoreMod, T,
    std::void_t<decltype(std::declval<const ScoreMod&>().parameter_count()),
                decltype(std::declval<const ScoreMod&>().accumulate_gradient(
                    std::declval<T*>(), T{}, T{}, Index{}, Index{}, Index{}, Index{}))>>
    : std::true_type {};

// ScoreMod: score_mod(score, b, h, q_idx, kv_idx) -> the new score; Mask: a BlockMask (null for
// none), whose cover() answers for a tile, whose blocks say where its mask_mod must be called.
// T: the scores' type.
template <class T, class ScoreMod, class Mask>
struct FlexTile {
  static constexpr bool kActive = true;
  static constexpr bool kScoreMod = !std::is_same_v<ScoreMod, NoScoreMod>;
  static constexpr bool kParameters = HasParameters<ScoreMod, T>::value;
  const ScoreMod* score_mod = nullptr;
  const Mask* block_mask = nullptr;  // null: every pair visible
  // With learned parameters, the backward's gradients of them: [tasks, P], a row per task of the
  // backward (batch element and key/value head), summed in task order afterwards so that the
  // result does not depend on the threads.
  T* parameter_gradients = nullptr;
  Index parameter_count = 0;
  // What the kernel's batch element 0 and query row 0 are to the mods: a layer runs the flash
  // kernel on one sequence at a time for a packed batch (sequence `batch_offset`) and for a
  // decoding step's prompt (sequence `batch_offset` of the step, whose first new query is row
  // `query_offset` of its cache).
  Index batch_offset = 0, query_offset = 0;

  BlockCover cover(Index b, Index h, Index i0, Index rows, Index j0, Index cols) const {
    return block_mask == nullptr
               ? BlockCover::full
               : block_mask->cover(b + batch_offset, h, i0 + query_offset, rows, j0, cols);
  }
  // The cover of one query's keys [j0, j0 + cols) (the decoding kernel's chunk of a row).
  BlockCover row_cover(Index b, Index h, Index i, Index j0, Index cols) const {
    return block_mask == nullptr
               ? BlockCover::full
               : block_mask->row_cover(b + batch_offset, h, i + query_offset, j0, cols);
  }
  // A layer's call of `batch` sequences of `heads` query heads whose longest has `queries` queries
  // and `keys` keys: refused (ShapeError) where the block mask does not reach so far.
  void check_covers(Index batch, Index heads, Index queries, Index keys) const {
    if (block_mask != nullptr) block_mask->check_covers(batch, heads, queries, keys);
  }
  // Whether the tile may hold -inf after mask() (a score_mod may also return it).
  bool may_block(BlockCover cover) const { return kScoreMod || cover != BlockCover::full; }

  // scores [rows, cols] (a row-major block) <- score_mod of each: by rows where it has the row
  // form, else a call per score.
  template <class Tile>
  void modify_scores(Index b, Index h, Index i0, Index j0, Tile& scores) const {
    if constexpr (kScoreMod) {
      b += batch_offset;
      i0 += query_offset;
      for (Index r = 0; r < scores.rows(); ++r) {
        T* row = scores.row(r).data();
        if constexpr (HasRowForm<ScoreMod, T>::value) {
          score_mod->modify_row(ScoreRow<T>(row, scores.cols()), b, h, i0 + r, j0);
        } else {
          for (Index c = 0; c < scores.cols(); ++c)
            row[c] = (*score_mod)(row[c], b, h, i0 + r, j0 + c);
        }
      }
    }
  }

  // The same, called with Dual numbers (mha/dual.hpp) for the backward: derivatives [rows, cols]
  // receives d score_mod / d score of each, and inputs (with learned parameters) the scores the
  // score_mod was given.
  template <class Tile, class Derivatives, class Inputs>
  void differentiate_scores(Index b, Index h, Index i0, Index j0, Tile& scores,
                            Derivatives& derivatives, Inputs& inputs) const {
    b += batch_offset;
    i0 += query_offset;
    if constexpr (kParameters) inputs = scores;
    static_assert(
        std::is_invocable_r_v<Dual<T>, const ScoreMod&, Dual<T>, Index, Index, Index, Index>,
        "the backward differentiates score_mod by calling it with a Dual<T> (mha/dual.hpp): make "
        "its score parameter generic (auto score)");
    for (Index r = 0; r < scores.rows(); ++r) {
      for (Index c = 0; c < scores.cols(); ++c) {
        const Dual<T> modified = (*score_mod)(Dual<T>{scores(r, c), T(1)}, b, h, i0 + r, j0 + c);
        scores(r, c) = modified.value;
        derivatives(r, c) = modified.derivative;
      }
    }
  }

  // grad_scores [rows, cols], the loss's derivatives with respect to the score_mod's results, into
  // the learned parameters' gradient of this task.
  template <class Grad, class Inputs>
  void accumulate_parameters(Index task, Index b, Index h, Index i0, Index j0,
                             const Grad& grad_scores, const Inputs& inputs) const {
    if constexpr (kParameters) {
      b += batch_offset;
      i0 += query_offset;
      T* gradient = parameter_gradients + task * parameter_count;
      for (Index r = 0; r < grad_scores.rows(); ++r) {
        for (Index c = 0; c < grad_scores.cols(); ++c) {
          if (grad_scores(r, c) != T(0)) {
            score_mod->accumulate_gradient(gradient, grad_scores(r, c), inputs(r, c), b, h, i0 + r,
                                           j0 + c);
          }
        }
      }
    }
  }

  // The pairs the block mask hides become -inf, block by block of it: nothing in its full
  // blocks, all of its empty ones, and in its partial ones where the mask_mod says so.
  template <class Tile>
  void mask(Index b, Index h, Index i0, Index j0, BlockCover cover, Tile& scores) const {
    static_assert(Tile::IsRowMajor, "a tile's rows are contiguous");
    constexpr T kBlocked = -std::numeric_limits<T>::infinity();
    if (block_mask == nullptr || cover == BlockCover::full) return;
    b += batch_offset;
    i0 += query_offset;
    const Index query_block = block_mask->query_block(), key_block = block_mask->key_block();
    const Index i_end = i0 + scores.rows(), j_end = j0 + scores.cols();
    for (Index r0 = i0, r1 = 0; r0 < i_end; r0 = r1) {
      r1 = std::min(i_end, (r0 / query_block + 1) * query_block);
      for (Index c0 = j0, c1 = 0; c0 < j_end; c0 = c1) {
        c1 = std::min(j_end, (c0 / key_block + 1) * key_block);
        switch (block_mask->block(b, h, r0 / query_block, c0 / key_block)) {
          case BlockCover::full:
            break;
          case BlockCover::empty:
            scores.block(r0 - i0, c0 - j0, r1 - r0, c1 - c0).setConstant(kBlocked);
            break;
          case BlockCover::partial:
            for (Index i = r0; i < r1; ++i) {
              // A select rather than a branch, which the compiler vectorises for a mask_mod of
              // plain arithmetic on kv_idx (a window, a document's bounds).
              T* row = &scores(i - i0, c0 - j0);
              for (Index j = c0; j < c1; ++j) {
                row[j - c0] = block_mask->mask_mod()(b, h, i, j) ? row[j - c0] : kBlocked;
              }
            }
            break;
        }
      }
    }
  }
};

}  // namespace mha::detail
