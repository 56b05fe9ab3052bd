// The flash kernel: attention over query blocks × key blocks with an online softmax, so the
// [L, S'] scores are never stored. Extra memory is one [Bq, Bk] score tile, a [Bq, Dv]
// accumulator and two [Bq] vectors (running max and running sum), whatever L and S.
//
// For each query block, for each key block (FlashAttention-2's loop order):
//   tile  = masks (0, additive values, -inf where blocked), skipped if all -inf
//   tile += scale * q_blk k_blkᵀ
//   m'    = max(m, rowmax(tile));  p = exp(tile - m');  c = exp(m - m')
//   sum   = c * sum + rowsum(p);   acc = c * acc + p v_blk;   m = m'
// and once at the end out = acc / sum (a row that saw no visible key has sum 0 and gives 0).
// Key blocks that causal masking, the window or the pattern hides from every query of the block
// are never visited.
// In training, dropout multiplies p by its mask after rowsum(p) (the softmax's normaliser is
// that of the undropped weights), and the log-sum-exp m + log(sum) of each row is saved: the
// backward pass (attention_flash_backward, below) recomputes any tile of P from it.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "mha/compiled.hpp"
#include "mha/kernels/common.hpp"
#include "mha/kernels/convert.hpp"
#include "mha/kernels/flash_bf16.hpp"
#include "mha/kernels/flash_small_head.hpp"
#include "mha/kernels/flex_tile.hpp"
#include "mha/softmax.hpp"

namespace mha::detail {

// Query and key block sizes. A [96, 256] float tile is 96 KiB: with the q, k and v blocks it
// stays in a 512 KiB L2 for D up to 128. (PyTorch's CPU flash kernel uses kv blocks of 512 and
// query blocks of 32 to 256.) Query blocks are whole panels of the micro-kernel's 6 rows, and the
// backward's key blocks of 6 and of 16 (a tile of 64 rows left a panel of 4, computed whole and
// packed apart): the forward at L = 2048, D = 64 ran 8-9 % faster at 96 x 256 than at 64 x 256,
// the backward 8-11 % at 96 x 192 than at 64 x 128 (medians of 11 alternating runs, AVX2 Zen 3,
// 2026-12-02).
// small_heads lets heads that attention_flash_small_head handles take it (whatever the block
// sizes, which it chooses itself); the tests turn it off to run these tiles at every head size.
struct FlashBlocks {
  Index query = 96;
  Index key = 256;
  bool small_heads = true;
  // The backward's queries a chunk (see backward_query_chunk); 0 takes about 2 MiB of their rows.
  Index query_chunk = 0;
};
constexpr FlashBlocks kBackwardBlocks{96, 192};

// Fewer queries than this share too little of a packed head (flash_panels.hpp).
constexpr Index kPanelsMinQueries = 16;

// The code attention_flash runs:
//   small_head  the register kernel of flash_small_head.hpp, for small float heads (D = Dv in
//               {4, 8, 12, 16}, at least kSmallHeadMinQueries queries, no softcap or dropout),
//               whose D-deep products cost more than their arithmetic in tiles (bench/RESULTS.md,
//               2026-12-01);
//   panels      tiles multiplied by the packed GEMM's micro-kernel (packed_gemm.hpp) from a
//               head's keys and values packed once per thread (flash_panels.hpp), the scores'
//               exp fused with their sums: float, where packed_gemm_available(), at least
//               kPanelsMinQueries queries (for a decoding step's few, packing a head would cost
//               as much as reading it), no softcap (whose capped scores add_scores keeps apart);
//   bf16_panels the panels' tiles with both products in bf16 and fp32 sums (flash_bf16.hpp), the
//               softmax in fp32: what options.bf16_products asks for (Precision::bf16), where
//               bf16_dot_available(), on the cases panels takes; small heads keep their kernel,
//               whose time is in the exponentials rather than the products;
//   tiles       tiles of tile_product's products, everywhere else.
// The kernel dispatches on it and the tests assert which path their cases reach.
enum class FlashPath { tiles, small_head, panels, bf16_panels };

// User mods (flex) take the tiles or the panels: the small-head kernel keeps its scores in
// registers, where no mod can reach them.
template <class T, class Stored = T>
FlashPath flash_path(Index head_dim, Index value_dim, Index query_len,
                     const CoreOptions<T>& options, const FlashBlocks& blocks, bool flex = false) {
  if constexpr (std::is_same_v<T, float> && std::is_same_v<Stored, T>) {
    if (!flex && blocks.small_heads && Eigen::internal::packet_traits<float>::Vectorizable &&
        head_dim == value_dim && small_head_kernel_exists(head_dim) &&
        query_len >= kSmallHeadMinQueries && options.softcap == T(0) && !options.dropout.active()) {
      return FlashPath::small_head;
    }
    if (packed_gemm_available() && options.softcap == T(0) && query_len >= kPanelsMinQueries) {
      return options.bf16_products && bf16_dot_available() ? FlashPath::bf16_panels
                                                           : FlashPath::panels;
    }
  }
  return FlashPath::tiles;
}

// The backward's tiles: multiplied by the packed GEMM's micro-kernel from panels packed once per
// head (FlashPath::panels) for float where packed_gemm_available() and without softcap (as the
// forward); on those cases, its five products in bf16 with fp32 sums (FlashPath::bf16_panels,
// flash_bf16.hpp) where options.bf16_products asks for them and bf16_dot_available() (training
// in Precision::bf16 asks where its forward ran the bf16 panels); else by tile_product
// (FlashPath::tiles), which packs both operands of every product.
template <class T>
FlashPath flash_backward_path(const CoreOptions<T>& options) {
  if constexpr (std::is_same_v<T, float>) {
    if (packed_gemm_available() && options.softcap == T(0)) {
      return options.bf16_products && bf16_dot_available() ? FlashPath::bf16_panels
                                                           : FlashPath::panels;
    }
  }
  return FlashPath::tiles;
}

// row[0, cols) <- exp(row - shift) by exp_shifted, a packet at a time (the last one padded with
// -inf, which gives 0); returns their sum, formed lane by lane and then across lanes.
inline float exp_shifted_row(float* row, Index cols, float shift) {
  using Packet = Eigen::internal::packet_traits<float>::type;
  constexpr Index lanes = Eigen::internal::packet_traits<float>::size;
  const Packet shift_packet = Eigen::internal::pset1<Packet>(shift);
  Packet sum = Eigen::internal::pzero(Packet{});
  Index c = 0;
  for (; c + lanes <= cols; c += lanes) {
    const Packet p = exp_shifted(Eigen::internal::ploadu<Packet>(row + c), shift_packet);
    Eigen::internal::pstoreu(row + c, p);
    sum = Eigen::internal::padd(sum, p);
  }
  if (c < cols) {
    float last[lanes];
    std::fill(last, last + lanes, -std::numeric_limits<float>::infinity());
    std::copy(row + c, row + cols, last);
    const Packet p = exp_shifted(Eigen::internal::ploadu<Packet>(last), shift_packet);
    Eigen::internal::pstoreu(last, p);
    std::copy(last, last + (cols - c), row + c);
    sum = Eigen::internal::padd(sum, p);
  }
  return Eigen::internal::predux(sum);
}

// max(row[0, cols)) in four independent chains of packets: Eigen's maxCoeff over a block of
// dynamic size took 3.6 % of the forward at D = 32 (H = 16, E = 512). Like it, a NaN is skipped
// (pmax(a, b) keeps a): the caller looks for NaN where the maximum comes out -inf. Max is exact,
// so the order of the chains cannot change the result (but for the sign of a zero maximum, which
// exp(x - m) does not see).
inline float row_maximum(const float* row, Index cols) {
  using Packet = Eigen::internal::packet_traits<float>::type;
  using Eigen::internal::ploadu;
  using Eigen::internal::pmax;
  constexpr Index lanes = Eigen::internal::packet_traits<float>::size;
  constexpr float kLowest = -std::numeric_limits<float>::infinity();
  Packet m0 = Eigen::internal::pset1<Packet>(kLowest), m1 = m0, m2 = m0, m3 = m0;
  Index c = 0;
  for (; c + 4 * lanes <= cols; c += 4 * lanes) {
    m0 = pmax(m0, ploadu<Packet>(row + c));
    m1 = pmax(m1, ploadu<Packet>(row + c + lanes));
    m2 = pmax(m2, ploadu<Packet>(row + c + 2 * lanes));
    m3 = pmax(m3, ploadu<Packet>(row + c + 3 * lanes));
  }
  for (; c + lanes <= cols; c += lanes) m0 = pmax(m0, ploadu<Packet>(row + c));
  float result = Eigen::internal::predux_max(pmax(pmax(m0, m1), pmax(m2, m3)));
  for (; c < cols; ++c) result = std::max(result, row[c]);
  return result;
}

// Rows j0 .. j0 + count - 1 of one head's keys or values as T: the stored rows themselves, or
// (16-bit storage) their conversion into `tile` ([block, D], sized by the caller).
template <class T, class Head>
auto rows_as(const Head& head, Index j0, Index count, Matrix<T>& tile) {
  if constexpr (std::is_same_v<T, typename Head::Scalar>) {
    return head.middleRows(j0, count);
  } else {
    widen_rows(head.data() + j0 * head.outerStride(), count, head.cols(), head.outerStride(), tile);
    return tile.topRows(count);
  }
}

// The key blocks of at most `block` keys that queries [first_row, last_row] of head (b, h) visit:
// for_each_key_block's (causal masking, the window, the pattern), and with a user's block mask
// (flex) only the runs of its key blocks that it does not hide wholly from those rows, so that a
// band or a document is visited at the block mask's granularity (64 keys) rather than in aligned
// runs of `block`.
template <class T, class Flex, class Visit>
void for_each_visible_key_block(const CoreOptions<T>& options, const Flex& flex, Index b, Index h,
                                Index key_len, Index query_len, Index first_row, Index last_row,
                                Index block, Visit&& visit) {
  if constexpr (Flex::kActive) {
    if (flex.block_mask != nullptr) {
      const Index unit = flex.block_mask->key_block(), rows = last_row - first_row + 1;
      Index run_begin = 0, run_end = 0;
      const auto flush = [&] {
        for (Index j0 = run_begin; j0 < run_end; j0 += block) {
          visit(j0, std::min(block, run_end - j0));
        }
        run_begin = run_end = 0;
      };
      for_each_key_block(
          options, h, key_len, query_len, first_row, last_row, block, [&](Index j0, Index cols) {
            if (j0 >= options.causal_cols) {  // bias_k, zero attention
              flush();
              visit(j0, cols);
              return;
            }
            for (Index c0 = j0, c1 = 0; c0 < j0 + cols; c0 = c1) {
              c1 = std::min(j0 + cols, (c0 / unit + 1) * unit);
              if (flex.cover(b, h, first_row, rows, c0, c1 - c0) == BlockCover::empty) {
                continue;
              }
              if (c0 != run_end || run_end - run_begin + (c1 - c0) > block) {
                flush();
                run_begin = c0;
              }
              run_end = c1;
            }
          });
      flush();
      return;
    }
  }
  for_each_key_block(options, h, key_len, query_len, first_row, last_row, block, visit);
}

// q is (B, H, L, D), k is (B, H, S', D), v is (B, H, S', Dv), out is (B, H, L, Dv), as head
// layouts. The first options.causal_cols keys are the input keys, subject to masks and causal
// masking; the rest (bias_k, zero attention) are visible to every query. logsumexp is null or a
// contiguous (B, H, L) buffer; a row with no visible key gets -inf there.
//
// Keys and values may be stored in a 16-bit type (Stored, a half or bfloat16 KV cache): each key
// block is then converted to T as it is visited, into the thread's key_tile and value_tile, so
// the cache is read once at 2 bytes an element and never copied whole.
//
// flex holds a user's score_mod and block mask (kernels/flex_tile.hpp): a tile its block mask
// hides is skipped before its product; on the input keys' scores, the score_mod sees scale q kᵀ
// (capped by the built-in softcap), the built-in masks and biases are added to what it returns,
// and the block mask's -inf comes last, before the softmax.
template <class T, class Stored = T, class Flex = NoFlex>
void attention_flash(Index batch, Index heads, const HeadLayout<const T>& q,
                     const HeadLayout<const Stored>& k, const HeadLayout<const Stored>& v,
                     const HeadLayout<T>& out, const CoreOptions<T>& options,
                     std::vector<KernelScratch<T>>& scratch, T* logsumexp = nullptr,
                     const FlashBlocks& blocks = {}, const Flex& flex = {}) {
  if constexpr (std::is_same_v<T, float> && std::is_same_v<Stored, T> && !Flex::kActive) {
    if (flash_path<T, Stored>(q.cols, v.cols, q.rows, options, blocks) == FlashPath::small_head) {
      const auto run = [&](auto head_dim) {
        attention_flash_small_head<decltype(head_dim)::value>(batch, heads, q, k, v, out, options,
                                                              scratch, logsumexp);
      };
      switch (q.cols) {
        case 4:
          return run(std::integral_constant<int, 4>{});
        case 8:
          return run(std::integral_constant<int, 8>{});
        case 12:
          return run(std::integral_constant<int, 12>{});
        default:
          return run(std::integral_constant<int, 16>{});
      }
    }
  }
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();
  const Index query_len = q.rows, key_len = k.rows, value_dim = v.cols;
  const Index masked_keys = options.causal_cols;  // keys [masked_keys, key_len) always visible
  const bool any_mask = options.any_mask();
  const Index query_blocks = (query_len + blocks.query - 1) / blocks.query;
  const Index tasks = batch * heads * query_blocks;
  [[maybe_unused]] const double work =
      static_cast<double>(batch * heads) * static_cast<double>(query_len) *
      static_cast<double>(key_len) * static_cast<double>(q.cols + value_dim);

  // Tiles from packed panels (see FlashPath): each thread packs a head's keys and values once for
  // all the query blocks it takes of it.
  constexpr bool kFloat = std::is_same_v<T, float> && std::is_same_v<Stored, float>;
  const FlashPath path =
      flash_path<T, Stored>(q.cols, value_dim, query_len, options, blocks, Flex::kActive);
  const bool bf16 = path == FlashPath::bf16_panels;
  const bool panels = path == FlashPath::panels || bf16;

  // Threads split (batch, head, query block) tasks; each task is computed whole by one thread
  // with the same arithmetic, so results do not depend on the number of threads.
  scratch_for_threads(scratch);
  TaskExceptions<Flex::kActive> task_exceptions;
  MHA_OMP_PRAGMA(omp parallel if (worth_threads(tasks, work))) {
    // This thread's buffers: resized only when the shapes change, never inside the task loop.
    KernelScratch<T>& mine = scratch[static_cast<std::size_t>(thread_index())];
    mine.panels.forget();
    mine.scores.resize(blocks.query, blocks.key);
    if (options.softcap > T(0)) mine.capped.resize(blocks.query, blocks.key);
    if (Flex::kScoreMod && any_mask) mine.flex_masks.resize(blocks.query, blocks.key);
    mine.acc.resize(blocks.query, value_dim);
    mine.row_max.resize(blocks.query);
    mine.row_sum.resize(blocks.query);
    mine.exps.resize(blocks.key);
    if constexpr (!std::is_same_v<T, Stored>) {
      mine.key_tile.resize(blocks.key, k.cols);
      mine.value_tile.resize(blocks.key, value_dim);
    }
    Matrix<T>& tile = mine.scores;
    Matrix<T>& acc = mine.acc;
    Vector<T>& row_max = mine.row_max;
    Vector<T>& row_sum = mine.row_sum;
    RowVector<T>& exps = mine.exps;

    // Causal rows of later blocks see more keys: dynamic scheduling balances them. Where the
    // heads divide evenly between the threads, a thread takes a head's query blocks together and
    // so packs its keys and values alone; taken one block at a time, every head was packed by
    // every thread (at L = 512, D = 32, 5 % of the forward's time; bench/RESULTS.md, 2026-12-06,
    // second session).
    [[maybe_unused]] const int chunk =
        (batch * heads) % team_size() == 0 ? static_cast<int>(query_blocks) : 1;
    MHA_OMP_PRAGMA(omp for schedule(dynamic, chunk))
    for (Index task = 0; task < tasks; ++task) {
      task_exceptions.run([&] {
        const Index b = task / (heads * query_blocks);
        const Index h = (task / query_blocks) % heads;
        const Index i0 = (task % query_blocks) * blocks.query;
        const auto q_bh = q.at(b, h);
        const auto k_bh = k.at(b, h);
        const auto v_bh = v.at(b, h);
        auto out_bh = out.at(b, h);
        const Index rows = std::min(blocks.query, query_len - i0);
        auto acc_blk = acc.topRows(rows);
        acc_blk.setZero();
        row_max.head(rows).setConstant(kNegInf);
        row_sum.head(rows).setZero();
        [[maybe_unused]] const std::uint32_t* bf16_queries = nullptr;
        if constexpr (kFloat) {
          if (bf16) {
            bf16_rows_of(q_bh.data() + i0 * q_bh.outerStride(), rows, q.cols, q_bh.outerStride(),
                         mine.panels.bf16_queries);
            bf16_queries = mine.panels.bf16_queries.data();
          }
        }

        const auto process = [&](Index j0, Index cols) {
          auto s = tile.topLeftCorner(rows, cols);
          [[maybe_unused]] BlockCover cover = BlockCover::full;
          if constexpr (Flex::kActive) {
            if (j0 < masked_keys) cover = flex.cover(b, h, i0, rows, j0, cols);
            if (cover == BlockCover::empty) return;
          }
          // pass 1: masks first, so a block they hide wholly costs no GEMM
          const bool masked_tile = any_mask && j0 < masked_keys;
          // Whether the tile may hold -inf: a mod may block pairs (or return -inf itself).
          bool blocked_pairs = masked_tile;
          // A score_mod sees the scores alone: the masks wait apart and are added after it.
          const bool masks_apart = Flex::kScoreMod && masked_tile;
          auto mask_tile =
              mine.flex_masks.topLeftCorner(masks_apart ? rows : 0, masks_apart ? cols : 0);
          if (masked_tile) {
            if (masks_apart) {
              options.masks(b, h, query_len, i0, j0, mask_tile);
              if ((mask_tile.array() == kNegInf).all()) return;
            } else {
              options.masks(b, h, query_len, i0, j0, s);
              if ((s.array() == kNegInf).all()) return;
            }
          }
          // Whether the product adds to the masks in s or overwrites s.
          const bool onto_masks = masked_tile && !masks_apart;
          if (!onto_masks && !panels) s.setZero();
          if constexpr (kFloat) {
            if (bf16) {
              bf16_scores(mine.panels, bf16_queries, rows, k_bh, j0, cols, options.scale,
                          !onto_masks, s.data(), tile.outerStride());
            } else if (panels) {
              // s = (masks +) scale q kᵀ, the keys' panels from the packed head where the block
              // starts at one of its panels.
              const float* keys = FlashPanels::transposed_block(
                  mine.panels.keys, mine.panels.block_keys, k_bh, j0, cols);
              const LeftOperand queries{q_bh.data() + i0 * q_bh.outerStride(), q_bh.outerStride(),
                                        false};
              multiply_panels(rows, cols, k.cols, queries, keys, k.cols * PackedGemmShape::kNr,
                              options.scale, !onto_masks, s.data(), tile.outerStride(),
                              packed_gemm_buffers().edge);
            }
          }
          if (!panels) {
            options.add_scores(s, q_bh.middleRows(i0, rows),
                               rows_as<T>(k_bh, j0, cols, mine.key_tile), mine.capped);
          }
          if constexpr (Flex::kActive) {
            if (j0 < masked_keys) {
              flex.modify_scores(b, h, i0, j0, s);
              if (masks_apart) s += mask_tile;
              flex.mask(b, h, i0, j0, cover, s);
              blocked_pairs = blocked_pairs || flex.may_block(cover);
            }
          }
          // pass 2: online softmax, one row at a time
          for (Index r = 0; r < rows; ++r) {
            auto score_row = s.row(r);
            T block_max;
            if constexpr (kFloat) {
              block_max = panels ? row_maximum(score_row.data(), cols) : score_row.maxCoeff();
            } else {
              block_max = score_row.maxCoeff();
            }
            if (block_max == kNegInf) {  // nothing visible in this block for this row
              // ... unless the maximum skipped a NaN, which Eigen's may (its PropagateNaN maximum
              // costs 7% of the kernel): a NaN score must reach the output.
              if (score_row.hasNaN()) row_sum(r) = std::numeric_limits<T>::quiet_NaN();
              score_row.setZero();
              continue;
            }
            if (block_max > row_max(r)) {
              // exp(-inf) is 0: a row's first visible block just starts the sums.
              const T correction = row_max(r) == kNegInf ? T(0) : std::exp(row_max(r) - block_max);
              row_sum(r) *= correction;
              acc_blk.row(r) *= correction;
              row_max(r) = block_max;
            }
            if constexpr (kFloat) {
              if (panels) {
                // exp_shifted (flash_small_head.hpp), fused with the row sum: -inf gives 0.
                row_sum(r) += exp_shifted_row(score_row.data(), cols, row_max(r));
                continue;
              }
            }
            if (blocked_pairs) {
              row_sum(r) += exp_shifted_inplace(score_row, row_max(r), exps);
            } else {
              // No -inf in an unmasked tile: exp in place, two passes instead of five.
              score_row.array() = (score_row.array() - row_max(r)).exp();
              row_sum(r) += score_row.sum();
            }
          }
          if (options.dropout.active()) options.dropout.apply(b, h, i0, j0, s);
          if constexpr (kFloat) {
            if (bf16) {
              bf16_accumulate_values(mine.panels, s.data(), tile.outerStride(), rows, cols, v_bh,
                                     j0, acc_blk.data(), acc.outerStride());
              return;
            }
            if (panels) {
              // acc += p v, the values' rows j0 .. of each packed panel: the tile's keys are the
              // product's depth.
              const float* values = mine.panels.values.rows(v_bh) + j0 * PackedGemmShape::kNr;
              // NOLINTNEXTLINE(readability-suspicious-call-argument)
              multiply_panels(rows, value_dim, cols,
                              LeftOperand{s.data(), tile.outerStride(), false}, values,
                              PanelBuffer::row_panel_stride(v_bh), 1.0F, false, acc_blk.data(),
                              acc.outerStride(), packed_gemm_buffers().edge);
              return;
            }
          }
          tile_product<T>(strided(acc_blk), const_strided(s), Operand::as_stored,
                          const_strided(rows_as<T>(v_bh, j0, cols, mine.value_tile)),
                          Operand::as_stored, Accumulate::yes);
        };
        for_each_visible_key_block(options, flex, b, h, key_len, query_len, i0, i0 + rows - 1,
                                   blocks.key, process);

        // One division per row at the end; a row with no visible key stays 0. A NaN sum (from a
        // NaN score) divides, so that the NaN reaches the output as the reference kernel's does.
        for (Index r = 0; r < rows; ++r) {
          auto out_row = out_bh.row(i0 + r);
          if (row_sum(r) != T(0)) {
            out_row.noalias() = acc_blk.row(r) / row_sum(r);
          } else {
            out_row.setZero();
          }
        }
        if (logsumexp != nullptr) {
          T* lse = logsumexp + (b * heads + h) * query_len + i0;
          for (Index r = 0; r < rows; ++r) {
            lse[r] = row_sum(r) != T(0) ? row_max(r) + std::log(row_sum(r)) : kNegInf;
          }
        }
      });
    }
  }
  task_exceptions.rethrow();
}

// The backward of attention_flash, FlashAttention-2's algorithm: no [L, S'] matrix is stored;
// each [Bq, Bk] tile of P is recomputed from the saved log-sum-exp, P = exp(S - lse), and
//   dV_j += Pdᵀ dO_i,   dP = (dO_i V_jᵀ) ∘ Z,   dS = P ∘ (dP - rowdot_i)
//   dQ_i += scale dS K_j,   dK_j += scale dSᵀ Q_i
// where rowdot_i = rowsum(dO_i ∘ O_i), which equals rowsum(P ∘ dP) (see the reference backward)
// and Z is dropout's mask. out is the forward's output, grad_out is (B, H, L, Dv), logsumexp the
// forward's (B, H, L); grad_q, grad_k, grad_v have the layouts of q, k, v and are overwritten.
// A task is one (batch, head), or under grouped-query attention one stored key/value head and
// the query heads that read it; its key blocks outer (dK_j and dV_j stay in cache) and its query
// blocks inner. One thread owns all of a task's gradients, so there are no write races and the
// result does not depend on the number of threads. (FlashAttention splits a head over key blocks
// and adds dQ atomically; with H·B tasks for two cores, one per head suffices.)
// The backward's query chunk: every key block of a head reads the rows of its queries, output
// gradients, their packed panels and dQ (3·D + 2·Dv elements a query), so the key blocks take the
// queries a chunk of about 2 MiB of those rows at a time, which stays in the last-level cache
// as L grows. At L = 4096 and 8192, D = 64 (5 and 10 MiB of them a head) the backward took
// 0.90-0.92 of the time in chunks that it took over all the queries at once, 0.70-0.72 of the FMA
// peak against 0.64 (bench/RESULTS.md, 2026-12-04). A whole number of query blocks, so the tiles
// stay the same.
template <class T>
Index backward_query_chunk(Index head_dim, Index value_dim, Index query_block) {
  constexpr Index kChunkBytes = Index{2} << 20;
  const Index row_bytes = static_cast<Index>(sizeof(T)) * (3 * head_dim + 2 * value_dim);
  return std::max<Index>(1, kChunkBytes / std::max<Index>(1, row_bytes) / query_block) *
         query_block;
}

// With user mods (flex, as the forward's), the score_mod is called with Dual numbers to give each
// score's derivative, by which dS is multiplied on its way to dQ and dK.
template <class T, class Flex = NoFlex>
void attention_flash_backward(Index batch, Index heads, const HeadLayout<const T>& q,
                              const HeadLayout<const T>& k, const HeadLayout<const T>& v,
                              const HeadLayout<const T>& out, const HeadLayout<const T>& grad_out,
                              const T* logsumexp, const HeadLayout<T>& grad_q,
                              const HeadLayout<T>& grad_k, const HeadLayout<T>& grad_v,
                              const CoreOptions<T>& options, std::vector<KernelScratch<T>>& scratch,
                              const FlashBlocks& blocks = kBackwardBlocks, const Flex& flex = {}) {
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();
  const Index query_len = q.rows, key_len = k.rows;
  const Index masked_keys = options.causal_cols;
  const bool any_mask = options.any_mask();
  const Index group = k.group, tasks = batch * (heads / group);
  [[maybe_unused]] const double work =
      2.0 * static_cast<double>(batch * heads) * static_cast<double>(query_len) *
      static_cast<double>(key_len) * static_cast<double>(q.cols + v.cols);
  constexpr bool kFloat = std::is_same_v<T, float>;
  [[maybe_unused]] constexpr Index nr = PackedGemmShape::kNr;
  const FlashPath path = flash_backward_path(options);
  const bool bf16 = path == FlashPath::bf16_panels;
  const bool panels = path == FlashPath::panels || bf16;
  const Index query_chunk = blocks.query_chunk > 0
                                ? blocks.query_chunk
                                : backward_query_chunk<T>(q.cols, v.cols, blocks.query);
  scratch_for_threads(scratch);
  TaskExceptions<Flex::kActive> task_exceptions;
  MHA_OMP_PRAGMA(omp parallel if (worth_threads(tasks, work))) {
    KernelScratch<T>& mine = scratch[static_cast<std::size_t>(thread_index())];
    mine.panels.forget();
    mine.scores.resize(blocks.query, blocks.key);
    mine.grad_scores.resize(blocks.query, blocks.key);
    if (options.softcap > T(0)) mine.capped.resize(blocks.query, blocks.key);
    if (Flex::kScoreMod) mine.mod_derivatives.resize(blocks.query, blocks.key);
    if (Flex::kParameters) mine.mod_inputs.resize(blocks.query, blocks.key);
    if (Flex::kScoreMod && any_mask) mine.flex_masks.resize(blocks.query, blocks.key);
    mine.acc.resize(blocks.query, blocks.key);  // the dropped-out tile Pd
    mine.exps.resize(blocks.key);
    mine.row_dot.resize(query_len);
    MHA_OMP_PRAGMA(omp for schedule(dynamic))
    for (Index task = 0; task < tasks; ++task) {
      task_exceptions.run([&] {
        const Index b = task / (heads / group), first_head = (task % (heads / group)) * group;
        const auto k_bh = k.at(b, first_head);
        const auto v_bh = v.at(b, first_head);
        auto grad_k_bh = grad_k.at(b, first_head);
        auto grad_v_bh = grad_v.at(b, first_head);
        grad_k_bh.setZero();
        grad_v_bh.setZero();
        for (Index h = first_head; h < first_head + group; ++h) {
          const auto q_bh = q.at(b, h);
          const auto grad_out_bh = grad_out.at(b, h);
          auto grad_q_bh = grad_q.at(b, h);
          const T* lse = logsumexp + (b * heads + h) * query_len;
          mine.row_dot = (grad_out_bh.array() * out.at(b, h).array()).rowwise().sum().matrix();
          grad_q_bh.setZero();
          Index chunk_begin = 0, chunk_end = 0;

          const auto key_block = [&](Index j0, Index cols) {
            const auto k_blk = k_bh.middleRows(j0, cols);
            const auto v_blk = v_bh.middleRows(j0, cols);
            auto grad_k_blk = grad_k_bh.middleRows(j0, cols);
            auto grad_v_blk = grad_v_bh.middleRows(j0, cols);
            for (Index i0 = chunk_begin; i0 < chunk_end; i0 += blocks.query) {
              const Index rows = std::min(blocks.query, chunk_end - i0);
              const bool masked_tile = any_mask && j0 < masked_keys;
              if (masked_tile && !options.may_see(h, query_len, i0, i0 + rows - 1, j0, j0 + cols)) {
                continue;  // causal masking, the window or the pattern hides this block
              }
              const bool flex_tile = Flex::kActive && j0 < masked_keys;
              [[maybe_unused]] BlockCover cover = BlockCover::full;
              if constexpr (Flex::kActive) {
                if (flex_tile) cover = flex.cover(b, h, i0, rows, j0, cols);
                if (cover == BlockCover::empty) continue;
              }
              auto probs = mine.scores.topLeftCorner(rows, cols);
              // As the forward: a score_mod sees the scores alone, the masks are added after it.
              const bool masks_apart = Flex::kScoreMod && masked_tile;
              auto mask_tile =
                  mine.flex_masks.topLeftCorner(masks_apart ? rows : 0, masks_apart ? cols : 0);
              if (masked_tile) {
                auto& masks = masks_apart ? mask_tile : probs;
                options.masks(b, h, query_len, i0, j0, masks);
                if ((masks.array() == kNegInf).all()) continue;
              }
              const bool onto_masks = masked_tile && !masks_apart;
              if (!onto_masks && !panels) probs.setZero();
              const auto q_blk = q_bh.middleRows(i0, rows);
              const auto grad_out_blk = grad_out_bh.middleRows(i0, rows);
              auto grad_scores = mine.grad_scores.topLeftCorner(rows, cols);
              const Index probs_ld = mine.scores.outerStride(),
                          grad_ld = mine.grad_scores.outerStride();
              float* const edge = packed_gemm_buffers().edge;
              // S (+ masks) = scale q kᵀ; dP = dO vᵀ.
              [[maybe_unused]] FlashPanels& packed = mine.panels;
              if constexpr (kFloat) {
                if (bf16) {
                  bf16_rows_of(q_blk.data(), rows, k.cols, q_blk.outerStride(),
                               packed.bf16_queries);
                  bf16_scores(packed, packed.bf16_queries.data(), rows, k_bh, j0, cols,
                              options.scale, !onto_masks, probs.data(), probs_ld);
                  bf16_rows_of(grad_out_blk.data(), rows, v.cols, grad_out_blk.outerStride(),
                               packed.bf16_grad_out);
                  bf16_product_transposed(packed.bf16_values_transposed,
                                          packed.bf16_block_transposed, packed.bf16_grad_out.data(),
                                          rows, v_bh, j0, cols, 1.0F, true, grad_scores.data(),
                                          grad_ld);
                } else if (panels) {
                  const float* keys = FlashPanels::transposed_block(
                      mine.panels.keys, mine.panels.block_keys, k_bh, j0, cols);
                  multiply_panels(
                      rows, cols, k.cols, LeftOperand{q_blk.data(), q_blk.outerStride(), false},
                      keys, k.cols * nr, options.scale, !onto_masks, probs.data(), probs_ld, edge);
                  const float* values = FlashPanels::transposed_block(
                      mine.panels.values_transposed, mine.panels.block_values, v_bh, j0, cols);
                  multiply_panels(
                      rows, cols, v.cols,
                      LeftOperand{grad_out_blk.data(), grad_out_blk.outerStride(), false}, values,
                      v.cols * nr, 1.0F, true, grad_scores.data(), grad_ld, edge);
                }
              }
              if (!panels) {
                options.add_scores(probs, q_blk, k_blk, mine.capped);
                tile_product<T>(strided(grad_scores), const_strided(grad_out_blk),
                                Operand::as_stored, const_strided(v_blk), Operand::transposed,
                                Accumulate::no);
              }
              // (Sized only with a score_mod, and with learned parameters: empty otherwise.)
              [[maybe_unused]] auto mod_derivatives = mine.mod_derivatives.topLeftCorner(
                  Flex::kScoreMod ? rows : 0, Flex::kScoreMod ? cols : 0);
              [[maybe_unused]] auto mod_inputs = mine.mod_inputs.topLeftCorner(
                  Flex::kParameters ? rows : 0, Flex::kParameters ? cols : 0);
              if constexpr (Flex::kActive) {
                if (flex_tile) {
                  if constexpr (Flex::kScoreMod) {
                    flex.differentiate_scores(b, h, i0, j0, probs, mod_derivatives, mod_inputs);
                  }
                  if (masks_apart) probs += mask_tile;
                  flex.mask(b, h, i0, j0, cover, probs);
                }
              }
              // P = exp(S - lse), exactly 0 where blocked and in rows that saw no key
              for (Index r = 0; r < rows; ++r) {
                auto row = probs.row(r);
                if (lse[i0 + r] == kNegInf) {
                  row.setZero();
                } else if (masked_tile || (flex_tile && flex.may_block(cover))) {
                  exp_shifted_inplace(row, lse[i0 + r], mine.exps);
                } else {
                  row.array() = (row.array() - lse[i0 + r]).exp();
                }
              }
              // dV += Pdᵀ dO, with Pd the tile dropout leaves (P itself without dropout).
              auto dropped = mine.acc.topLeftCorner(rows, cols);
              if (options.dropout.active()) {
                dropped = probs;
                options.dropout.apply(b, h, i0, j0, dropped);
                options.dropout.apply(b, h, i0, j0, grad_scores);
              }
              const bool dropout = options.dropout.active();
              if constexpr (kFloat) {
                const float* kept = dropout ? dropped.data() : probs.data();
                const Index kept_ld = dropout ? mine.acc.outerStride() : probs_ld;
                if (bf16) {
                  bf16_accumulate_transposed_product(
                      kept, kept_ld, rows, cols, packed.bf16_grad_out_rows, packed.bf16_block_rows,
                      grad_out_bh, i0, 1.0F, packed, grad_v_blk.data(), grad_v_blk.outerStride());
                } else if (panels) {
                  const float* grad_out_rows = mine.panels.grad_out.rows(grad_out_bh) + i0 * nr;
                  // Pᵀ and dSᵀ: the tile's keys are the product's rows, its queries the depth.
                  // NOLINTNEXTLINE(readability-suspicious-call-argument)
                  multiply_panels(cols, v.cols, rows, LeftOperand{kept, 1, false, kept_ld},
                                  grad_out_rows, PanelBuffer::row_panel_stride(grad_out_bh), 1.0F,
                                  false, grad_v_blk.data(), grad_v_blk.outerStride(), edge);
                }
              }
              if (!panels) {
                tile_product<T>(strided(grad_v_blk),
                                dropout ? const_strided(dropped) : const_strided(probs),
                                Operand::transposed, const_strided(grad_out_blk),
                                Operand::as_stored, Accumulate::yes);
              }
              grad_scores.array() = probs.array() * (grad_scores.array().colwise() -
                                                     mine.row_dot.segment(i0, rows).array());
              if constexpr (Flex::kParameters) {
                if (flex_tile)
                  flex.accumulate_parameters(task, b, h, i0, j0, grad_scores, mod_inputs);
              }
              options.softcap_backward(grad_scores, mine.capped);
              if constexpr (Flex::kScoreMod) {
                if (flex_tile) grad_scores.array() *= mod_derivatives.array();
              }
              // dQ += scale dS k; dK += scale dSᵀ q.
              auto grad_q_blk = grad_q_bh.middleRows(i0, rows);
              if constexpr (kFloat) {
                if (bf16) {
                  bf16_accumulate_product(grad_scores.data(), grad_ld, rows, cols,
                                          packed.bf16_key_rows, packed.bf16_block_rows, k_bh, j0,
                                          options.scale, packed.bf16_probabilities,
                                          grad_q_blk.data(), grad_q_blk.outerStride());
                  bf16_accumulate_transposed_product(grad_scores.data(), grad_ld, rows, cols,
                                                     packed.bf16_query_rows, packed.bf16_block_rows,
                                                     q_bh, i0, options.scale, packed,
                                                     grad_k_blk.data(), grad_k_blk.outerStride());
                } else if (panels) {
                  const float* key_rows = mine.panels.key_rows.rows(k_bh) + j0 * nr;
                  multiply_panels(rows, k.cols, cols,
                                  LeftOperand{grad_scores.data(), grad_ld, false}, key_rows,
                                  PanelBuffer::row_panel_stride(k_bh), options.scale, false,
                                  grad_q_blk.data(), grad_q_blk.outerStride(), edge);
                  const float* query_rows = mine.panels.queries.rows(q_bh) + i0 * nr;
                  // NOLINTNEXTLINE(readability-suspicious-call-argument)
                  multiply_panels(cols, k.cols, rows,
                                  LeftOperand{grad_scores.data(), 1, false, grad_ld}, query_rows,
                                  PanelBuffer::row_panel_stride(q_bh), options.scale, false,
                                  grad_k_blk.data(), grad_k_blk.outerStride(), edge);
                }
              }
              if (!panels) {
                tile_product<T>(strided(grad_q_blk), const_strided(grad_scores), Operand::as_stored,
                                const_strided(k_blk), Operand::as_stored, Accumulate::yes,
                                options.scale);
                tile_product<T>(strided(grad_k_blk), const_strided(grad_scores),
                                Operand::transposed, const_strided(q_blk), Operand::as_stored,
                                Accumulate::yes, options.scale);
              }
            }
          };
          // Every chunk visits the key blocks of the whole query range, so that each dQ and dK
          // element sums the same tiles in the same order as one pass over all the queries would.
          for (chunk_begin = 0; chunk_begin < query_len; chunk_begin = chunk_end) {
            chunk_end = std::min(query_len, chunk_begin + query_chunk);
            for_each_key_block(options, h, key_len, query_len, 0, query_len - 1, blocks.key,
                               key_block);
          }
        }
      });
    }
  }
  task_exceptions.rethrow();
}

// The instantiations mha::compiled holds (src/kernels_flash_*.cpp; see mha/compiled.hpp).
// NOLINTBEGIN(bugprone-macro-parentheses): the arguments are a type and a keyword
#define MHA_FLASH_KERNEL_TEMPLATES(PREFIX, T)                                             \
  PREFIX template void attention_flash<T, T>(                                             \
      Index, Index, const HeadLayout<const T>&, const HeadLayout<const T>&,               \
      const HeadLayout<const T>&, const HeadLayout<T>&, const CoreOptions<T>&,            \
      std::vector<KernelScratch<T>>&, T*, const FlashBlocks&, const NoFlex&);             \
  PREFIX template void attention_flash_backward<T>(                                       \
      Index, Index, const HeadLayout<const T>&, const HeadLayout<const T>&,               \
      const HeadLayout<const T>&, const HeadLayout<const T>&, const HeadLayout<const T>&, \
      const T*, const HeadLayout<T>&, const HeadLayout<T>&, const HeadLayout<T>&,         \
      const CoreOptions<T>&, std::vector<KernelScratch<T>>&, const FlashBlocks&, const NoFlex&);
// NOLINTEND(bugprone-macro-parentheses)
// NOLINTBEGIN(bugprone-macro-parentheses): the arguments are a type and a keyword
#define MHA_STORED_FLASH_KERNEL_TEMPLATES(PREFIX, Stored)                                   \
  PREFIX template void attention_flash<float, Stored>(                                      \
      Index, Index, const HeadLayout<const float>&, const HeadLayout<const Stored>&,        \
      const HeadLayout<const Stored>&, const HeadLayout<float>&, const CoreOptions<float>&, \
      std::vector<KernelScratch<float>>&, float*, const FlashBlocks&, const NoFlex&);
// NOLINTEND(bugprone-macro-parentheses)
MHA_EXTERN_TEMPLATES(MHA_COMPUTE_TYPES, MHA_FLASH_KERNEL_TEMPLATES)
MHA_EXTERN_TEMPLATES(MHA_STORED_16BIT_TYPES, MHA_STORED_FLASH_KERNEL_TEMPLATES)

}  // namespace mha::detail
