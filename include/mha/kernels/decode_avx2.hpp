// The decoding kernel's two products as register blocks on CPUs with AVX2 and FMA but not
// AVX-512, for heads of whole blocks of 32 (D and Dv multiples of kQuantBlock), over a float
// cache's rows (or a 16-bit cache's, widened into a tile) and over a q8 or q4 cache's blocks
// (quantized_cache.hpp):
//   scores [rows, count] = scale · q [rows, D] · keys [count, D]ᵀ   (dot_rows_avx2)
//   acc [rows, Dv] (= or +=) p [rows, count] · values [count, Dv]    (value_rows_avx2)
// decode_products.hpp's AVX-512 blocks in 8-lane registers, of which AVX2 has 16: each (row, key)
// sums in a register of its own, across lanes once per block; each value row's packets are loaded
// once for all the block's rows. A quantized cache's codes are widened as they load, eight values
// at a time, to the same floats as dequantized() (each code times its scale is exact in float).
// Without them the kernel widened each sub-block of a quantized cache into a float tile and
// multiplied the tile: on Zen 3 (B = 1, H_kv = 16, 16384 cached tokens, the kernel alone) a q4
// step took 7.3 ms, two thirds of the float cache's 10.9, where its bytes are a seventh; and a
// float cache's groups of two to seven query rows took dot products a row at a time (four rows
// per key/value head, the cache in L3: 0.23 of the FMA peak; decode.hpp's panels take eight or
// more). Over a q4 cache the
// scores take decode_q4.hpp's int8 queries (q4_dot_rows_avx2): `vpmaddubsw` on the stored
// nibbles, as the AVX-512 q4 products take `vpdpbusd`.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "mha/kernels/decode_q4.hpp"
#include "mha/kernels/quantized_cache.hpp"

namespace mha::detail {

// Whether dot_rows_avx2 and value_rows_avx2 run here, for heads of depth D and Dv, in place of
// the AVX-512 register blocks (which the decoding kernel takes where the CPU has them).
inline bool decode_blocks_avx2_available(Index depth, Index value_dim) {
#ifdef MHA_PACKED_GEMM_X86
  return cpu_has_avx2_fma() && !cpu_has_avx512f() && depth % kQuantBlock == 0 &&
         value_dim % kQuantBlock == 0;
#else
  arguments_unused(depth, value_dim);
  return false;
#endif
}

// Whether the decoding kernel rounds each query row of a head to int8 codes over a q4 cache
// (decode_q4.hpp's products with AVX-512, q4_dot_rows_avx2 with AVX2).
inline bool q4_queries_rounded(Index depth, Index value_dim) {
  return q4_products_available(depth, value_dim) || decode_blocks_avx2_available(depth, value_dim);
}

// Bytes of one query row as q4_dot_block_avx2 reads it: per block, its 32 int8 codes, then each
// int32 lane's starting value -8 Σ q_i over the four codes it multiplies, as a float (32 bytes);
// after the blocks, the row's scale (padded to 32 bytes).
inline Index q4_query_row_bytes_avx2(Index depth) {
  return depth / kQuantBlock * 64 + 32;
}

// Query row q [depth] rounded to int8 (query_row_scale, quantize_query_values: the rounding of
// decode_q4.hpp's products) into `out`, q4_query_row_bytes_avx2(depth) bytes.
inline void prepare_q4_query_avx2(const float* q, Index depth, std::int8_t* out) {
  float inverse = 0.0F;
  const float scale = query_row_scale(q, depth, inverse);
  for (Index b = 0; b < depth / kQuantBlock; ++b) {
    std::int8_t* codes = out + 64 * b;
    quantize_query_values(q + b * kQuantBlock, kQuantBlock, inverse, codes);
    for (Index lane = 0; lane < 8; ++lane) {
      std::int32_t start = 0;
      for (Index i = 0; i < 4; ++i) start -= 8 * codes[4 * lane + i];
      const auto exact = static_cast<float>(start);  // (|start| <= 4064)
      std::memcpy(codes + 32 + 4 * lane, &exact, sizeof(exact));
    }
  }
  std::memcpy(out + depth / kQuantBlock * 64, &scale, sizeof(scale));
}

#ifdef MHA_PACKED_GEMM_X86
// The block kQuantizedRowsAhead rows after `block` requested from memory now, as QuantizedRows
// requests what it loads: the blocks below walk a head's slice of a few rows at a time, an order
// the hardware's prefetchers do not follow. (As an address only, never dereferenced.)
__attribute__((target("avx2"), always_inline)) inline void request_ahead_avx2(const void* block,
                                                                              Index stride_bytes) {
  const std::uintptr_t ahead = reinterpret_cast<std::uintptr_t>(block) +
                               static_cast<std::uintptr_t>(kQuantizedRowsAhead * stride_bytes);
  // NOLINTNEXTLINE(performance-no-int-to-ptr): an address to prefetch, never dereferenced
  _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
}

// Block b of a row (its values [32 b, 32 b + 32)) as 4 packets of 8: a quantized block's codes
// widened, a float row's values as they are.
template <class Block>
__attribute__((target("avx2"), always_inline)) inline void load_block_avx2(const Block* row,
                                                                           Index b,
                                                                           __m256 (&out)[4]) {
  widen_block_avx2(row[b], out);
}
__attribute__((target("avx2"), always_inline)) inline void load_block_avx2(const float* row,
                                                                           Index b,
                                                                           __m256 (&out)[4]) {
  MHA_UNROLL
  for (Index i = 0; i < 4; ++i) out[i] = _mm256_loadu_ps(row + kQuantBlock * b + 8 * i);
}

// Half block h of a row (its values [16 h, 16 h + 16)) as 2 packets of 8.
template <class Block>
__attribute__((target("avx2"), always_inline)) inline void load_half_block_avx2(const Block* row,
                                                                                Index h,
                                                                                __m256 (&out)[2]) {
  const Block& block = row[h / 2];
  widen_half_block_avx2(block, h % 2, broadcast_scale_avx2(block.scale), out);
}
__attribute__((target("avx2"), always_inline)) inline void load_half_block_avx2(const float* row,
                                                                                Index h,
                                                                                __m256 (&out)[2]) {
  out[0] = _mm256_loadu_ps(row + 16 * h);
  out[1] = _mm256_loadu_ps(row + 16 * h + 8);
}

// Block b of the row kQuantizedRowsAhead rows after `row` (stride_bytes apart) requested from
// memory now: a quantized block's line, a float block's two.
template <class Block>
__attribute__((target("avx2"), always_inline)) inline void request_block_ahead_avx2(
    const Block* row, Index b, Index stride_bytes) {
  request_ahead_avx2(row + b, stride_bytes);
}
__attribute__((target("avx2"), always_inline)) inline void request_block_ahead_avx2(
    const float* row, Index b, Index stride_bytes) {
  request_ahead_avx2(row + kQuantBlock * b, stride_bytes);
  request_ahead_avx2(row + kQuantBlock * b + 16, stride_bytes);
}

// The sums across lanes of eight packets, in one: lane i holds the sum of v[i].
__attribute__((target("avx2"), always_inline)) inline __m256 reduce_eight(const __m256 (&v)[8]) {
  const __m256 low = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 high = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // Lane i of `low` (i < 4) holds part of v[i]'s sum, lane 4 + i the rest; so for `high`.
  return _mm256_permute2f128_ps(low, high, 0x20) + _mm256_permute2f128_ps(low, high, 0x31);
}

// out[r · out_stride + j] = scale · q_r · key_j for r < Rows, j < valid (at most Keys): q's rows
// `depth` floats apart, the keys' values from column `column` of rows `stride` blocks (a float
// row's: floats) apart. A key past `valid` repeats the last one (its sums are not stored). Each
// (row, key) sums in its own register, Rows · Keys <= 8 of them, across lanes once per block.
template <Index Rows, Index Keys, class Block>
__attribute__((target("avx2,fma"), always_inline)) inline void dot_block_avx2(
    Index depth, const float* q, const Block* keys, Index stride, Index column, Index valid,
    float scale, float* out, Index out_stride) {
  static_assert(Rows * Keys <= 8, "a block's sums fill at most 8 packets");
  __m256 sums[8];
  MHA_UNROLL
  for (__m256& sum : sums) sum = _mm256_setzero_ps();
  const Block* key[Keys];
  MHA_UNROLL
  for (Index j = 0; j < Keys; ++j) key[j] = keys + std::min<Index>(j, valid - 1) * stride;
  const auto stride_bytes = static_cast<Index>(sizeof(Block)) * stride;
  const Index first = column / kQuantBlock;
  for (Index b = 0; b < depth / kQuantBlock; ++b) {
    MHA_UNROLL
    for (Index j = 0; j < Keys; ++j) {
      request_block_ahead_avx2(key[j], first + b, stride_bytes);
      __m256 k[4];
      load_block_avx2(key[j], first + b, k);
      MHA_UNROLL
      for (Index i = 0; i < 4; ++i) {
        MHA_UNROLL
        for (Index r = 0; r < Rows; ++r) {
          __m256& sum = sums[r * Keys + j];
          sum =
              _mm256_fmadd_ps(_mm256_loadu_ps(q + r * depth + b * kQuantBlock + 8 * i), k[i], sum);
        }
      }
    }
  }
  alignas(32) float result[8];
  _mm256_store_ps(result, _mm256_set1_ps(scale) * reduce_eight(sums));
  for (Index r = 0; r < Rows; ++r) {
    for (Index j = 0; j < std::min(Keys, valid); ++j)
      out[r * out_stride + j] = result[r * Keys + j];
  }
}

template <Index Rows, Index Keys, class Block>
__attribute__((target("avx2,fma"), noinline)) void dot_rows_of_avx2(
    const float* q, const Block* keys, Index stride, Index column, Index count, Index depth,
    float scale, float* scores, Index score_stride) {
  for (Index j = 0; j < count; j += Keys) {
    dot_block_avx2<Rows, Keys>(depth, q, keys + j * stride, stride, column,
                               std::min(Keys, count - j), scale, scores + j, score_stride);
  }
}

// out[r · out_stride + j] = q_r · key_j · factors lane r · Keys + j, for r < Rows and j < valid (at
// most Keys): q as prepare_q4_query_avx2 left each row (row_bytes apart), the keys' blocks from
// `keys` (the head's first), rows `stride` blocks apart. Per block,
// `vpmaddubsw` multiplies the stored nibbles (unsigned, values 0-15 of the block in the low half of
// a register, 16-31 in the high) by the query's codes, `vpmaddwd` sums pairs of those into int32
// lanes (exact: at most 4 · 15 · 127), and the lanes' starting values take the offset of 8 out (in
// float, exactly); then each (row, key) sums the lanes times the key block's scale in its own
// register, across lanes once.
template <Index Rows, Index Keys>
__attribute__((target("avx2,fma"), always_inline)) inline void q4_dot_block_avx2(
    Index blocks, const std::int8_t* q, Index row_bytes, const Q4Block* keys, Index stride,
    Index valid, __m256 factors, float* out, Index out_stride) {
  static_assert(Rows * Keys <= 8, "a block's sums fill at most 8 packets");
  __m256 sums[8];
  MHA_UNROLL
  for (__m256& sum : sums) sum = _mm256_setzero_ps();
  const Q4Block* key[Keys];
  MHA_UNROLL
  for (Index j = 0; j < Keys; ++j) key[j] = keys + std::min<Index>(j, valid - 1) * stride;
  const auto stride_bytes = static_cast<Index>(sizeof(Q4Block)) * stride;
  const __m128i nibble = _mm_set1_epi8(0x0F);
  const __m256i pairs = _mm256_set1_epi16(1);
  for (Index b = 0; b < blocks; ++b) {
    MHA_UNROLL
    for (Index j = 0; j < Keys; ++j) {
      const Q4Block& block = key[j][b];
      request_ahead_avx2(&block, stride_bytes);
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block.codes));
      const __m256i codes = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), nibble),
                                             _mm_and_si128(bytes, nibble));
      const __m256 scale = broadcast_scale_avx2(block.scale);
      MHA_UNROLL
      for (Index r = 0; r < Rows; ++r) {
        const std::int8_t* row = q + r * row_bytes + 64 * b;
        const __m256i products =
            _mm256_maddubs_epi16(codes, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)));
        const __m256 dots = _mm256_cvtepi32_ps(_mm256_madd_epi16(products, pairs)) +
                            _mm256_loadu_ps(reinterpret_cast<const float*>(row + 32));
        __m256& sum = sums[r * Keys + j];
        sum = _mm256_fmadd_ps(dots, scale, sum);
      }
    }
  }
  alignas(32) float result[8];
  _mm256_store_ps(result, factors * reduce_eight(sums));
  for (Index r = 0; r < Rows; ++r) {
    for (Index j = 0; j < std::min(Keys, valid); ++j)
      out[r * out_stride + j] = result[r * Keys + j];
  }
}

template <Index Rows, Index Keys>
__attribute__((target("avx2,fma"), noinline)) void q4_dot_rows_of_avx2(
    const std::int8_t* q, Index row_bytes, const Q4Block* keys, Index stride, Index count,
    Index depth, float scale, float* scores, Index score_stride) {
  const Index blocks = depth / kQuantBlock;
  alignas(32) float factors[8] = {};
  for (Index r = 0; r < Rows; ++r) {
    float row_scale = 0.0F;
    std::memcpy(&row_scale, q + r * row_bytes + 64 * blocks, sizeof(row_scale));
    std::fill(factors + r * Keys, factors + (r + 1) * Keys, scale * row_scale);
  }
  const __m256 factor = _mm256_load_ps(factors);
  for (Index j = 0; j < count; j += Keys) {
    q4_dot_block_avx2<Rows, Keys>(blocks, q, row_bytes, keys + j * stride, stride,
                                  std::min(Keys, count - j), factor, scores + j, score_stride);
  }
}

// acc[r · acc_stride + c] = (first ? 0 : acc) + Σ_j p[r · p_stride + j] · value_j[column + c] for
// r < Rows, c < 16 · Halves, j < count: the value rows `stride` blocks (a float row's: floats)
// apart, `column` a multiple of 16 (a half block's first; of 32 where Halves is even). Each value
// widened once for every row of the block; Rows · 2 · Halves <= 8 sums in registers.
template <Index Rows, Index Halves, class Block>
__attribute__((target("avx2,fma"), noinline)) void value_block_avx2(const float* p, Index p_stride,
                                                                    const Block* values,
                                                                    Index stride, Index column,
                                                                    Index count, bool first,
                                                                    float* acc, Index acc_stride) {
  constexpr Index kPackets = 2 * Halves;  // of each row
  static_assert(Rows * kPackets <= 8, "a block's sums fill at most 8 packets");
  __m256 sums[Rows * kPackets];
  MHA_UNROLL
  for (Index i = 0; i < Rows * kPackets; ++i) {
    sums[i] = first ? _mm256_setzero_ps()
                    : _mm256_loadu_ps(acc + i / kPackets * acc_stride + 8 * (i % kPackets));
  }
  const auto stride_bytes = static_cast<Index>(sizeof(Block)) * stride;
  const Index first_half = column / 16;
  for (Index j = 0; j < count; ++j) {
    const Block* row = values + j * stride;
    __m256 weights[Rows];
    MHA_UNROLL
    for (Index r = 0; r < Rows; ++r) weights[r] = _mm256_broadcast_ss(p + r * p_stride + j);
    // Whole blocks where the halves pair up (a block's scale broadcast once), else one half.
    constexpr Index kWidened = Halves % 2 == 0 ? 2 : 1;  // halves at a time
    MHA_UNROLL
    for (Index h = 0; h < Halves; h += kWidened) {
      request_block_ahead_avx2(row, (first_half + h) / 2, stride_bytes);
      __m256 v[2 * kWidened];
      if constexpr (kWidened == 2) {
        load_block_avx2(row, (first_half + h) / 2, v);
      } else {
        load_half_block_avx2(row, first_half + h, v);
      }
      MHA_UNROLL
      for (Index i = 0; i < 2 * kWidened; ++i) {
        MHA_UNROLL
        for (Index r = 0; r < Rows; ++r) {
          __m256& sum = sums[r * kPackets + 2 * h + i];
          sum = _mm256_fmadd_ps(weights[r], v[i], sum);
        }
      }
    }
  }
  MHA_UNROLL
  for (Index i = 0; i < Rows * kPackets; ++i) {
    _mm256_storeu_ps(acc + i / kPackets * acc_stride + 8 * (i % kPackets), sums[i]);
  }
}

// value_block_avx2 for `Rows` rows across value_dim columns: Halves half blocks at a
// time, then one.
template <Index Rows, Index Halves, class Block>
inline void value_columns_avx2(const float* p, Index p_stride, const Block* values, Index stride,
                               Index column, Index count, Index value_dim, bool first, float* acc,
                               Index acc_stride) {
  Index c = 0;
  for (; c + 16 * Halves <= value_dim; c += 16 * Halves) {
    value_block_avx2<Rows, Halves>(p, p_stride, values, stride, column + c, count, first, acc + c,
                                   acc_stride);
  }
  for (; c < value_dim; c += 16) {
    value_block_avx2<Rows, 1>(p, p_stride, values, stride, column + c, count, first, acc + c,
                              acc_stride);
  }
}

// call(Rows, Keys, r) for the score blocks that cover `rows` rows, Rows and Keys as
// std::integral_constant: 4 rows × 2 keys, then 2 × 4 and 1 × 8 (8 sums each).
template <class Call>
void for_score_blocks_avx2(Index rows, Call&& call) {
  Index r = 0;
  for (; r + 4 <= rows; r += 4)
    call(std::integral_constant<Index, 4>{}, std::integral_constant<Index, 2>{}, r);
  for (; r + 2 <= rows; r += 2)
    call(std::integral_constant<Index, 2>{}, std::integral_constant<Index, 4>{}, r);
  if (r < rows) call(std::integral_constant<Index, 1>{}, std::integral_constant<Index, 8>{}, r);
}
#endif

// scores[r · score_stride + j] = scale · q_r · key_j for r < rows, j < count: q's rows `depth`
// floats apart; the keys' values from column `column` of rows `stride` blocks (a float row's:
// floats) apart. Blocks of 4 rows × 2 keys, then 2 × 4 and 1 × 8. Only where
// decode_blocks_avx2_available().
template <class Block>
void dot_rows_avx2(const float* q, Index rows, const Block* keys, Index stride, Index column,
                   Index count, Index depth, float scale, float* scores, Index score_stride) {
#ifdef MHA_PACKED_GEMM_X86
  for_score_blocks_avx2(rows, [&](auto block_rows, auto keys_a_block, Index r) {
    dot_rows_of_avx2<block_rows, keys_a_block>(q + r * depth, keys, stride, column, count, depth,
                                               scale, scores + r * score_stride, score_stride);
  });
#else
  arguments_unused(q, rows, keys, stride, column, count, depth, scale, scores, score_stride);
#endif
}

// scores[r · score_stride + j] = scale · q_r · key_j for r < rows, j < count over a q4 cache: q as
// prepare_q4_query_avx2 left each row (row_bytes apart), the keys' blocks from `keys`, rows
// `stride` blocks apart. Blocks of 4 rows × 2 keys, then 2 × 4 and 1 × 8.
// Only where decode_blocks_avx2_available().
inline void q4_dot_rows_avx2(const std::int8_t* q, Index row_bytes, Index rows, const Q4Block* keys,
                             Index stride, Index count, Index depth, float scale, float* scores,
                             Index score_stride) {
#ifdef MHA_PACKED_GEMM_X86
  for_score_blocks_avx2(rows, [&](auto block_rows, auto keys_a_block, Index r) {
    q4_dot_rows_of_avx2<block_rows, keys_a_block>(q + r * row_bytes, row_bytes, keys, stride, count,
                                                  depth, scale, scores + r * score_stride,
                                                  score_stride);
  });
#else
  arguments_unused(q, row_bytes, rows, keys, stride, count, depth, scale, scores, score_stride);
#endif
}

// acc[r · acc_stride + c] = (first ? 0 : acc) + Σ_j p[r · p_stride + j] · value_j[column + c] for
// r < rows, c < value_dim, j < count: the value rows `stride` blocks (a float row's: floats) apart.
// Blocks of 4 rows × 16 columns, then 2 × 32 and 1 × 64. Only where decode_blocks_avx2_available().
template <class Block>
void value_rows_avx2(const float* p, Index p_stride, Index rows, const Block* values, Index stride,
                     Index column, Index count, Index value_dim, bool first, float* acc,
                     Index acc_stride) {
#ifdef MHA_PACKED_GEMM_X86
  Index r = 0;
  for (; r + 4 <= rows; r += 4) {
    value_columns_avx2<4, 1>(p + r * p_stride, p_stride, values, stride, column, count, value_dim,
                             first, acc + r * acc_stride, acc_stride);
  }
  for (; r + 2 <= rows; r += 2) {
    value_columns_avx2<2, 2>(p + r * p_stride, p_stride, values, stride, column, count, value_dim,
                             first, acc + r * acc_stride, acc_stride);
  }
  if (r < rows) {
    value_columns_avx2<1, 4>(p + r * p_stride, p_stride, values, stride, column, count, value_dim,
                             first, acc + r * acc_stride, acc_stride);
  }
#else
  arguments_unused(p, p_stride, rows, values, stride, column, count, value_dim, first, acc,
                   acc_stride);
#endif
}

}  // namespace mha::detail
