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
// cache's half or bfloat16, widened as a sub-block is read), rows kv_stride apart; query head h
// reads key/value head h / G.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "mha/kernels/common.hpp"
#include "mha/kernels/convert.hpp"
#include "mha/kernels/flash.hpp"

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
// Fewer rows per key/value head than this (a query head per key/value head, decoding one token)
// take dot products: the micro-kernel's 6-row tile would be mostly padding.
constexpr Index kDecodePanelsMinRows = 8;

template <class Stored>
struct DecodeSequence {
  const float* queries = nullptr;  // [n, H·D]
  float* out = nullptr;            // [n, H·Dv]
  const Stored* keys = nullptr;    // [S, H_kv·D]
  const Stored* values = nullptr;  // [S, H_kv·Dv]
  Index query_count = 0;           // n, 0 for a sequence that sits this step out
  Index key_count = 0;             // S, the new tokens' keys included
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

// Whether a task multiplies each key/value head's rows (G·n of them) with the packed GEMM's
// micro-kernel (decode_task): where it runs, for enough rows, and value rows of whole panels.
inline bool decode_panels(const DecodeShape& shape, Index query_count) {
  return packed_gemm_available() && shape.group() * query_count >= kDecodePanelsMinRows &&
         shape.value_dim % PackedGemmShape::kNr == 0;
}

// scores[j] = scale · q · key_j for `count` keys [count, depth] whose rows are `stride` apart:
// four keys at a time, so that each packet of q is loaded once for four products.
inline void scaled_dots(const float* q, const float* keys, Index stride, Index count, Index depth,
                        float scale, float* scores) {
  using Eigen::internal::ploadu;
  using Eigen::internal::pmadd;
  using Eigen::internal::predux;
  using Packet = Eigen::internal::packet_traits<float>::type;
  constexpr Index lanes = Eigen::internal::packet_traits<float>::size;
  const Index vector_depth = depth / lanes * lanes;
  Index j = 0;
  for (; j + 4 <= count; j += 4) {
    const float* k0 = keys + j * stride;
    const float* k1 = k0 + stride;
    const float* k2 = k1 + stride;
    const float* k3 = k2 + stride;
    Packet s0 = Eigen::internal::pzero(Packet{}), s1 = s0, s2 = s0, s3 = s0;
    for (Index d = 0; d < vector_depth; d += lanes) {
      const Packet x = ploadu<Packet>(q + d);
      s0 = pmadd(x, ploadu<Packet>(k0 + d), s0);
      s1 = pmadd(x, ploadu<Packet>(k1 + d), s1);
      s2 = pmadd(x, ploadu<Packet>(k2 + d), s2);
      s3 = pmadd(x, ploadu<Packet>(k3 + d), s3);
    }
    float dots[4] = {predux(s0), predux(s1), predux(s2), predux(s3)};
    for (Index d = vector_depth; d < depth; ++d) {
      dots[0] += q[d] * k0[d];
      dots[1] += q[d] * k1[d];
      dots[2] += q[d] * k2[d];
      dots[3] += q[d] * k3[d];
    }
    for (int t = 0; t < 4; ++t) scores[j + t] = scale * dots[t];
  }
  for (; j < count; ++j) {
    const float* k = keys + j * stride;
    Packet s = Eigen::internal::pzero(Packet{});
    for (Index d = 0; d < vector_depth; d += lanes) {
      s = pmadd(ploadu<Packet>(q + d), ploadu<Packet>(k + d), s);
    }
    float dot = predux(s);
    for (Index d = vector_depth; d < depth; ++d) dot += q[d] * k[d];
    scores[j] = scale * dot;
  }
}

// acc[0, width) += Σ_j weights[j] · values_j[0, width) for `count` value rows `stride` apart: the
// accumulator held in registers, up to eight packets at a time, across all the rows.
inline void accumulate_weighted_rows(float* acc, Index width, const float* weights,
                                     const float* values, Index stride, Index count) {
  using Eigen::internal::ploadu;
  using Eigen::internal::pmadd;
  using Eigen::internal::pset1;
  using Packet = Eigen::internal::packet_traits<float>::type;
  constexpr Index lanes = Eigen::internal::packet_traits<float>::size;
  constexpr Index kPackets = 8;
  Index d = 0;
  for (; d + kPackets * lanes <= width; d += kPackets * lanes) {
    Packet sums[kPackets];
    for (Index p = 0; p < kPackets; ++p) sums[p] = ploadu<Packet>(acc + d + p * lanes);
    for (Index j = 0; j < count; ++j) {
      const Packet w = pset1<Packet>(weights[j]);
      const float* v = values + j * stride + d;
      for (Index p = 0; p < kPackets; ++p)
        sums[p] = pmadd(w, ploadu<Packet>(v + p * lanes), sums[p]);
    }
    for (Index p = 0; p < kPackets; ++p) Eigen::internal::pstoreu(acc + d + p * lanes, sums[p]);
  }
  for (; d + lanes <= width; d += lanes) {
    Packet sum = ploadu<Packet>(acc + d);
    for (Index j = 0; j < count; ++j) {
      sum = pmadd(pset1<Packet>(weights[j]), ploadu<Packet>(values + j * stride + d), sum);
    }
    Eigen::internal::pstoreu(acc + d, sum);
  }
  for (; d < width; ++d) {
    for (Index j = 0; j < count; ++j) acc[d] += weights[j] * values[j * stride + d];
  }
}

// A row's partial state in a task's partials: m, l, then acc [Dv].
constexpr Index kPartialHeader = 2;

// One task: every row of sequence `seq` (query head h, query i: row r = h·n + i) against its
// keys [c0, c0 + cols) of every key/value head. partial is [H·n, 2 + Dv].
//
// A key/value head's rows take dot products when they are few (decode_panels), and otherwise
// the packed GEMM's micro-kernel twice: scoresᵀ = K Qᵀ, the cache's key rows multiplying the
// group's queries packed once per task (packing the keys instead would transpose each of them),
// and acc += P V, the probabilities' rows multiplying the cache's value rows as they are.
template <class Stored>
void decode_task(const DecodeSequence<Stored>& seq, const DecodeShape& shape, Index c0, Index cols,
                 const CoreOptions<float>& options, KernelScratch<float>& mine, float* partial) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  using S = PackedGemmShape;
  const Index n = seq.query_count, rows = shape.heads * n;
  const Index group_rows = shape.group() * n;  // key/value head g's: [g·group_rows, +group_rows)
  const Index depth = shape.head_dim, value_dim = shape.value_dim;
  const Index partial_width = kPartialHeader + value_dim;
  const bool panels = decode_panels(shape, n);
  const Index query_panels = packed_width(group_rows);
  const Index tile_rows = (group_rows + S::kMr - 1) / S::kMr * S::kMr;
  Matrix<float>& scores = mine.scores;    // [H·n + kMr, kDecodeChunk]
  Matrix<float>& queries = mine.queries;  // [H·n, D], rows in r order
  for (Index r = 0; r < rows; ++r) {
    const float* q = seq.queries + (r % n) * shape.query_stride + (r / n) * depth;
    std::copy(q, q + depth, queries.data() + r * depth);
  }
  if (panels) {
    for (Index g = 0; g < shape.kv_heads; ++g) {
      pack_rhs(PackedOperand{queries.data() + g * group_rows * depth, 1, depth}, 0, depth, 0,
               group_rows, mine.packed_queries.data() + g * query_panels * depth);
    }
  }
  const auto visible = [&](Index r) {
    return options.may_see(r / n, n, r % n, r % n, c0, c0 + cols);
  };
  // A sub-block of rows [j0, j0 + count) of the chunk's keys or values, as float rows `stride`
  // apart: the cache's own rows, or a 16-bit cache's widened into `tile`.
  const auto sub_block = [&](const Stored* base, Index j0, Index count, Index width,
                             Matrix<float>& tile, Index& stride) -> const float* {
    const Stored* stored = base + (c0 + j0) * shape.kv_stride;
    stride = shape.kv_stride;
    if constexpr (std::is_same_v<Stored, float>) {
      return stored;
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
  const auto prefetch = [&](const Stored* base, Index j0, Index count, Index width) {
    if (!panels) return;
    constexpr Index kLine = 64 / static_cast<Index>(sizeof(Stored));
    for (Index j = c0 + j0; j < c0 + j0 + count; ++j) {
      for (Index d = 0; d < width; d += kLine) __builtin_prefetch(base + j * shape.kv_stride + d);
    }
  };

  // pass 1: scores, a sub-block of keys at a time for every key/value head.
  for (Index j0 = 0; j0 < cols; j0 += kDecodeSubBlock) {
    const Index count = std::min(kDecodeSubBlock, cols - j0);
    if (j0 + count < cols) {
      prefetch(seq.keys, j0 + count, std::min(kDecodeSubBlock, cols - j0 - count),
               shape.kv_heads * depth);
    } else {
      prefetch(seq.values, 0, std::min(kDecodeSubBlock, cols), shape.kv_heads * value_dim);
    }
    Index stride = 0;
    const float* keys =
        sub_block(seq.keys, j0, count, shape.kv_heads * depth, mine.key_tile, stride);
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
      } else {
        for (Index r = r0; r < r0 + group_rows; ++r) {
          scaled_dots(queries.data() + r * depth, head_keys, stride, count, depth, options.scale,
                      &scores(r, j0));
        }
      }
    }
  }

  // pass 2: softcap, masks, and each row's softmax over the chunk.
  for (Index r = 0; r < rows; ++r) {
    float* state = partial + r * partial_width;
    std::fill(state + kPartialHeader, state + partial_width, 0.0F);
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
    if (options.any_mask()) {
      Eigen::Map<Matrix<float>> mask_tile(mine.exps.data(), 1, cols);
      options.masks(0, r / n, n, r % n, c0, mask_tile);
      row += mask_tile;
    }
    float row_max = kNegInf;
    bool nan = false;
    for (Index j = 0; j < cols; ++j) {
      if (row(j) > row_max) {
        row_max = row(j);
      } else if (std::isnan(row(j))) {
        nan = true;
      }
    }
    if (row_max == kNegInf) {
      // No visible key here; a NaN score must still reach the output (as the flash kernel's).
      if (nan) state[1] = std::numeric_limits<float>::quiet_NaN();
      row.setZero();
      continue;
    }
    state[0] = row_max;
    state[1] = exp_shifted_row(row.data(), cols, row_max);
  }
  // The rows after the last, which the micro-kernel's last tile of a group may reach: finite.
  if (panels) scores.middleRows(rows, S::kMr).setZero();

  // pass 3: acc += p v, a sub-block of values at a time for every key/value head; the panels'
  // sums in acc ([H_kv · tile_rows, Dv]: each group's rows padded to whole micro-tiles).
  for (Index j0 = 0; j0 < cols; j0 += kDecodeSubBlock) {
    const Index count = std::min(kDecodeSubBlock, cols - j0);
    if (j0 + count < cols) {
      prefetch(seq.values, j0 + count, std::min(kDecodeSubBlock, cols - j0 - count),
               shape.kv_heads * value_dim);
    }
    Index stride = 0;
    const float* values =
        sub_block(seq.values, j0, count, shape.kv_heads * value_dim, mine.value_tile, stride);
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
      } else {
        for (Index r = r0; r < r0 + group_rows; ++r) {
          accumulate_weighted_rows(partial + r * partial_width + kPartialHeader, value_dim,
                                   &scores(r, j0), head_values, stride, count);
        }
      }
    }
  }
  if (panels) {
    for (Index r = 0; r < rows; ++r) {
      const float* sums = &mine.acc((r / group_rows) * tile_rows + r % group_rows, 0);
      std::copy(sums, sums + value_dim, partial + r * partial_width + kPartialHeader);
    }
  }
}

// out [Dv] = the merge of `chunks` partial states `chunk_stride` floats apart (see the top).
inline void merge_partials(const float* first, Index chunks, Index chunk_stride, Index value_dim,
                           float* out) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  float overall_max = kNegInf;
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
  float total = 0.0F;
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
template <class Stored>
void decode_attention(const std::vector<DecodeSequence<Stored>>& sequences,
                      const DecodeShape& shape, const CoreOptions<float>& options,
                      std::vector<KernelScratch<float>>& scratch, DecodeScratch& buffers) {
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
  MHA_OMP_PRAGMA(omp parallel if (worth_threads(tasks, work))) {
    // This thread's buffers: resized only when the shapes change, never inside the task loop.
    KernelScratch<float>& mine = scratch[static_cast<std::size_t>(thread_index())];
    mine.scores.resize(max_rows + PackedGemmShape::kMr, kDecodeChunk);
    mine.queries.resize(std::max<Index>(max_rows, 1), shape.head_dim);
    mine.exps.resize(kDecodeChunk);
    // Each key/value head's queries as panels, its rows' sums padded to whole micro-tiles (in
    // acc), and the transposed scores of a sub-block (in weight_rows).
    const Index group_rows = shape.group() * max_queries;
    mine.packed_queries.resize(shape.kv_heads * packed_width(group_rows), shape.head_dim);
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
      CoreOptions<float> sequence_options = options;
      sequence_options.causal_cols = seq.key_count;
      decode_task(
          seq, shape, c0, std::min(kDecodeChunk, seq.key_count - c0), sequence_options, mine,
          partials + partial_begin[b] + chunk * shape.heads * seq.query_count * partial_width);
    }
    // Each (sequence, query head)'s rows merged by one thread.
    MHA_OMP_PRAGMA(omp for schedule(static))
    for (Index pair = 0; pair < batch * shape.heads; ++pair) {
      const Index b = pair / shape.heads, h = pair % shape.heads;
      const auto& seq = sequences[static_cast<std::size_t>(b)];
      const Index n = seq.query_count, task_rows = shape.heads * n;
      for (Index i = 0; i < n; ++i) {
        merge_partials(partials + partial_begin[b] + (h * n + i) * partial_width, chunks_of(seq),
                       task_rows * partial_width, shape.value_dim,
                       seq.out + i * shape.out_stride + h * shape.value_dim);
      }
    }
  }
}

}  // namespace mha::detail
