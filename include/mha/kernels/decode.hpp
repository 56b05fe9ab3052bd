// The decoding kernel: one step's attention for a whole batch of cached sequences in one parallel
// pass. Sequence b brings n_b new queries (one token, or a few: a draft to verify) and attends to
// its S_b cached keys and values, bottom-right aligned.
//
// The work is cut into tasks of (sequence, chunk of kDecodeChunk cached keys), every key/value
// head of the chunk in one task. A task reads the chunk's keys and then its values once, a
// sub-block of whole cache rows at a time, and each key/value head's G = H / H_kv query heads
// (grouped-query attention), each with the sequence's n_b queries, use its part while it is in
// cache: H·n_b rows. For each row the task leaves the chunk's partial softmax state: the largest
// score m, l = Σ exp(s - m), and acc = Σ exp(s - m) v, not yet divided. A second pass merges each
// row's chunks in order (flash-decoding's log-sum-exp merge):
//   M = max_c m_c,   l = Σ_c l_c exp(m_c - M),   out = Σ_c acc_c exp(m_c - M) / l.
// Chunks start at fixed multiples of kDecodeChunk keys whatever the thread count: one long
// sequence still keeps every thread busy, and each task and each merge is computed by one thread
// with the same arithmetic, so results do not depend on the number of threads.
//
// Shapes: sequence b's queries are [n_b, H·D] and its output [n_b, H·Dv], rows query_stride and
// out_stride apart; its keys [S_b, H_kv·D] and values [S_b, H_kv·Dv] (Stored: float, or a 16-bit
// cache's half or bfloat16, or a quantized cache's blocks, widened as a sub-block is read), rows
// kv_stride elements (blocks) apart, in one buffer or, for a paged cache (paged_kv_cache.hpp), in
// pages of a pool that the sequence's page table names (DecodeSequence); query head h reads
// key/value head h / G.
//
// User mods (flex_layer.hpp's flex_decode; Flex as the flash kernel's, kernels/flex_tile.hpp) see
// sequence b of the step as batch element b and its query i as row S_b - n_b + i of its cache
// (q_idx), the keys as rows of the cache (kv_idx). A chunk that no row sees (a window's, or a
// block mask's empty blocks) is not read.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "mha/kernels/common.hpp"
#include "mha/kernels/convert.hpp"
#include "mha/kernels/decode_avx2.hpp"
#include "mha/kernels/decode_products.hpp"
#include "mha/kernels/decode_q4.hpp"
#include "mha/kernels/flash.hpp"
#include "mha/kernels/flex_tile.hpp"
#include "mha/kernels/quantized_cache.hpp"

namespace mha::detail {

// Cached keys per task: a context of 2048 is 8 chunks, so that even one sequence keeps the
// threads busy; each chunk's partial states cost 1/256 of what it reads.
constexpr Index kDecodeChunk = 240;
// Keys per sub-block, read for every key/value head while they are in L2: whole cache rows (8 KiB
// at H_kv·D = 2048), where one head's rows alone are 512-byte pieces a row apart, each in a page
// of its own, which the hardware's prefetchers (stopping at page boundaries) do not stream:
// measured 11 GB/s reading one head's rows at a time against 20 by sub-blocks of whole rows, on
// two cores that read 17 GB/s in one stream (bench/RESULTS.md, 2026-12-02). Four row panels of
// the packed GEMM (4·kMr keys); more keys a sub-block where rows are narrow (H_kv = 1 and 4:
// 48 KiB of them) measured no faster on Zen 5 (2026-12-02, fourth session).
constexpr Index kDecodeSubBlock = 4 * PackedGemmShape::kMr;
// The register blocks' sub-blocks (decode_path's blocks, groups of two or more rows): 8 keys,
// each block requesting the next 8 keys' lines as it multiplies. Against 24, with groups of 4
// and 16 rows: 0.75-0.82 of the time at five of six sizes of 16384 cached tokens, no faster at
// 2048 (minima of alternated runs, bench/RESULTS.md 2026-12-03).
constexpr Index kDecodeBlocksSubBlock = 8;
// Fewer rows per key/value head than this (a query head per key/value head, decoding one token)
// take dot products: the micro-kernel's 6-row tile would be mostly padding.
constexpr Index kDecodePanelsMinRows = 8;
// From this many rows per key/value head (16 query heads sharing one, decoding a token), the
// scores take rows as lanes (decode_path's lanes), which leave at most a quarter of their lanes
// empty here.
constexpr Index kDecodeLanesMinRows = 12;

// A paged cache's pages hold a multiple of this many rows, so that no sub-block of keys or values
// (kDecodeBlocksSubBlock, kQ4SubBlock, kDecodeSubBlock) spans two pages: a sequence's keys are cut
// into the same sub-blocks whether its rows lie in pages or in one buffer, and its step gives the
// same bits. (The lanes' P·V over a whole chunk, which pages do cut, continues its sums across
// the cut, from acc.)
constexpr Index kDecodePageGrain = 48;
static_assert(kDecodeChunk % kDecodePageGrain == 0 && kDecodePageGrain % kDecodeSubBlock == 0 &&
                  kDecodePageGrain % kDecodeBlocksSubBlock == 0 &&
                  kDecodePageGrain % kQ4SubBlock == 0,
              "sub-blocks must not span pages");

template <class Stored>
struct DecodeSequence {
  const float* queries = nullptr;  // [n, H·D]
  float* out = nullptr;            // [n, H·Dv]
  const Stored* keys = nullptr;    // [S, H_kv·D]
  const Stored* values = nullptr;  // [S, H_kv·Dv]
  Index query_count = 0;           // n, 0 for a sequence that sits this step out
  Index key_count = 0;             // S, the new tokens' keys included
  // A paged cache's sequence: keys and values are its pool's first rows, and the sequence's row j
  // is the pool's row page_table[j / page_rows] · page_rows + j % page_rows; page_rows a multiple
  // of kDecodePageGrain. 0: the sequence's rows in order from keys and values.
  const Index* page_table = nullptr;
  Index page_rows = 0;
  Index batch_index = 0;  // the sequence's place in its step: user mods' b (flex_layer.hpp)

  // Key (value) row j, rows `stride` elements (blocks) apart.
  const Stored* key_row(Index j, Index stride) const { return keys + pool_row(j) * stride; }
  const Stored* value_row(Index j, Index stride) const { return values + pool_row(j) * stride; }
  // Rows from row j to the end of its page (or of the buffer: any number).
  Index rows_in_page(Index j) const {
    return page_rows > 0 ? page_rows - j % page_rows : std::numeric_limits<Index>::max();
  }

 private:
  Index pool_row(Index j) const {
    return page_rows > 0 ? page_table[j / page_rows] * page_rows + j % page_rows : j;
  }
};

struct DecodeShape {
  Index heads = 0, kv_heads = 0, head_dim = 0, value_dim = 0;
  Index query_stride = 0, out_stride = 0, kv_stride = 0;
  Index group() const { return heads / kv_heads; }
};

// The buffers of one decoding step that outlive its parallel region: each task's partial states
// and where each sequence's tasks and partials begin. Kept by the KV cache, so steps of the same
// shapes allocate nothing.
struct DecodeScratch {
  std::vector<float> partials;
  std::vector<Index> task_begin, partial_begin;
};

// What the decoding kernel computes of CoreOptions: causal masking, the window (any dilation),
// ALiBi and softcap. Patterns and talking heads (and the reference kernel's semantics, when asked
// for) take attention() one sequence at a time.
inline bool decode_kernel_applies(const CoreOptions<float>& options) {
  return !options.pattern.active() && !options.talking_heads.active() &&
         !options.dropout.active() && options.attn_mask.kind == MaskKind::none &&
         options.key_padding_mask.kind == MaskKind::none;
}

// How a task multiplies each key/value head's G·n rows by its cached keys and values
// (decode_task):
//   lanes   many rows (kDecodeLanesMinRows or more) with AVX-512, D and Dv multiples of 16: the
//           scores with the rows as lanes (decode_products.hpp's scaled_dot_lanes), P·V by the
//           register blocks over a whole chunk (a float cache) at once, keeping their sums in
//           registers: these rows' arithmetic, not the cache's bytes, bounds the step;
//   blocks  decode_products.hpp's AVX-512 register blocks: two or more rows, D and Dv multiples
//           of 16; and every quantized cache's rows with AVX-512 (decode_q4.hpp's products over
//           q4 where they run); with AVX2 alone, decode_avx2.hpp's register blocks, for heads of
//           whole blocks (D and Dv multiples of 32): every row count of a quantized cache, and
//           two to kDecodePanelsMinRows - 1 rows of a float or 16-bit one;
//   panels  the packed GEMM's micro-kernel, where it runs (AVX2 and FMA) and the AVX-512 blocks
//           do not: kDecodePanelsMinRows rows or more, value rows of whole panels (on Zen 3,
//           sixteen rows in L3 took 0.78 of the time they took by decode_avx2.hpp's blocks);
//   dots    dot products and weighted sums a row at a time, elsewhere: among others one row (a
//           query head per key/value head, decoding one token), which reading the cache bounds;
//           there the cache's rows are read whole, head after head (scaled_dots_by_rows), which
//           took 0.70-0.88 of the time of a head's slices through a sub-block at a time (Zen 4,
//           B = 1-32, H_kv = 16, bench/RESULTS.md 2026-12-06, third session).
// The tests assert which path their cases take.
enum class DecodePath { dots, panels, blocks, lanes };

inline DecodePath decode_path(const DecodeShape& shape, Index query_count) {
  const Index rows = shape.group() * query_count;
  if (rows > 1 && value_blocks_available(shape.head_dim, shape.value_dim)) {
    return rows >= kDecodeLanesMinRows && query_lanes_available() ? DecodePath::lanes
                                                                  : DecodePath::blocks;
  }
  const bool panels = packed_gemm_available() && rows >= kDecodePanelsMinRows &&
                      shape.value_dim % PackedGemmShape::kNr == 0;
  if (panels) return DecodePath::panels;
  if (rows > 1 && decode_blocks_avx2_available(shape.head_dim, shape.value_dim)) {
    return DecodePath::blocks;
  }
  return DecodePath::dots;
}

// A row's partial state in a task's partials: m, l, then acc [Dv].
constexpr Index kPartialHeader = 2;

// One task: every row of sequence `seq` (query head h, query i: row r = h·n + i) against its
// keys [c0, c0 + cols) of every key/value head. partial is [H·n, 2 + Dv].
//
// A key/value head's rows (G·n of them) multiply its keys and values as the cache holds them:
// with AVX-512, by decode_products.hpp's register blocks; elsewhere, by the packed GEMM's
// micro-kernel where there are enough rows (decode_panels: scoresᵀ = K Qᵀ, the cache's key rows
// multiplying the group's queries packed once per task, since packing the keys instead would
// transpose each of them; and acc += P V, the probabilities' rows multiplying the cache's value
// rows as they are), and otherwise by dot products and weighted sums a row at a time.
template <class Stored, class Flex>
void decode_task(const DecodeSequence<Stored>& seq, Index b, const DecodeShape& shape, Index c0,
                 Index cols, const CoreOptions<float>& options, const Flex& flex,
                 KernelScratch<float>& mine, float* partial) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  using S = PackedGemmShape;
  const Index n = seq.query_count, rows = shape.heads * n;
  const Index group_rows = shape.group() * n;  // key/value head g's: [g·group_rows, +group_rows)
  const Index depth = shape.head_dim, value_dim = shape.value_dim;
  const Index partial_width = kPartialHeader + value_dim;
  // A quantized cache with AVX-512: the register blocks for every row count, reading its codes
  // (QuantizedRows) and widening them in registers; elsewhere the tile path below.
  bool fused = false;
#ifdef MHA_PACKED_GEMM_X86
  fused = is_quantized_block_v<Stored> && value_blocks_available(depth, value_dim);
#endif
  // With AVX2 but not AVX-512: decode_avx2.hpp's register blocks.
  const bool fused_avx2 =
      is_quantized_block_v<Stored> && decode_blocks_avx2_available(depth, value_dim);
  fused = fused || fused_avx2;
  // ... and over a q4 cache, int8 queries (q4_dot_rows_avx2).
  const bool q4_avx2 = std::is_same_v<Stored, Q4Block> && fused_avx2;
  // A q4 cache, with VNNI and heads of whole blocks: decode_q4.hpp's products (int8 queries).
  const bool q4 = std::is_same_v<Stored, Q4Block> && q4_products_available(depth, value_dim);
  const DecodePath path = fused ? DecodePath::blocks : decode_path(shape, n);
  const bool lanes = path == DecodePath::lanes, panels = path == DecodePath::panels;
  const bool blocks = path == DecodePath::blocks || lanes;  // P·V by the register blocks
  // A float cache's rows (or a 16-bit one's, widened into the tiles) by decode_avx2.hpp's blocks.
  const bool float_blocks_avx2 = blocks && !fused && decode_blocks_avx2_available(depth, value_dim);
  // One row per key/value head: the cache's rows read whole, head after head
  // (scaled_dots_by_rows).
  const bool by_rows = path == DecodePath::dots && group_rows == 1;
  // Keys a sub-block in pass 1 and values in pass 3 (see kDecodeBlocksSubBlock). The lanes' P·V
  // takes the chunk's values at once where the cache is float (a 16-bit one is widened a
  // sub-block at a time into the key and value tiles): its sums then stay in registers over all
  // of them.
  const Index key_sub = q4 ? kQ4SubBlock : blocks ? kDecodeBlocksSubBlock : kDecodeSubBlock;
  const Index value_sub = lanes && std::is_same_v<Stored, float> ? kDecodeChunk : key_sub;
  const Index query_panels = packed_width(group_rows);
  const Index tile_rows = (group_rows + S::kMr - 1) / S::kMr * S::kMr;
  Matrix<float>& scores = mine.scores;    // [H·n + kMr, kDecodeChunk]
  Matrix<float>& queries = mine.queries;  // [H·n, D], rows in r order
  for (Index r = 0; r < rows; ++r) {
    const float* q = seq.queries + (r % n) * shape.query_stride + (r / n) * depth;
    std::copy(q, q + depth, queries.data() + r * depth);
  }
  // (q4: each row's int8 codes, q4_query_row_bytes apart, in packed_queries' bytes.)
  auto* const q4_queries = reinterpret_cast<std::int8_t*>(mine.packed_queries.data());
  const Index q4_row_bytes = q4_query_row_bytes(depth);
  const Index q4_row_bytes_avx2 = q4_query_row_bytes_avx2(depth);
  if (q4) {
#ifdef MHA_PACKED_GEMM_X86
    for (Index r = 0; r < rows; ++r) {
      prepare_q4_query(queries.data() + r * depth, depth, q4_queries + r * q4_row_bytes);
    }
#else
    arguments_unused(q4_queries, q4_row_bytes);  // (q4 is false there)
#endif
  } else if (q4_avx2) {
    for (Index r = 0; r < rows; ++r) {
      prepare_q4_query_avx2(queries.data() + r * depth, depth, q4_queries + r * q4_row_bytes_avx2);
    }
  } else if (lanes) {
    for (Index g = 0; g < shape.kv_heads; ++g) {
      prepare_query_lanes(queries.data() + g * group_rows * depth, depth, group_rows, depth,
                          mine.packed_queries.data() + g * query_panels * depth);
    }
  } else if (blocks && !float_blocks_avx2) {
    for (Index g = 0; g < shape.kv_heads; ++g) {
      prepare_query_rows(queries.data() + g * group_rows * depth, depth, group_rows, depth,
                         mine.packed_queries.data() + g * group_rows * depth);
    }
  }
  if (panels) {
    for (Index g = 0; g < shape.kv_heads; ++g) {
      pack_rhs(PackedOperand{queries.data() + g * group_rows * depth, 1, depth}, 0, depth, 0,
               group_rows, mine.packed_queries.data() + g * query_panels * depth);
    }
  }
  // Row r's cover of the chunk by the user's mask (full without one), found once a task (a
  // mask_mod alone is called for each key of the chunk).
  if constexpr (Flex::kActive) {
    for (Index r = 0; r < rows; ++r) {
      mine.row_covers[static_cast<std::size_t>(r)] =
          static_cast<unsigned char>(flex.row_cover(b, r / n, seq.key_count - n + r % n, c0, cols));
    }
  }
  const auto flex_cover = [&](Index r) {
    if constexpr (Flex::kActive) {
      return static_cast<BlockCover>(mine.row_covers[static_cast<std::size_t>(r)]);
    } else {
      arguments_unused(r, b);
      return BlockCover::full;
    }
  };
  const auto visible = [&](Index r) {
    return options.may_see(r / n, n, r % n, r % n, c0, c0 + cols) &&
           flex_cover(r) != BlockCover::empty;
  };
  // A chunk that no row sees (outside a window, or hidden by the user's mask) is never read:
  // every row's state says so.
  bool any_visible = false;
  for (Index r = 0; r < rows && !any_visible; ++r) any_visible = visible(r);
  if (!any_visible) {
    for (Index r = 0; r < rows; ++r) {
      partial[r * partial_width] = kNegInf;
      partial[r * partial_width + 1] = 0.0F;
    }
    return;
  }
  // Whether row r's scores need masks() here: ALiBi, a window, or causal masking that hides some
  // of the chunk's keys from it (a step's earlier queries). A one-token step sees every key.
  const auto needs_masks = [&](Index r) {
    return options.alibi_slopes != nullptr || options.window.active() ||
           (options.causal != Causal::none && options.visible_end(n, r % n) < c0 + cols);
  };
  // The chunk's key (values = false) or value row j, in the cache's buffer or its page.
  const auto cache_row = [&](bool values, Index j) {
    return values ? seq.value_row(c0 + j, shape.kv_stride) : seq.key_row(c0 + j, shape.kv_stride);
  };
  // Rows of a sub-block from the chunk's row j0: at most `sub`, within the chunk and the page.
  const auto sub_rows = [&](Index j0, Index sub) {
    return std::min({sub, cols - j0, seq.rows_in_page(c0 + j0)});
  };
  // A sub-block of rows [j0, j0 + count) of the chunk's keys or values, as float rows `stride`
  // apart: the cache's own rows, or a 16-bit cache's widened into `tile`.
  const auto sub_block = [&](bool values, Index j0, Index count, Index width, Matrix<float>& tile,
                             Index& stride) -> const float* {
    const Stored* stored = cache_row(values, j0);
    stride = shape.kv_stride;
    if constexpr (std::is_same_v<Stored, float>) {
      return stored;
    } else if constexpr (is_quantized_block_v<Stored>) {
      dequantize_rows(stored, count, width, shape.kv_stride, tile);
      stride = width;
      return tile.data();
    } else {
      widen_rows(stored, count, width, shape.kv_stride, tile);
      stride = width;
      return tile.data();
    }
  };

  // The cache rows [c0 + j0, c0 + j0 + count) of keys or values, requested ahead of their use
  // by the micro-kernel, which walks a sub-block's rows once per panel of 16 columns. Dot products
  // read each row once, in order, which the hardware's prefetchers follow: there, requests of
  // their own cost a quarter of the speed (Zen 5, B = 8, H_kv = 16: 30 GB/s with them, 41
  // without, bench/RESULTS.md 2026-12-02, fourth session).
  const auto prefetch = [&](bool values, Index j0, Index count, Index width) {
    // (A quantized cache's rows are read in order as they are widened.)
    if (!panels || is_quantized_block_v<Stored>) return;
    constexpr Index kLine = 64 / static_cast<Index>(sizeof(Stored));
    for (Index j = j0; j < j0 + count; ++j) {
      const Stored* row = cache_row(values, j);
      for (Index d = 0; d < width; d += kLine) __builtin_prefetch(row + d);
    }
  };

  // The float cache's rows [c0 + j0, + sub) of one key/value head (its columns from `column`),
  // which the register blocks request while they multiply the rows before. (Widened 16-bit rows
  // are in cache already.)
  const auto rows_ahead = [&](bool values, Index j0, Index sub, Index column) {
    if constexpr (std::is_same_v<Stored, float>) {
      if (group_rows < 4) return RowsAhead{};
      return RowsAhead{cache_row(values, j0) + column, sub_rows(j0, sub)};
    } else {
      arguments_unused(values, j0, sub, column);
      return RowsAhead{};
    }
  };

  // The lanes' P·V takes a chunk's values in one sub-block: its blocks request the rows
  // kLanesValuesAhead after the ones they multiply, as they go.
  const auto values_ahead = [&](const float* head_values, Index stride, Index count) {
    constexpr Index kLanesValuesAhead = 8;
    if (count <= kLanesValuesAhead) return RowsAhead{};
    return RowsAhead{head_values + kLanesValuesAhead * stride, count - kLanesValuesAhead};
  };

  // The rows that pass 1 reads after the keys [c0, c0 + end) of key/value head g: the next
  // sub-block's keys, or after the last, the values' first sub-block.
  const auto next_rows = [&](Index end, Index g) {
    return end < cols ? rows_ahead(false, end, key_sub, g * depth)
                      : rows_ahead(true, 0, value_sub, g * value_dim);
  };

  // A quantized cache's keys [c0 + j0, + count) into every key/value head's scores, and its
  // values into their sums, by the register blocks (fused). (Requesting each next sub-block's
  // rows ahead, as the float blocks do, measured no faster here.)
  const auto quantized_scores = [&](Index j0, Index count) {
#ifdef MHA_PACKED_GEMM_X86
    if constexpr (std::is_same_v<Stored, Q4Block>) {
      if (q4) {
        for (Index g = 0; g < shape.kv_heads; ++g) {
          const Index r0 = g * group_rows;
          q4_scaled_dot_rows(q4_queries + r0 * q4_row_bytes, q4_row_bytes, group_rows,
                             cache_row(false, j0) + g * depth / kQuantBlock, shape.kv_stride, count,
                             depth, options.scale, &scores(r0, j0), scores.outerStride());
        }
        return;
      }
    }
    if constexpr (is_quantized_block_v<Stored>) {
      for (Index g = 0; g < shape.kv_heads; ++g) {
        const Index r0 = g * group_rows;
        if (q4_avx2) {
          if constexpr (std::is_same_v<Stored, Q4Block>) {
            q4_dot_rows_avx2(q4_queries + r0 * q4_row_bytes_avx2, q4_row_bytes_avx2, group_rows,
                             cache_row(false, j0) + g * depth / kQuantBlock, shape.kv_stride, count,
                             depth, options.scale, &scores(r0, j0), scores.outerStride());
          }
          continue;
        }
        if (fused_avx2) {
          dot_rows_avx2(queries.data() + r0 * depth, group_rows, cache_row(false, j0),
                        shape.kv_stride, g * depth, count, depth, options.scale, &scores(r0, j0),
                        scores.outerStride());
          continue;
        }
        scaled_dot_row_blocks(
            mine.packed_queries.data() + r0 * depth, group_rows,
            QuantizedRows<Stored>{cache_row(false, j0), shape.kv_stride, g * depth}, count, depth,
            options.scale, &scores(r0, j0), scores.outerStride(), RowsAhead{});
      }
    }
#endif
    arguments_unused(j0, count);
  };
  const auto quantized_values = [&](Index j0, Index count) {
#ifdef MHA_PACKED_GEMM_X86
    if constexpr (std::is_same_v<Stored, Q4Block>) {
      if (q4) {
        for (Index g = 0; g < shape.kv_heads; ++g) {
          const Index r0 = g * group_rows;
          q4_value_rows(&scores(r0, j0), scores.outerStride(), group_rows,
                        cache_row(true, j0) + g * value_dim / kQuantBlock, shape.kv_stride, count,
                        value_dim, j0 == 0,
                        reinterpret_cast<std::uint16_t*>(mine.weight_rows.data()), &mine.acc(r0, 0),
                        mine.acc.outerStride());
        }
        return;
      }
    }
    if constexpr (is_quantized_block_v<Stored>) {
      for (Index g = 0; g < shape.kv_heads; ++g) {
        const Index r0 = g * group_rows;
        if (fused_avx2) {
          value_rows_avx2(&scores(r0, j0), scores.outerStride(), group_rows, cache_row(true, j0),
                          shape.kv_stride, g * value_dim, count, value_dim, j0 == 0,
                          &mine.acc(r0, 0), mine.acc.outerStride());
          continue;
        }
        value_row_blocks(&scores(r0, j0), scores.outerStride(), group_rows,
                         QuantizedRows<Stored>{cache_row(true, j0), shape.kv_stride, g * value_dim},
                         count, value_dim, j0 == 0, &mine.acc(r0, 0), mine.acc.outerStride(),
                         RowsAhead{});
      }
    }
#endif
    arguments_unused(j0, count);
  };

  // pass 1: scores, a sub-block of keys at a time for every key/value head.
  for (Index j0 = 0, count = 0; j0 < cols; j0 += count) {
    count = sub_rows(j0, key_sub);
    if (j0 + count < cols) {
      prefetch(false, j0 + count, sub_rows(j0 + count, key_sub), shape.kv_heads * depth);
    } else {
      prefetch(true, 0, sub_rows(0, value_sub), shape.kv_heads * value_dim);
    }
    if (fused) {
      quantized_scores(j0, count);
      continue;
    }
    Index stride = 0;
    const float* keys = sub_block(false, j0, count, shape.kv_heads * depth, mine.key_tile, stride);
    if (by_rows) {
      scaled_dots_by_rows(queries.data(), shape.kv_heads, keys, stride, count, depth, options.scale,
                          &scores(0, j0), scores.outerStride());
      continue;
    }
    for (Index g = 0; g < shape.kv_heads; ++g) {
      const float* head_keys = keys + g * depth;
      const Index r0 = g * group_rows;
      if (panels) {
        // scoresᵀ [count, group_rows] into a tile, then into the rows' scores: the keys are the
        // product's rows.
        float* transposed = mine.weight_rows.data();
        // NOLINTNEXTLINE(readability-suspicious-call-argument)
        multiply_panels(count, group_rows, depth, LeftOperand{head_keys, stride, false},
                        mine.packed_queries.data() + g * query_panels * depth, depth * S::kNr,
                        options.scale, true, transposed, query_panels, packed_gemm_buffers().edge);
        for (Index r = 0; r < group_rows; ++r) {
          for (Index j = 0; j < count; ++j) {
            scores(r0 + r, j0 + j) = transposed[j * query_panels + r];
          }
        }
      } else if (float_blocks_avx2) {
        dot_rows_avx2(queries.data() + r0 * depth, group_rows, head_keys, stride, 0, count, depth,
                      options.scale, &scores(r0, j0), scores.outerStride());
      } else if (lanes) {
        scaled_dot_lanes(mine.packed_queries.data() + g * query_panels * depth, group_rows,
                         head_keys, stride, count, depth, options.scale, &scores(r0, j0),
                         scores.outerStride(), next_rows(j0 + count, g));
      } else {
        scaled_dot_rows((blocks ? mine.packed_queries.data() : queries.data()) + r0 * depth,
                        group_rows, head_keys, stride, count, depth, options.scale, &scores(r0, j0),
                        scores.outerStride(), next_rows(j0 + count, g));
      }
    }
  }

  // pass 2: softcap, masks, and each row's softmax over the chunk.
  for (Index r = 0; r < rows; ++r) {
    float* state = partial + r * partial_width;
    state[0] = kNegInf;
    state[1] = 0.0F;
    auto row = scores.row(r).head(cols);
    if (!visible(r)) {
      row.setZero();  // (pass 3 multiplies every row)
      continue;
    }
    if (options.softcap > 0.0F) {
      row = (options.softcap * (row.array() / options.softcap).tanh()).matrix();
    }
    // The user's score_mod, then the built-in masks, then the user's mask (the flash kernel's
    // order).
    Eigen::Map<Matrix<float>> row_tile(row.data(), 1, cols);
    const Index q_idx = seq.key_count - n + r % n;
    if constexpr (Flex::kActive) flex.modify_scores(b, r / n, q_idx, c0, row_tile);
    if (needs_masks(r)) {
      Eigen::Map<Matrix<float>> mask_tile(mine.exps.data(), 1, cols);
      options.masks(0, r / n, n, r % n, c0, mask_tile);
      row += mask_tile;
    }
    if constexpr (Flex::kActive) flex.mask(b, r / n, q_idx, c0, flex_cover(r), row_tile);
    const float row_max = row.maxCoeff();
    if (row_max == kNegInf) {
      // No visible key here; a NaN score must still reach the output (as the flash kernel's),
      // which the maximum may have skipped. (Beside a finite score, a NaN reaches the sum.)
      if (row.hasNaN()) state[1] = std::numeric_limits<float>::quiet_NaN();
      row.setZero();
      continue;
    }
    state[0] = row_max;
    state[1] = exp_shifted_row(row.data(), cols, row_max);
  }
  // The rows after the last, which the micro-kernel's last tile of a group may reach: finite.
  if (panels) scores.middleRows(rows, S::kMr).setZero();

  // pass 3: acc += p v, a sub-block of values at a time for every key/value head; the sums in
  // acc, [H·n, Dv] (the panels': [H_kv · tile_rows, Dv], each group's rows padded to whole
  // micro-tiles).
  for (Index j0 = 0, count = 0; j0 < cols; j0 += count) {
    count = sub_rows(j0, value_sub);
    if (j0 + count < cols) {
      prefetch(true, j0 + count, sub_rows(j0 + count, value_sub), shape.kv_heads * value_dim);
    }
    if (fused) {
      quantized_values(j0, count);
      continue;
    }
    Index stride = 0;
    const float* values =
        sub_block(true, j0, count, shape.kv_heads * value_dim, mine.value_tile, stride);
    if (by_rows) {
      if (j0 == 0) mine.acc.topRows(rows).setZero();
      accumulate_by_rows(&scores(0, j0), scores.outerStride(), shape.kv_heads, values, stride,
                         count, value_dim, mine.acc.data(), mine.acc.outerStride());
      continue;
    }
    for (Index g = 0; g < shape.kv_heads; ++g) {
      const float* head_values = values + g * value_dim;
      const Index r0 = g * group_rows;
      if (panels) {
#ifdef MHA_PACKED_GEMM_X86
        // Two panels of columns a call with AVX-512 (see multiply_panels).
        const Index step = (cpu_has_avx512f() ? 2 : 1) * S::kNr;
        for (Index i = 0; i < tile_rows; i += S::kMr) {
          const float* probabilities = &scores(r0 + i, j0);
          for (Index d = 0; d < value_dim; d += step) {
            float* sums = &mine.acc(g * tile_rows + i, d);
            if (d + 2 * S::kNr <= value_dim && step > S::kNr) {
              micro_kernel_avx512<2>(count, probabilities, scores.outerStride(), 1, head_values + d,
                                     S::kNr, stride, 1.0F, j0 == 0, sums, mine.acc.outerStride());
            } else {
              for (Index e = d; e < std::min(value_dim, d + step); e += S::kNr) {
                micro_kernel(count, probabilities, scores.outerStride(), 1, head_values + e, stride,
                             1.0F, j0 == 0, &mine.acc(g * tile_rows + i, e),
                             mine.acc.outerStride());
              }
            }
          }
        }
#endif
      } else if (float_blocks_avx2) {
        value_rows_avx2(&scores(r0, j0), scores.outerStride(), group_rows, head_values, stride, 0,
                        count, value_dim, j0 == 0, &mine.acc(r0, 0), mine.acc.outerStride());
      } else {
        accumulate_value_rows(
            &scores(r0, j0), scores.outerStride(), group_rows, head_values, stride, count,
            value_dim, j0 == 0, &mine.acc(r0, 0), mine.acc.outerStride(),
            value_sub == kDecodeChunk ? values_ahead(head_values, stride, count)
            : j0 + count < cols       ? rows_ahead(true, j0 + count, value_sub, g * value_dim)
                                      : RowsAhead{});
      }
    }
  }
  for (Index r = 0; r < rows; ++r) {
    const Index acc_row = panels ? (r / group_rows) * tile_rows + r % group_rows : r;
    const float* sums = &mine.acc(acc_row, 0);
    std::copy(sums, sums + value_dim, partial + r * partial_width + kPartialHeader);
  }
}

// out [Dv] = the merge of `chunks` partial states `chunk_stride` floats apart (see the top). A
// sink logit (kernels/sinks.hpp; -inf for none) joins as one more state: m = sink, l = 1, acc = 0.
inline void merge_partials(const float* first, Index chunks, Index chunk_stride, Index value_dim,
                           float* out, float sink) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  float overall_max = sink;
  bool nan = false;
  for (Index c = 0; c < chunks; ++c) {
    const float* state = first + c * chunk_stride;
    overall_max = std::max(overall_max, state[0]);
    nan = nan || std::isnan(state[1]);
  }
  Eigen::Map<RowVector<float>> result(out, value_dim);
  if (overall_max == kNegInf) {
    // No chunk saw a visible key: 0, as every kernel gives such a row (NaN if a score was).
    result.setConstant(nan ? std::numeric_limits<float>::quiet_NaN() : 0.0F);
    return;
  }
  float total = sink == kNegInf ? 0.0F : std::exp(sink - overall_max);
  result.setZero();
  for (Index c = 0; c < chunks; ++c) {
    const float* state = first + c * chunk_stride;
    if (state[0] == kNegInf && !std::isnan(state[1])) continue;
    const float weight = std::exp(state[0] - overall_max);
    total += weight * state[1];
    result += weight * Eigen::Map<const RowVector<float>>(state + kPartialHeader, value_dim);
  }
  if (total != 0.0F) {
    result /= total;
  } else {
    result.setZero();
  }
}

// The step's attention for every sequence (see the top). options holds the scale, causal
// masking (bottom-right), the window, ALiBi slopes and softcap, as decode_kernel_applies
// allows; its causal_cols is set here per sequence.
template <class Stored, class Flex = NoFlex>
void decode_attention(const std::vector<DecodeSequence<Stored>>& sequences,
                      const DecodeShape& shape, const CoreOptions<float>& options,
                      std::vector<KernelScratch<float>>& scratch, DecodeScratch& buffers,
                      const Flex& flex = {}) {
  const auto batch = static_cast<Index>(sequences.size());
  const Index partial_width = kPartialHeader + shape.value_dim;
  const auto chunks_of = [](const DecodeSequence<Stored>& seq) {
    return seq.query_count > 0 ? (seq.key_count + kDecodeChunk - 1) / kDecodeChunk : Index(0);
  };
  // Sequence b's tasks are its chunks, each with a partial state per row (H·n rows).
  buffers.task_begin.assign(static_cast<std::size_t>(batch) + 1, 0);
  buffers.partial_begin.assign(static_cast<std::size_t>(batch) + 1, 0);
  Index max_rows = 0, max_queries = 0;
  [[maybe_unused]] double work = 0;
  for (Index b = 0; b < batch; ++b) {
    const auto& seq = sequences[static_cast<std::size_t>(b)];
    const auto i = static_cast<std::size_t>(b);
    buffers.task_begin[i + 1] = buffers.task_begin[i] + chunks_of(seq);
    buffers.partial_begin[i + 1] =
        buffers.partial_begin[i] + chunks_of(seq) * shape.heads * seq.query_count * partial_width;
    max_rows = std::max(max_rows, shape.heads * seq.query_count);
    max_queries = std::max(max_queries, seq.query_count);
    work += static_cast<double>(shape.heads * seq.query_count) *
            static_cast<double>(seq.key_count) *
            static_cast<double>(shape.head_dim + shape.value_dim);
  }
  const Index tasks = buffers.task_begin.back();
  if (static_cast<Index>(buffers.partials.size()) < buffers.partial_begin.back()) {
    buffers.partials.resize(static_cast<std::size_t>(buffers.partial_begin.back()));
  }
  float* const partials = buffers.partials.data();
  const Index* const task_begin = buffers.task_begin.data();
  const Index* const partial_begin = buffers.partial_begin.data();

  scratch_for_threads(scratch);
  TaskExceptions<Flex::kActive> task_exceptions;  // a user's mod may throw
  MHA_OMP_PRAGMA(omp parallel if (worth_threads(tasks, work))) {
    // This thread's buffers: resized only when the shapes change, never inside the task loop.
    KernelScratch<float>& mine = scratch[static_cast<std::size_t>(thread_index())];
    mine.scores.resize(max_rows + PackedGemmShape::kMr, kDecodeChunk);
    mine.queries.resize(std::max<Index>(max_rows, 1), shape.head_dim);
    mine.exps.resize(kDecodeChunk);
    if (Flex::kActive) mine.row_covers.resize(static_cast<std::size_t>(max_rows));
    // Each key/value head's queries as panels, its rows' sums padded to whole micro-tiles (in
    // acc), and the transposed scores of a sub-block (in weight_rows).
    const Index group_rows = shape.group() * max_queries;
    if (std::is_same_v<Stored, Q4Block> && q4_products_available(shape.head_dim, shape.value_dim)) {
      // Each row's int8 codes (decode_q4.hpp), and the weights of a sub-block's values.
      mine.packed_queries.resize(max_rows, q4_query_row_bytes(shape.head_dim) / 4);
      const auto weights = static_cast<std::size_t>(group_rows * shape.value_dim / 2);
      if (mine.weight_rows.size() < weights) mine.weight_rows.resize(weights);
    } else {
      // (Which also holds each row's q4_query_row_bytes_avx2: at most 4 · D bytes, D >= 32.)
      mine.packed_queries.resize(shape.kv_heads * packed_width(group_rows), shape.head_dim);
    }
    mine.acc.resize(shape.kv_heads * ((group_rows + PackedGemmShape::kMr - 1) /
                                      PackedGemmShape::kMr * PackedGemmShape::kMr),
                    shape.value_dim);
    const auto transposed = static_cast<std::size_t>(kDecodeSubBlock * packed_width(group_rows));
    if (mine.weight_rows.size() < transposed) mine.weight_rows.resize(transposed);
    if constexpr (!std::is_same_v<Stored, float>) {
      mine.key_tile.resize(kDecodeSubBlock, shape.kv_heads * shape.head_dim);
      mine.value_tile.resize(kDecodeSubBlock, shape.kv_heads * shape.value_dim);
    }
    // Sequences of different lengths make tasks of different sizes: dynamic scheduling.
    MHA_OMP_PRAGMA(omp for schedule(dynamic))
    for (Index task = 0; task < tasks; ++task) {
      const Index b = std::upper_bound(task_begin, task_begin + batch + 1, task) - task_begin - 1;
      const auto& seq = sequences[static_cast<std::size_t>(b)];
      const Index chunk = task - task_begin[b], c0 = chunk * kDecodeChunk;
      task_exceptions.run([&] {
        CoreOptions<float> sequence_options = options;
        sequence_options.causal_cols = seq.key_count;
        decode_task(
            seq, seq.batch_index, shape, c0, std::min(kDecodeChunk, seq.key_count - c0),
            sequence_options, flex, mine,
            partials + partial_begin[b] + chunk * shape.heads * seq.query_count * partial_width);
      });
    }
    // Each (sequence, query head)'s rows merged by one thread.
    MHA_OMP_PRAGMA(omp for schedule(static))
    for (Index pair = 0; pair < batch * shape.heads; ++pair) {
      const Index b = pair / shape.heads, h = pair % shape.heads;
      const auto& seq = sequences[static_cast<std::size_t>(b)];
      const Index n = seq.query_count, task_rows = shape.heads * n;
      for (Index i = 0; i < n; ++i) {
        merge_partials(
            partials + partial_begin[b] + (h * n + i) * partial_width, chunks_of(seq),
            task_rows * partial_width, shape.value_dim,
            seq.out + i * shape.out_stride + h * shape.value_dim,
            options.sinks != nullptr ? options.sinks[h] : -std::numeric_limits<float>::infinity());
      }
    }
  }
  task_exceptions.rethrow();
}

}  // namespace mha::detail
