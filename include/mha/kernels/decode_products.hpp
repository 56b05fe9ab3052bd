// The decoding kernel's two products, for the few rows that share a key/value head's cached keys
// and values (its G query heads, each with the sequence's n new queries):
//   scores [rows, count] = scale · q [rows, D] · keys [count, D]ᵀ   (scaled_dot_rows)
//   acc [rows, Dv] (= or +=) p [rows, count] · values [count, Dv]    (accumulate_value_rows)
// Keys and values are the cache's rows as they are (a key/value head's slice of each row, a row
// stride apart), read in order, never packed: a decoding step reads each of them once.
//
// With AVX-512 (chosen at run time, for D and Dv multiples of 16) both are register blocks: the
// scores as blocks of up to 4 rows × 4 keys (or 2 × 8, 1 × 8), each a chain of FMAs along D per
// (row, key) in its own register, summed across lanes once per block (reduce_sixteen); P·V as
// blocks of up to 4 rows × 64 columns of acc (2 × 128), each value row's packets loaded once for
// every row of the block. In L1, one thread, Zen 5, D = 128, 16 query heads (throwaway programs,
// bench/RESULTS.md 2026-12-03): the 4 × 4 score blocks ran at 90 % of the one-thread FMA peak
// and the 4 × 64 P·V blocks at 96 %, where scoresᵀ with broadcast keys (the packed GEMM's
// micro-kernel's form) ran at 71-86 % (8 to 16 keys a tile) and 6-row P·V tiles at 86 %. Used
// for two or more rows (decode_path); one row takes the dot products and weighted sums below,
// which a decoding step with one query head per key/value head measured faster. For many rows
// (sixteen query heads of one key/value head) the scores take the rows as lanes instead
// (scaled_dot_lanes): no sums across lanes, whose shuffles share a port with an FMA unit on
// Intel cores.
#pragma once

#include <algorithm>

#include "mha/kernels/packed_gemm.hpp"
#include "mha/tensor.hpp"

namespace mha::detail {

// scale · q · k over `depth`: one chain of packets, summed across lanes, then the rest one by one.
inline float scaled_dot(const float* q, const float* k, Index depth, float scale) {
  using Packet = Eigen::internal::packet_traits<float>::type;
  constexpr Index lanes = Eigen::internal::packet_traits<float>::size;
  const Index vector_depth = depth / lanes * lanes;
  Packet s = Eigen::internal::pzero(Packet{});
  for (Index d = 0; d < vector_depth; d += lanes) {
    s = Eigen::internal::pmadd(Eigen::internal::ploadu<Packet>(q + d),
                               Eigen::internal::ploadu<Packet>(k + d), s);
  }
  float dot = Eigen::internal::predux(s);
  for (Index d = vector_depth; d < depth; ++d) dot += q[d] * k[d];
  return scale * dot;
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
  for (; j < count; ++j) scores[j] = scaled_dot(q, keys + j * stride, depth, scale);
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
    MHA_UNROLL
    for (Index p = 0; p < kPackets; ++p) sums[p] = ploadu<Packet>(acc + d + p * lanes);
    for (Index j = 0; j < count; ++j) {
      const Packet w = pset1<Packet>(weights[j]);
      const float* v = values + j * stride + d;
      MHA_UNROLL
      for (Index p = 0; p < kPackets; ++p)
        sums[p] = pmadd(w, ploadu<Packet>(v + p * lanes), sums[p]);
    }
    MHA_UNROLL
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

// One query per key/value head (decoding one token without grouped heads), the cache read a whole
// row at a time from its first byte to its last, every head's slice of it in turn:
//   scores[g · score_stride + j] = scale · q_g · keys_j[g·D, (g + 1)·D)     (scaled_dots_by_rows)
//   acc_g[c] += p[g · p_stride + j] · values_j[g·Dv + c]                     (accumulate_by_rows)
// for g < heads, j < count, q [heads, D] contiguous, acc_g = acc + g · acc_stride, the cache's
// rows [count, heads·D] `stride` apart. One head's slices alone are D floats a row apart, and
// walking them head after head through a sub-block of rows leaves the hardware's prefetchers many
// short streams at once; read this way the rows are one stream. Each score and each acc element
// takes the same operations in the same order as scaled_dots' and accumulate_weighted_rows'.
inline void scaled_dots_by_rows(const float* q, Index heads, const float* keys, Index stride,
                                Index count, Index depth, float scale, float* scores,
                                Index score_stride) {
  for (Index j = 0; j < count; ++j) {
    const float* row = keys + j * stride;
    for (Index g = 0; g < heads; ++g) {
      scores[g * score_stride + j] = scaled_dot(q + g * depth, row + g * depth, depth, scale);
    }
  }
}

inline void accumulate_by_rows(const float* p, Index p_stride, Index heads, const float* values,
                               Index stride, Index count, Index value_dim, float* acc,
                               Index acc_stride) {
  using Eigen::internal::ploadu;
  using Eigen::internal::pmadd;
  using Eigen::internal::pset1;
  using Packet = Eigen::internal::packet_traits<float>::type;
  constexpr Index lanes = Eigen::internal::packet_traits<float>::size;
  const Index vector_width = value_dim / lanes * lanes;
  for (Index j = 0; j < count; ++j) {
    const float* row = values + j * stride;
    for (Index g = 0; g < heads; ++g) {
      const float weight = p[g * p_stride + j];
      const Packet w = pset1<Packet>(weight);
      const float* v = row + g * value_dim;
      float* sums = acc + g * acc_stride;
      for (Index c = 0; c < vector_width; c += lanes) {
        Eigen::internal::pstoreu(sums + c,
                                 pmadd(w, ploadu<Packet>(v + c), ploadu<Packet>(sums + c)));
      }
      for (Index c = vector_width; c < value_dim; ++c) sums[c] += weight * v[c];
    }
  }
}

// The rows that the next call will read (the cache's, in the layout of the current ones), or
// none: requested from memory while the current ones are multiplied, so that the lines of a
// sub-block are on their way before its products wait for them. (Outside the x86 branch: the
// decoding task passes them on every platform, and elsewhere they go unused.)
struct RowsAhead {
  const float* rows = nullptr;
  Index count = 0;
};

#ifdef MHA_PACKED_GEMM_X86
// A packet loaded into a register of its own. GCC 12 otherwise folds the load into every FMA
// that reads it (a memory operand each: four loads where one was written), and the loads then
// bound the block: the 4 × 64 P·V block ran at 41 % of the peak that way, at 96 % loaded once.
// (An empty asm holding the loaded value instead kept the blocks' packets on the stack.)
__attribute__((target("avx512f"), always_inline)) inline __m512 load_once(const float* p) {
  __m512 packet;
  asm("vmovups %1, %0" : "=v"(packet) : "m"(*reinterpret_cast<const __m512*>(p)));
  return packet;
}

// Where the register blocks below read their keys or values, 16 consecutive values of a row at a
// time: row(j) for row j, load(row, e) for its values [e, e + 16) of the block's columns,
// rows_from(j) and columns_from(c) for the rows and columns that start there. FloatRows are a
// float cache's rows as they are, `stride` floats apart; quantized_products.hpp's QuantizedRows
// widen a quantized cache's codes as they load.
struct FloatRows {
  const float* first = nullptr;
  Index stride = 0;

  const float* row(Index j) const { return first + j * stride; }
  FloatRows rows_from(Index j) const { return {row(j), stride}; }
  FloatRows columns_from(Index c) const { return {first + c, stride}; }
  __attribute__((target("avx512f"), always_inline)) static __m512 load(const float* row, Index e) {
    return load_once(row + e);
  }
};

// The sums across lanes of sixteen packets, in one packet: lane 4c + t holds the sum of
// v[4t + c]. Four rounds, each adding pairs of halves (256-bit, 128-bit, 64-bit, 32-bit) of two
// packets into one: 30 shuffles and 15 additions for sixteen sums, beside the 128 FMAs that form
// them at D = 128.
__attribute__((target("avx512f"), always_inline)) inline __m512 reduce_sixteen(
    const __m512 (&v)[16]) {
  __m512 halves[8];  // lanes 0-7: v[2i]'s partial sums, 8-15: v[2i + 1]'s
  MHA_UNROLL
  for (Index i = 0; i < 8; ++i) {
    halves[i] = _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44) +
                _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE);
  }
  __m512 quarters[4];  // 128-bit chunk c: v[4i + c]'s partial sums
  MHA_UNROLL
  for (Index i = 0; i < 4; ++i) {
    quarters[i] = _mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0x88) +
                  _mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0xDD);
  }
  __m512 pairs[2];  // chunk c, lanes 0-1: v[8i + c]'s, lanes 2-3: v[8i + 4 + c]'s
  MHA_UNROLL
  for (Index i = 0; i < 2; ++i) {
    pairs[i] = _mm512_shuffle_ps(quarters[2 * i], quarters[2 * i + 1], 0x44) +
               _mm512_shuffle_ps(quarters[2 * i], quarters[2 * i + 1], 0xEE);
  }
  return _mm512_shuffle_ps(pairs[0], pairs[1], 0x88) + _mm512_shuffle_ps(pairs[0], pairs[1], 0xDD);
}

// out[r · out_stride + j] = scale · q_r · key_j for r < Rows and j < valid (at most Keys): q as
// packets of its Rows rows in turn ([depth / 16, Rows, 16], see prepare_query_rows), the keys
// from `keys` (a row source, above), depth a multiple of 16; `ahead`, float rows keys.stride
// apart to request, or null. A key past `valid` repeats the last one (its sums are not stored).
// Row r's key j sums in packet 4 (j % 4) + r · (Keys / 4) + j / 4, so that reduce_sixteen leaves
// the block row-major: lane r · Keys + j.
template <Index Rows, Index Keys, class Source>
__attribute__((target("avx512f"), always_inline)) inline void scaled_dot_block(
    Index depth, const float* q, const Source& keys, Index valid, float scale, float* out,
    Index out_stride, const float* ahead) {
  static_assert(Keys % 4 == 0 && Rows * Keys <= 16, "a block's sums fill at most 16 packets");
  __m512 sums[16];
  MHA_UNROLL
  for (__m512& sum : sums) sum = _mm512_setzero_ps();
  decltype(keys.row(0)) key[Keys];
  MHA_UNROLL
  for (Index j = 0; j < Keys; ++j) key[j] = keys.row(std::min<Index>(j, valid - 1));
  for (Index d = 0; d < depth; d += 16, q += 16 * Rows) {
    __m512 k[Keys];
    MHA_UNROLL
    for (Index j = 0; j < Keys; ++j) k[j] = keys.load(key[j], d);
    if (ahead != nullptr) {
      MHA_UNROLL
      for (Index j = 0; j < Keys; ++j) {
        _mm_prefetch(reinterpret_cast<const char*>(ahead + j * keys.stride + d), _MM_HINT_T0);
      }
    }
    MHA_UNROLL
    for (Index r = 0; r < Rows; ++r) {
      const __m512 x = load_once(q + 16 * r);
      MHA_UNROLL
      for (Index j = 0; j < Keys; ++j) {
        __m512& sum = sums[4 * (j % 4) + r * (Keys / 4) + j / 4];
        sum = _mm512_fmadd_ps(x, k[j], sum);
      }
    }
  }
  // Row r's lanes [r · Keys, + valid) stored where its scores go, by a masked store of the
  // whole packet from Keys floats before them per row, which lie inside `out`'s rows where
  // out_stride >= Keys (the decoding kernel's score rows: kDecodeChunk). (Through an array and
  // scalar copies they took a fifth of the block's time.)
  const __m512 result = _mm512_set1_ps(scale) * reduce_sixteen(sums);
  const auto row_mask = static_cast<__mmask16>((1U << valid) - 1);
  if (Rows == 1 || out_stride >= Keys) {
    MHA_UNROLL
    for (Index r = 0; r < Rows; ++r) {
      _mm512_mask_storeu_ps(out + r * (out_stride - Keys),
                            static_cast<__mmask16>(row_mask << (r * Keys)), result);
    }
    return;
  }
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, result);
  MHA_UNROLL
  for (Index r = 0; r < Rows; ++r) {
    for (Index j = 0; j < valid; ++j) out[r * out_stride + j] = lanes[r * Keys + j];
  }
}

// acc[r · acc_stride + c] = (first ? 0 : acc) + Σ_j p[r · p_stride + j] · values_j[c] for r <
// Rows and c < 16 · Panels, j < count: value rows from `values` (a row source), each packet of a
// row loaded once for all the block's rows; `ahead`, float rows values.stride apart to request.
template <Index Rows, Index Panels, class Source>
__attribute__((target("avx512f"), always_inline)) inline void value_block(
    Index count, const float* p, Index p_stride, const Source& values, bool first, float* acc,
    Index acc_stride, const RowsAhead& ahead) {
  static_assert(Rows * Panels <= 16, "a block's sums fill at most 16 registers");
  __m512 sums[Rows][Panels];
  MHA_UNROLL
  for (Index r = 0; r < Rows; ++r) {
    MHA_UNROLL
    for (Index c = 0; c < Panels; ++c) {
      sums[r][c] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + r * acc_stride + 16 * c);
    }
  }
  for (Index j = 0; j < count; ++j) {
    __m512 v[Panels];
    const auto row = values.row(j);
    MHA_UNROLL
    for (Index c = 0; c < Panels; ++c) v[c] = values.load(row, 16 * c);
    if (j < ahead.count) {
      MHA_UNROLL
      for (Index c = 0; c < Panels; ++c) {
        _mm_prefetch(reinterpret_cast<const char*>(ahead.rows + j * values.stride + 16 * c),
                     _MM_HINT_T0);
      }
    }
    MHA_UNROLL
    for (Index r = 0; r < Rows; ++r) {
      const __m512 weight = _mm512_set1_ps(p[r * p_stride + j]);
      MHA_UNROLL
      for (Index c = 0; c < Panels; ++c) sums[r][c] = _mm512_fmadd_ps(weight, v[c], sums[r][c]);
    }
  }
  MHA_UNROLL
  for (Index r = 0; r < Rows; ++r) {
    MHA_UNROLL
    for (Index c = 0; c < Panels; ++c) _mm512_storeu_ps(acc + r * acc_stride + 16 * c, sums[r][c]);
  }
}

// The 16 x 16 floats of v transposed: lane j of v[i] becomes lane i of v[j]. Pairs of rows
// interleaved, then pairs of pairs, then 128-bit chunks twice over: 64 shuffles.
__attribute__((target("avx512f"), always_inline)) inline void transpose_sixteen(__m512 (&v)[16]) {
  __m512 t[16];
  MHA_UNROLL
  for (Index i = 0; i < 8; ++i) {  // rows 2i and 2i + 1 interleaved, within each 128-bit chunk
    t[2 * i] = _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]);
  }
  MHA_UNROLL
  for (Index i = 0; i < 4; ++i) {  // chunk c of v[4i + k]: column 4c + k of rows 4i .. 4i + 3
    v[4 * i + 0] = _mm512_shuffle_ps(t[4 * i + 0], t[4 * i + 2], 0x44);
    v[4 * i + 1] = _mm512_shuffle_ps(t[4 * i + 0], t[4 * i + 2], 0xEE);
    v[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    v[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  MHA_UNROLL
  for (Index i = 0; i < 4; ++i) {  // the chunks of rows 0-7 and of rows 8-15 gathered by column
    t[i] = _mm512_shuffle_f32x4(v[i], v[4 + i], 0x88);
    t[4 + i] = _mm512_shuffle_f32x4(v[i], v[4 + i], 0xDD);
    t[8 + i] = _mm512_shuffle_f32x4(v[8 + i], v[12 + i], 0x88);
    t[12 + i] = _mm512_shuffle_f32x4(v[8 + i], v[12 + i], 0xDD);
  }
  MHA_UNROLL
  for (Index i = 0; i < 4; ++i) {
    v[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    v[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xDD);
    v[4 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0x88);
    v[12 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0xDD);
  }
}

// out[r · out_stride + j] = scale · q_r · key_j for r < rows (at most 16) and j < Keys (at most
// 16): q as lanes ([depth, 16], see prepare_query_lanes), the keys' rows key_stride apart. Each
// key's sixteen scores (one per row) are one register, a chain of FMAs along D on the key's
// broadcast elements; the block's registers are transposed into rows once at the end. `ahead`:
// the keys (key_stride apart) that the next block reads, requested before the products.
template <Index Keys>
__attribute__((target("avx512f"), always_inline)) inline void scaled_dot_lanes_block(
    Index depth, const float* q, Index rows, const float* keys, Index key_stride, float scale,
    float* out, Index out_stride, const RowsAhead& ahead) {
  static_assert(Keys >= 1 && Keys <= 16, "a block's keys fill at most 16 registers");
  __m512 sums[16];
  MHA_UNROLL
  for (__m512& sum : sums) sum = _mm512_setzero_ps();
  // The next block's lines requested first, all at once: interleaved with the FMAs (a line of
  // each key per 16 steps), they took GCC 12 to spill the sums.
  for (Index j = 0; j < ahead.count; ++j) {
    for (Index d = 0; d < depth; d += 16) {
      _mm_prefetch(reinterpret_cast<const char*>(ahead.rows + j * key_stride + d), _MM_HINT_T0);
    }
  }
  for (Index d = 0; d < depth; ++d) {
    const __m512 x = load_once(q + 16 * d);
    MHA_UNROLL
    for (Index j = 0; j < Keys; ++j) {
      sums[j] = _mm512_fmadd_ps(_mm512_set1_ps(keys[j * key_stride + d]), x, sums[j]);
    }
  }
  const __m512 factor = _mm512_set1_ps(scale);
  MHA_UNROLL
  for (__m512& sum : sums) sum *= factor;
  transpose_sixteen(sums);
  const auto columns = static_cast<__mmask16>((1U << Keys) - 1);
  for (Index r = 0; r < rows; ++r) _mm512_mask_storeu_ps(out + r * out_stride, columns, sums[r]);
}

// The keys that the block after [.., end) of `count` keys reads: up to 16 of them, or after the
// last block, up to 16 of `ahead`.
inline RowsAhead next_keys(const float* keys, Index key_stride, Index count, Index end,
                           const RowsAhead& ahead) {
  if (end < count) return RowsAhead{keys + end * key_stride, std::min<Index>(16, count - end)};
  return RowsAhead{ahead.rows, std::min<Index>(16, ahead.count)};
}

// scaled_dot_rows for up to 16 rows as lanes: blocks of 16 keys, then a tail of 8, 4, 2 and 1,
// each block requesting the keys of the block after it, the last one `ahead`'s (at most 16).
// Used where the rows are many (decode_path's lanes): against decode's 4 x 4 register blocks,
// whose sixteen cross-lane sums per block take shuffles of the port of one of the FMAs on Intel
// cores, 0.62-0.67 of the FMA peak with 16 rows and 240 keys of D = 128 in L2, against
// 0.34-0.38 (mha_bench's decode_scores/, Emerald Rapids, bench/RESULTS.md 2026-12-05). Not
// inlined, as the blocks above.
__attribute__((target("avx512f"), noinline)) inline void scaled_dot_lanes_of(
    const float* q, Index rows, const float* keys, Index key_stride, Index count, Index depth,
    float scale, float* scores, Index score_stride, const RowsAhead& ahead) {
  // (No lambdas here: a lambda does not inherit the function's target attribute.)
  Index j = 0;
  for (; j + 16 <= count; j += 16) {
    scaled_dot_lanes_block<16>(depth, q, rows, keys + j * key_stride, key_stride, scale, scores + j,
                               score_stride, next_keys(keys, key_stride, count, j + 16, ahead));
  }
  if (j + 8 <= count) {
    scaled_dot_lanes_block<8>(depth, q, rows, keys + j * key_stride, key_stride, scale, scores + j,
                              score_stride, next_keys(keys, key_stride, count, j + 8, ahead));
    j += 8;
  }
  if (j + 4 <= count) {
    scaled_dot_lanes_block<4>(depth, q, rows, keys + j * key_stride, key_stride, scale, scores + j,
                              score_stride, next_keys(keys, key_stride, count, j + 4, ahead));
    j += 4;
  }
  if (j + 2 <= count) {
    scaled_dot_lanes_block<2>(depth, q, rows, keys + j * key_stride, key_stride, scale, scores + j,
                              score_stride, next_keys(keys, key_stride, count, j + 2, ahead));
    j += 2;
  }
  if (j < count) {
    scaled_dot_lanes_block<1>(depth, q, rows, keys + j * key_stride, key_stride, scale, scores + j,
                              score_stride, next_keys(keys, key_stride, count, j + 1, ahead));
  }
}

// scaled_dot_rows for `Rows` rows: blocks of Keys keys along the count, each block's keys in the
// next call's rows requested before it. Not inlined: inlined into the decoding task, GCC 12
// kept the blocks' registers on the stack.
template <Index Rows, Index Keys, class Source>
__attribute__((target("avx512f"), noinline)) void scaled_dot_rows_of(
    const float* q, const Source& keys, Index count, Index depth, float scale, float* scores,
    Index score_stride, RowsAhead ahead) {
  for (Index j = 0; j < count; j += Keys) {
    // A block requests the next call's rows of the same keys, where it has them all.
    const bool request = ahead.rows != nullptr && j + Keys <= ahead.count;
    scaled_dot_block<Rows, Keys>(depth, q, keys.rows_from(j), std::min<Index>(Keys, count - j),
                                 scale, scores + j, score_stride,
                                 request ? ahead.rows + j * keys.stride : nullptr);
  }
}

// accumulate_value_rows for `Rows` rows: blocks of Panels packets along the width, then single
// packets; each block's columns of the next call's rows requested before it.
template <Index Rows, Index Panels, class Source>
__attribute__((target("avx512f"), noinline)) void accumulate_value_rows_of(
    const float* p, Index p_stride, const Source& values, Index count, Index width, bool first,
    float* acc, Index acc_stride, RowsAhead ahead) {
  const auto shifted = [&](Index c) {
    return ahead.rows != nullptr ? RowsAhead{ahead.rows + c, ahead.count} : RowsAhead{};
  };
  Index c = 0;
  for (; c + 16 * Panels <= width; c += 16 * Panels) {
    value_block<Rows, Panels>(count, p, p_stride, values.columns_from(c), first, acc + c,
                              acc_stride, shifted(c));
  }
  for (; c < width; c += 16) {
    value_block<Rows, 1>(count, p, p_stride, values.columns_from(c), first, acc + c, acc_stride,
                         shifted(c));
  }
}

// scaled_dot_rows' and accumulate_value_rows' register blocks over any row source: blocks of 4
// rows, then one of 3, 2 or 1. The first block of rows requests the rows `ahead`; the others find
// them in cache.
template <class Source>
__attribute__((target("avx512f"))) void scaled_dot_row_blocks(const float* q, Index rows,
                                                              const Source& keys, Index count,
                                                              Index depth, float scale,
                                                              float* scores, Index score_stride,
                                                              const RowsAhead& ahead) {
  Index r = 0;
  for (; r + 4 <= rows; r += 4) {
    scaled_dot_rows_of<4, 4>(q + r * depth, keys, count, depth, scale, scores + r * score_stride,
                             score_stride, r == 0 ? ahead : RowsAhead{});
  }
  const Index left = rows - r;
  const float* q_left = q + r * depth;
  float* scores_left = scores + r * score_stride;
  const RowsAhead left_ahead = r == 0 ? ahead : RowsAhead{};
  if (left == 3) {
    scaled_dot_rows_of<3, 4>(q_left, keys, count, depth, scale, scores_left, score_stride,
                             left_ahead);
  } else if (left == 2) {
    scaled_dot_rows_of<2, 8>(q_left, keys, count, depth, scale, scores_left, score_stride,
                             left_ahead);
  } else if (left == 1) {
    scaled_dot_rows_of<1, 8>(q_left, keys, count, depth, scale, scores_left, score_stride,
                             left_ahead);
  }
}

template <class Source>
__attribute__((target("avx512f"))) void value_row_blocks(const float* p, Index p_stride, Index rows,
                                                         const Source& values, Index count,
                                                         Index value_dim, bool first, float* acc,
                                                         Index acc_stride, const RowsAhead& ahead) {
  Index r = 0;
  for (; r + 4 <= rows; r += 4) {
    accumulate_value_rows_of<4, 4>(p + r * p_stride, p_stride, values, count, value_dim, first,
                                   acc + r * acc_stride, acc_stride, r == 0 ? ahead : RowsAhead{});
  }
  const Index left = rows - r;
  const float* p_left = p + r * p_stride;
  float* acc_left = acc + r * acc_stride;
  const RowsAhead left_ahead = r == 0 ? ahead : RowsAhead{};
  if (left == 3) {
    accumulate_value_rows_of<3, 4>(p_left, p_stride, values, count, value_dim, first, acc_left,
                                   acc_stride, left_ahead);
  } else if (left == 2) {
    accumulate_value_rows_of<2, 8>(p_left, p_stride, values, count, value_dim, first, acc_left,
                                   acc_stride, left_ahead);
  } else if (left == 1) {
    accumulate_value_rows_of<1, 8>(p_left, p_stride, values, count, value_dim, first, acc_left,
                                   acc_stride, left_ahead);
  }
}
#endif

// Whether scaled_dot_rows and accumulate_value_rows run as AVX-512 register blocks here, for
// heads of depth D and Dv.
inline bool value_blocks_available(Index depth, Index value_dim) {
#ifdef MHA_PACKED_GEMM_X86
  return cpu_has_avx512f() && depth % 16 == 0 && value_dim % 16 == 0;
#else
  arguments_unused(depth, value_dim);
  return false;
#endif
}

// The query rows that scaled_dot_rows reads, from `rows` rows [rows, depth] src_stride apart into
// `out` ([rows, depth] floats): as they are, or for the register blocks, each block of (up to)
// four rows interleaved packet by packet, [depth / 16, rows of the block, 16], so that one
// pointer reaches every row of a block.
inline void prepare_query_rows(const float* src, Index src_stride, Index rows, Index depth,
                               float* out) {
  if (!value_blocks_available(depth, depth) || rows == 1) {
    for (Index r = 0; r < rows; ++r) {
      std::copy(src + r * src_stride, src + r * src_stride + depth, out + r * depth);
    }
    return;
  }
  for (Index r0 = 0; r0 < rows; r0 += 4) {
    const Index block = std::min<Index>(4, rows - r0);
    float* packets = out + r0 * depth;
    for (Index r = 0; r < block; ++r) {
      const float* row = src + (r0 + r) * src_stride;
      for (Index d = 0; d < depth; d += 16) {
        std::copy(row + d, row + d + 16, packets + d * block + r * 16);
      }
    }
  }
}

// Whether scaled_dot_lanes runs here (AVX-512).
inline bool query_lanes_available() {
#ifdef MHA_PACKED_GEMM_X86
  return cpu_has_avx512f();
#else
  return false;
#endif
}

// The queries of `rows` rows [rows, depth] src_stride apart as lanes, for scaled_dot_lanes: groups
// of 16 rows, group i at out + 16 · depth · i as [depth, 16] (element d of its row r at 16 · d +
// r), the lanes after the last row zero.
inline void prepare_query_lanes(const float* src, Index src_stride, Index rows, Index depth,
                                float* out) {
  for (Index r0 = 0; r0 < rows; r0 += 16) {
    float* lanes = out + r0 * depth;
    std::fill(lanes, lanes + 16 * depth, 0.0F);
    for (Index r = r0; r < std::min(rows, r0 + 16); ++r) {
      for (Index d = 0; d < depth; ++d) lanes[16 * d + (r - r0)] = src[r * src_stride + d];
    }
  }
}

// scores[r · score_stride + j] = scale · q_r · key_j for r < rows, j < count: q as
// prepare_query_lanes left it, the keys' rows key_stride apart; each score a chain of FMAs along
// D. Only where query_lanes_available().
inline void scaled_dot_lanes(const float* q, Index rows, const float* keys, Index key_stride,
                             Index count, Index depth, float scale, float* scores,
                             Index score_stride, const RowsAhead& ahead = {}) {
#ifdef MHA_PACKED_GEMM_X86
  // The first group of rows requests the keys ahead; the others find them in cache.
  for (Index r0 = 0; r0 < rows; r0 += 16) {
    scaled_dot_lanes_of(q + r0 * depth, std::min<Index>(16, rows - r0), keys, key_stride, count,
                        depth, scale, scores + r0 * score_stride, score_stride,
                        r0 == 0 ? ahead : RowsAhead{});
  }
#else
  arguments_unused(q, rows, keys, key_stride, count, depth, scale, scores, score_stride, ahead);
#endif
}

// scores[r · score_stride + j] = scale · q_r · key_j for r < rows, j < count: q as
// prepare_query_rows left it, the keys' rows key_stride apart (see the top); ahead, the keys
// the next call will read.
inline void scaled_dot_rows(const float* q, Index rows, const float* keys, Index key_stride,
                            Index count, Index depth, float scale, float* scores,
                            Index score_stride, const RowsAhead& ahead = {}) {
#ifdef MHA_PACKED_GEMM_X86
  if (rows > 1 && value_blocks_available(depth, depth)) {
    scaled_dot_row_blocks(q, rows, FloatRows{keys, key_stride}, count, depth, scale, scores,
                          score_stride, ahead);
    return;
  }
#endif
  arguments_unused(ahead);
  for (Index r = 0; r < rows; ++r) {
    scaled_dots(q + r * depth, keys, key_stride, count, depth, scale, scores + r * score_stride);
  }
}

// acc[r · acc_stride + c] = (first ? 0 : acc) + Σ_j p[r · p_stride + j] · values_j[c] for r <
// rows, c < value_dim, j < count: value rows value_stride apart (see the top); ahead, the values
// the next call will read.
inline void accumulate_value_rows(const float* p, Index p_stride, Index rows, const float* values,
                                  Index value_stride, Index count, Index value_dim, bool first,
                                  float* acc, Index acc_stride, const RowsAhead& ahead = {}) {
#ifdef MHA_PACKED_GEMM_X86
  if (rows > 1 && value_blocks_available(value_dim, value_dim)) {
    value_row_blocks(p, p_stride, rows, FloatRows{values, value_stride}, count, value_dim, first,
                     acc, acc_stride, ahead);
    return;
  }
#endif
  arguments_unused(ahead);
  for (Index r = 0; r < rows; ++r) {
    float* row = acc + r * acc_stride;
    if (first) std::fill(row, row + value_dim, 0.0F);
    accumulate_weighted_rows(row, value_dim, p + r * p_stride, values, value_stride, count);
  }
}

}  // namespace mha::detail
