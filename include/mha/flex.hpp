// Attention variants as code (PyTorch's FlexAttention, for C++): a score_mod rewrites each score
// and a mask_mod says which query–key pairs are visible, both plain C++ callables that the flash
// kernels take as template parameters and inline into their loops over a tile.
//
//   score_mod(score, b, h, q_idx, kv_idx) -> the new score: score is scale q kᵀ (after the
//       built-in softcap when AttentionOptions has one) of query q_idx and key kv_idx of batch
//       element b and query head h; AttentionOptions' masks and biases are added to what it
//       returns. Called from several threads at once, so it must not write shared state, and
//       for pairs a mask hides as well (their result is then replaced by -inf). The backward
//       calls it with a Dual<T> score (mha/dual.hpp) to differentiate it: write it generic in
//       the score (`[](auto score, Index b, Index h, Index q, Index kv) { ... }`). A score_mod
//       may also have the row form modify_row(ScoreRow<T> scores, b, h, q_idx, kv_first), which
//       rewrites one query's scores of keys kv_first.. in place with Eigen's array operations;
//       the forward then calls it instead, a row at a time (mods.hpp's ALiBi and softcap do).
//   mask_mod(b, h, q_idx, kv_idx) -> bool: true where query q_idx may see key kv_idx.
//
// A BlockMask evaluates a mask_mod once for a shape and records, for each block of query_block
// queries × key_block keys, whether it hides all of the block's pairs (the kernels then never
// visit it), shows all of them (the mask_mod is not called there) or some (it is called for each
// pair). Build it once and pass it to every call and layer with that shape: its memory is one
// byte a block, B·H·(L / query_block)·(S / key_block) bytes, or less where it broadcasts (a
// batch or heads of 1 stands for all, for a mask_mod that does not read b or h).
//
// q_idx and kv_idx count from 0 in the query and the key tensors (top-left, as FlexAttention).
// A row that sees no key gives 0 (FlexAttention's too). A mod may throw: the call (or the
// BlockMask's construction) then throws the first exception once its threads have stopped, and
// the output is not to be used. mods.hpp holds a library of mods.
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "mha/attention.hpp"
#include "mha/dual.hpp"
#include "mha/kernels/flash.hpp"
#include "mha/kernels/flex_tile.hpp"
#include "mha/kernels/sinks.hpp"

namespace mha {

// Blocks of 32 queries × 64 keys: a forward tile of the flash kernel (96 × 256) reads 12 of
// them, a backward tile (96 × 192) 9, and a sliding window or a document boundary leaves few
// pairs in partial blocks.
inline constexpr Index kBlockMaskQueryBlock = 32;
inline constexpr Index kBlockMaskKeyBlock = 64;

template <class MaskMod>
class BlockMask {
 public:
  // Evaluates mask_mod for every (b, h, q_idx, kv_idx) of [batch, heads, query_len, key_len]; a
  // batch or heads of 1 broadcasts over the calls' (mask_mod is then called with b or h = 0).
  BlockMask(MaskMod mask_mod, Index batch, Index heads, Index query_len, Index key_len,
            Index query_block = kBlockMaskQueryBlock, Index key_block = kBlockMaskKeyBlock)
      : mask_mod_(std::move(mask_mod)),
        batch_(batch),
        heads_(heads),
        query_len_(query_len),
        key_len_(key_len),
        query_block_(query_block),
        key_block_(key_block) {
    const auto positive = [](const char* argument, Index value) {
      if (value < 1) {
        detail::throw_argument(argument, "must be at least 1, got " + std::to_string(value));
      }
    };
    positive("batch", batch);
    positive("heads", heads);
    positive("query_block", query_block);
    positive("key_block", key_block);
    if (query_len < 0 || key_len < 0) {
      detail::throw_argument("query_len, key_len", "must not be negative, got " +
                                                       std::to_string(query_len) + ", " +
                                                       std::to_string(key_len));
    }
    query_blocks_ = (query_len + query_block - 1) / query_block;
    key_blocks_ = (key_len + key_block - 1) / key_block;
    cells_.resize(static_cast<std::size_t>(batch * heads * query_blocks_ * key_blocks_));
    const Index rows_of_cells = batch * heads * query_blocks_;
    [[maybe_unused]] const double work = static_cast<double>(batch * heads) *
                                         static_cast<double>(query_len) *
                                         static_cast<double>(key_len);
    // A mask_mod that throws: its exception, after the parallel loop.
    detail::TaskExceptions<true> task_exceptions;
    MHA_OMP_PRAGMA(omp parallel for schedule(dynamic) if (detail::worth_threads(rows_of_cells, work)))
    for (Index row = 0; row < rows_of_cells; ++row) {
      task_exceptions.run([&] {
        const Index b = row / (heads * query_blocks_), h = (row / query_blocks_) % heads;
        const Index i0 = (row % query_blocks_) * query_block;
        for (Index kb = 0; kb < key_blocks_; ++kb) {
          cells_[static_cast<std::size_t>(row * key_blocks_ + kb)] =
              evaluate(b, h, i0, std::min(query_block, query_len - i0), kb * key_block,
                       std::min(key_block, key_len - kb * key_block));
        }
      });
    }
    task_exceptions.rethrow();
  }

  const MaskMod& mask_mod() const { return mask_mod_; }
  Index batch() const { return batch_; }
  Index heads() const { return heads_; }
  Index query_len() const { return query_len_; }
  Index key_len() const { return key_len_; }
  Index query_block() const { return query_block_; }
  Index key_block() const { return key_block_; }
  std::size_t memory_bytes() const { return cells_.size() * sizeof(BlockCover); }

  // The cover of block (query_block_index, key_block_index) of (b, h), broadcast as built.
  BlockCover block(Index b, Index h, Index query_block_index, Index key_block_index) const {
    return cells_[static_cast<std::size_t>(
        ((std::min(b, batch_ - 1) * heads_ + std::min(h, heads_ - 1)) * query_blocks_ +
         query_block_index) *
            key_blocks_ +
        key_block_index)];
  }
  // The cover of query i's keys [j0, j0 + cols) of (b, h).
  BlockCover row_cover(Index b, Index h, Index i, Index j0, Index cols) const {
    return cover(b, h, i, 1, j0, cols);
  }
  // A layer's call with mods (flex_layer.hpp) of `batch` sequences of `heads` query heads, the
  // longest of `queries` queries (positions) and `keys` keys, needs a block mask built for at least
  // that many queries and keys, and a batch and heads of 1 or the call's.
  void check_covers(Index batch, Index heads, Index queries, Index keys) const {
    if (query_len_ < queries || key_len_ < keys || (batch_ != 1 && batch_ != batch) ||
        (heads_ != 1 && heads_ != heads)) {
      detail::throw_shape("block_mask",
                          "[" + std::to_string(batch) + " or 1, " + std::to_string(heads) +
                              " or 1, at least " + std::to_string(queries) + ", at least " +
                              std::to_string(keys) +
                              "] (the call's sequences, query heads, and its longest sequence's "
                              "queries and keys)",
                          Shape{batch_, heads_, query_len_, key_len_});
    }
  }
  // How many blocks of the whole mask have each cover.
  Index count(BlockCover cover) const {
    return static_cast<Index>(std::count(cells_.begin(), cells_.end(), cover));
  }

  // The cover of queries [i0, i0 + rows) and keys [j0, j0 + cols) of (b, h): what all the blocks
  // it touches agree on, else partial.
  BlockCover cover(Index b, Index h, Index i0, Index rows, Index j0, Index cols) const {
    const Index first_qb = i0 / query_block_, last_qb = (i0 + rows - 1) / query_block_;
    const Index first_kb = j0 / key_block_, last_kb = (j0 + cols - 1) / key_block_;
    const BlockCover first = block(b, h, first_qb, first_kb);
    if (first == BlockCover::partial) return first;
    for (Index qb = first_qb; qb <= last_qb; ++qb) {
      for (Index kb = first_kb; kb <= last_kb; ++kb) {
        if (block(b, h, qb, kb) != first) return BlockCover::partial;
      }
    }
    return first;
  }

 private:
  BlockCover evaluate(Index b, Index h, Index i0, Index rows, Index j0, Index cols) const {
    bool any_visible = false, any_hidden = false;
    for (Index i = i0; i < i0 + rows; ++i) {
      for (Index j = j0; j < j0 + cols; ++j) {
        if (mask_mod_(b, h, i, j)) {
          any_visible = true;
        } else {
          any_hidden = true;
        }
        if (any_visible && any_hidden) return BlockCover::partial;
      }
    }
    return any_visible ? BlockCover::full : BlockCover::empty;
  }

  MaskMod mask_mod_;
  Index batch_, heads_, query_len_, key_len_, query_block_, key_block_;
  Index query_blocks_ = 0, key_blocks_ = 0;
  std::vector<BlockCover> cells_;  // [batch, heads, query blocks, key blocks]
};

// FlexAttention's create_block_mask: a batch or heads of 1 broadcasts.
template <class MaskMod>
BlockMask<MaskMod> create_block_mask(MaskMod mask_mod, Index batch, Index heads, Index query_len,
                                     Index key_len, Index query_block = kBlockMaskQueryBlock,
                                     Index key_block = kBlockMaskKeyBlock) {
  return BlockMask<MaskMod>(std::move(mask_mod), batch, heads, query_len, key_len, query_block,
                            key_block);
}

// The mask_mod of no BlockMask: every pair visible.
struct AllVisible {
  bool operator()(Index /*b*/, Index /*h*/, Index /*q_idx*/, Index /*kv_idx*/) const {
    return true;
  }
};

namespace detail {

// The checks of a flex_attention call beyond scaled_dot_product_attention's: the flash kernel
// (the mods live in its tiles), and a block mask built for this shape.
template <class T, class MaskMod>
AttentionProblem<T> flex_problem(const TensorView<const T>& query, const TensorView<const T>& key,
                                 const TensorView<const T>& value,
                                 const BlockMask<MaskMod>* block_mask,
                                 const AttentionOptions<T>& options) {
  if (options.need_weights) {
    throw_argument("options.need_weights",
                   "flex_attention runs the flash kernel, which never forms the weights");
  }
  if (options.kernel == Kernel::reference) {
    throw_argument("options.kernel", "flex_attention runs the flash kernel; got reference");
  }
  AttentionProblem<T> problem = attention_problem(query, key, value, options);
  problem.kernel = Kernel::flash;
  if (block_mask != nullptr) {
    const auto fits = [](Index built, Index call) { return built == 1 || built == call; };
    if (block_mask->query_len() != problem.query_len || block_mask->key_len() != problem.key_len ||
        !fits(block_mask->batch(), problem.batch) || !fits(block_mask->heads(), problem.heads)) {
      throw_shape("block_mask",
                  "[" + std::to_string(problem.batch) + " or 1, " + std::to_string(problem.heads) +
                      " or 1, " + std::to_string(problem.query_len) + ", " +
                      std::to_string(problem.key_len) + "] (B, H, L, S of the call)",
                  Shape{block_mask->batch(), block_mask->heads(), block_mask->query_len(),
                        block_mask->key_len()});
    }
  }
  return problem;
}

template <class T, class ScoreMod, class MaskMod>
AttentionResult<T> flex_attention(const TensorView<const T>& query, const TensorView<const T>& key,
                                  const TensorView<const T>& value, const ScoreMod& score_mod,
                                  const BlockMask<MaskMod>* block_mask,
                                  const AttentionOptions<T>& options) {
  const auto problem = flex_problem(query, key, value, block_mask, options);
  const Index query_len = problem.query_len, key_len = problem.key_len;
  AttentionResult<T> result;
  result.output = Tensor<T>(problem.shape(query_len, problem.value_dim));
  result.logsumexp = Tensor<T>(problem.logsumexp_shape());
  std::vector<KernelScratch<T>> scratch;
  const FlexTile<T, ScoreMod, BlockMask<MaskMod>> flex{&score_mod, block_mask};
  const auto out = problem.heads_of(result.output.data(), query_len, problem.value_dim);
  attention_flash<T, T>(problem.batch, problem.heads,
                        problem.heads_of(query.data(), query_len, problem.head_dim),
                        problem.kv_heads_of(key.data(), key_len, problem.head_dim),
                        problem.kv_heads_of(value.data(), key_len, problem.value_dim), out,
                        problem.core, scratch, result.logsumexp.data(), FlashBlocks{}, flex);
  if (problem.core.sinks != nullptr) {
    apply_sinks(problem.batch, problem.heads, out, result.logsumexp.data(), problem.core.sinks);
  }
  return result;
}

template <class T, class ScoreMod, class MaskMod>
AttentionGradients<T> flex_attention_backward(
    const TensorView<const T>& query, const TensorView<const T>& key,
    const TensorView<const T>& value, const AttentionResult<T>& result,
    const TensorView<const T>& grad_output, const ScoreMod& score_mod,
    const BlockMask<MaskMod>* block_mask, const AttentionOptions<T>& options) {
  if (options.precision != Precision::fp32) {
    throw_argument("precision", std::string("the backward computes in fp32; got ") +
                                    precision_name(options.precision));
  }
  const auto problem = flex_problem(query, key, value, block_mask, options);
  const Index query_len = problem.query_len, key_len = problem.key_len;
  const Shape output_shape = problem.shape(query_len, problem.value_dim);
  check_shape("result.output", output_shape, result.output.shape());
  check_shape("grad_output", output_shape, grad_output.shape());
  check_shape("result.logsumexp", problem.logsumexp_shape(), result.logsumexp.shape());
  AttentionGradients<T> grads;
  grads.query = Tensor<T>(query.shape());
  grads.key = Tensor<T>(key.shape());
  grads.value = Tensor<T>(value.shape());
  std::vector<KernelScratch<T>> scratch;
  FlexTile<T, ScoreMod, BlockMask<MaskMod>> flex{&score_mod, block_mask};
  // Learned parameters: a gradient row per task of the backward (batch element, key/value head).
  std::vector<T> per_task;
  const Index tasks = problem.batch * problem.kv_heads;
  if constexpr (decltype(flex)::kParameters) {
    flex.parameter_count = static_cast<Index>(score_mod.parameter_count());
    per_task.assign(static_cast<std::size_t>(tasks * flex.parameter_count), T(0));
    flex.parameter_gradients = per_task.data();
  }
  const auto out = problem.heads_of(result.output.data(), query_len, problem.value_dim);
  attention_flash_backward<T>(
      problem.batch, problem.heads, problem.heads_of(query.data(), query_len, problem.head_dim),
      problem.kv_heads_of(key.data(), key_len, problem.head_dim),
      problem.kv_heads_of(value.data(), key_len, problem.value_dim), out,
      problem.heads_of(grad_output.data(), query_len, problem.value_dim), result.logsumexp.data(),
      problem.heads_of(grads.query.data(), query_len, problem.head_dim),
      problem.kv_heads_of(grads.key.data(), key_len, problem.head_dim),
      problem.kv_heads_of(grads.value.data(), key_len, problem.value_dim), problem.core, scratch,
      kBackwardBlocks, flex);
  if constexpr (decltype(flex)::kParameters) {
    grads.score_mod = Tensor<T>({flex.parameter_count});
    for (Index task = 0; task < tasks; ++task) {
      grads.score_mod.flat() += Eigen::Map<const Vector<T>>(
          per_task.data() + task * flex.parameter_count, flex.parameter_count);
    }
  }
  if (problem.core.sinks != nullptr) {
    grads.sinks = Tensor<T>({problem.heads});
    accumulate_sink_gradients(problem.batch, problem.heads, out,
                              problem.heads_of(grad_output.data(), query_len, problem.value_dim),
                              result.logsumexp.data(), problem.core.sinks, grads.sinks.data());
  }
  return grads;
}

}  // namespace detail

// query [..., L, D], key [..., S, D], value [..., S, Dv] as for scaled_dot_product_attention
// (every AttentionOptions field but need_weights and the reference kernel), with score_mod
// applied to each visible score. Returns the output and the log-sum-exp its backward needs.
template <class T, class ScoreMod>
AttentionResult<T> flex_attention(TensorView<const T> query, TensorView<const T> key,
                                  TensorView<const T> value, const ScoreMod& score_mod,
                                  const AttentionOptions<T>& options = {}) {
  return detail::flex_attention<T, ScoreMod, AllVisible>(query, key, value, score_mod, nullptr,
                                                         options);
}

// The same with the pairs block_mask's mask_mod hides blocked (pass no_score_mod for a mask
// alone); block_mask was built for this call's L and S, and its B and H or 1.
template <class T, class ScoreMod, class MaskMod>
AttentionResult<T> flex_attention(TensorView<const T> query, TensorView<const T> key,
                                  TensorView<const T> value, const ScoreMod& score_mod,
                                  const BlockMask<MaskMod>& block_mask,
                                  const AttentionOptions<T>& options = {}) {
  return detail::flex_attention<T, ScoreMod, MaskMod>(query, key, value, score_mod, &block_mask,
                                                      options);
}

template <class T, class ScoreMod>
AttentionResult<T> flex_attention(const Tensor<T>& query, const Tensor<T>& key,
                                  const Tensor<T>& value, const ScoreMod& score_mod,
                                  const AttentionOptions<T>& options = {}) {
  return flex_attention<T, ScoreMod>(query.view(), key.view(), value.view(), score_mod, options);
}

template <class T, class ScoreMod, class MaskMod>
AttentionResult<T> flex_attention(const Tensor<T>& query, const Tensor<T>& key,
                                  const Tensor<T>& value, const ScoreMod& score_mod,
                                  const BlockMask<MaskMod>& block_mask,
                                  const AttentionOptions<T>& options = {}) {
  return flex_attention<T, ScoreMod, MaskMod>(query.view(), key.view(), value.view(), score_mod,
                                              block_mask, options);
}

// The gradients of loss = sum(result.output ∘ grad_output) with respect to query, key and value
// (and the sinks', with AttentionOptions::sinks), where result is what flex_attention returned
// for the same inputs, mods and options.
template <class T, class ScoreMod>
AttentionGradients<T> flex_attention_backward(const Tensor<T>& query, const Tensor<T>& key,
                                              const Tensor<T>& value,
                                              const AttentionResult<T>& result,
                                              const Tensor<T>& grad_output,
                                              const ScoreMod& score_mod,
                                              const AttentionOptions<T>& options = {}) {
  return detail::flex_attention_backward<T, ScoreMod, AllVisible>(
      query.view(), key.view(), value.view(), result, grad_output.view(), score_mod, nullptr,
      options);
}

template <class T, class ScoreMod, class MaskMod>
AttentionGradients<T> flex_attention_backward(
    const Tensor<T>& query, const Tensor<T>& key, const Tensor<T>& value,
    const AttentionResult<T>& result, const Tensor<T>& grad_output, const ScoreMod& score_mod,
    const BlockMask<MaskMod>& block_mask, const AttentionOptions<T>& options = {}) {
  return detail::flex_attention_backward<T, ScoreMod, MaskMod>(
      query.view(), key.view(), value.view(), result, grad_output.view(), score_mod, &block_mask,
      options);
}

}  // namespace mha
