// The decoding kernel's two products over a q4 cache (KVCacheFormat::q4, quantized_cache.hpp's
// Q4Block rows) where the CPU has AVX-512 VNNI, BF16 and VBMI, for heads whose D and Dv are whole
// blocks (multiples of 32):
//   scores [rows, count] = scale · q [rows, D] · keys [count, D]ᵀ      (q4_scaled_dot_rows)
//   acc [rows, Dv] (= or +=) p [rows, count] · values [count, Dv]      (q4_value_rows)
// The same products as decode_products.hpp's register blocks over QuantizedRows, which widen
// every code to a float and so spend more operations per cached value than the float cache's
// FMAs: there a q4 step was bound by its arithmetic, not by its bytes (bench/RESULTS.md,
// 2026-12-06). Here:
//   - Scores: each query row is rounded to int8 once per task, one scale per row (max |q| / 127;
//     llama.cpp likewise rounds the query to q8_0 for a q4_0 key cache), and `vpdpbusd`
//     multiplies the codes as they are stored (nibbles c in [0, 15], unsigned) by the query's
//     codes, four pairs a lane: per block, scale_k · Σ q_i (c_i - 8) = scale_k · (Σ q_i c_i - 8 Σ
//     q_i), the second sum the first one's starting value, formed with the query. Integer sums
//     are exact; a head's codes (up to four blocks) reach a register by one byte permutation.
//   - Values: each (row, key, value block) weight p · scale is rounded to bfloat16 once per
//     sub-block (q4_value_weights), and `vdpbf16ps` multiplies it by the codes' levels c - 8
//     (exact in bfloat16, looked up by `vpermw`), two keys a lane.
// Two roundings change the arithmetic, each small beside the cache's own (a value within 1/14 of
// its block's largest magnitude): each query element within half its row's scale (1/254 of the
// row's largest magnitude), and each weight within 2^-8 of itself (docs/precision.md states the
// resulting error; tests/test_decode.cpp checks both against double).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "mha/kernels/bf16_gemm.hpp"
#include "mha/kernels/decode_products.hpp"
#include "mha/kernels/int8_gemm.hpp"
#include "mha/kernels/quantized_cache.hpp"

namespace mha::detail {

// Blocks of a head that one register of codes holds (64 bytes: four blocks' 16 bytes of codes).
constexpr Index kQ4BlocksPerGroup = 4;
// One quantized query row's bytes per group of kQ4BlocksPerGroup blocks: the codes of each
// block's values 0-15 (64 bytes), of its values 16-31 (64), then each int32 lane's starting value
// -8 Σ q_i (64).
constexpr Index kQ4QueryGroupBytes = 192;

// Whether q4_scaled_dot_rows and q4_value_rows run here, for heads of depth D and Dv.
inline bool q4_products_available(Index depth, Index value_dim) {
#ifdef MHA_PACKED_GEMM_X86
  static const bool has = int8_dot_available() && bf16_dot_available() &&
                          __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vbmi");
  return has && depth % kQuantBlock == 0 && value_dim % kQuantBlock == 0;
#else
  arguments_unused(depth, value_dim);
  return false;
#endif
}

inline Index q4_groups(Index depth) {
  return (depth / kQuantBlock + kQ4BlocksPerGroup - 1) / kQ4BlocksPerGroup;
}

// Cached keys (and values) per sub-block of the q4 products: the 1 × 16 blocks of scores take
// them all, and each block's weights of 16 keys are one register (q4_value_weights).
constexpr Index kQ4SubBlock = 16;

// Bytes of one quantized query row: its groups, then its scale (padded to 64 bytes).
inline Index q4_query_row_bytes(Index depth) {
  return q4_groups(depth) * kQ4QueryGroupBytes + 64;
}

// A query row's int8 scale, max |q| / 127, and in `inverse` what its values are multiplied by
// before rounding, 127 / max |q|. A row holding infinity or NaN has scale NaN; a row of zeros,
// or whose largest magnitude is below float's smallest normal number (where 127 / max |q| may
// overflow), scale 0; both inverse 0, so that their codes are 0. (Such a row's scores would be
// below that smallest normal number times D times the keys' largest magnitude.)
inline float query_row_scale(const float* q, Index depth, float& inverse) {
  float largest = 0.0F;
  bool finite = true;
  for (Index d = 0; d < depth; ++d) {
    finite = finite && std::isfinite(q[d]);
    largest = std::max(largest, std::abs(q[d]));
  }
  const bool usable = finite && largest >= std::numeric_limits<float>::min();
  inverse = usable ? 127.0F / largest : 0.0F;
  if (!finite) return std::numeric_limits<float>::quiet_NaN();
  return usable ? largest / 127.0F : 0.0F;
}

// codes[i] = q[i] · inverse rounded to nearest (ties to even), for i < count; all 0 where
// inverse is 0 (see query_row_scale).
inline void quantize_query_values(const float* q, Index count, float inverse, std::int8_t* codes) {
  if (inverse == 0.0F) {
    std::fill(codes, codes + count, std::int8_t{0});
    return;
  }
  for (Index i = 0; i < count; ++i) {
    codes[i] =
        static_cast<std::int8_t>(std::clamp(std::nearbyint(q[i] * inverse), -127.0F, 127.0F));
  }
}

#ifdef MHA_PACKED_GEMM_X86
// The byte and word permutations that take a group's blocks apart (q4_group_codes): byte i of
// the codes gathers block i / 16's code byte i % 16 (block k's 18 bytes start at 18k, its scale
// first); word 2l + 1 of the scales, block l / 4's scale (block k's at word 9k), into the top
// half of lane l, where a bfloat16 is a float.
struct Q4GroupIndices {
  alignas(64) std::uint8_t codes[64];
  alignas(64) std::uint16_t scales[32];
};

constexpr Q4GroupIndices make_q4_group_indices() {
  Q4GroupIndices indices{};
  for (int i = 0; i < 64; ++i) {
    indices.codes[i] = static_cast<std::uint8_t>(18 * (i / 16) + 2 + i % 16);
  }
  for (int w = 0; w < 32; ++w) indices.scales[w] = static_cast<std::uint16_t>(9 * (w / 8));
  return indices;
}

inline constexpr Q4GroupIndices kQ4GroupIndices = make_q4_group_indices();

// Query row q [depth] as q4_scaled_dot_rows reads it, at `out` (q4_query_row_bytes(depth)): per
// group of four blocks, block k's codes of values 0-15 at bytes 16k of the first 64, of values
// 16-31 at 16k of the next 64 (the order q4_group_codes leaves the keys' codes in), zeros past
// the head's last block; then per int32 lane of the group, -8 times the sum of the eight codes it
// multiplies; after the groups, the row's scale.
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline void prepare_q4_query(
    const float* q, Index depth, std::int8_t* out) {
  // The scale and codes of query_row_scale and quantize_query_values, sixteen values at a time
  // (the conversion rounds to nearest, ties to even, as nearbyint does).
  const __m512 infinity = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  __m512 largest = _mm512_setzero_ps();
  __mmask16 finite = 0xFFFF;
  for (Index d = 0; d < depth; d += 16) {
    const __m512 magnitude = _mm512_abs_ps(_mm512_loadu_ps(q + d));
    finite &= _mm512_cmp_ps_mask(magnitude, infinity, _CMP_LT_OQ);
    largest =
        _mm512_mask_mov_ps(largest, _mm512_cmp_ps_mask(magnitude, largest, _CMP_GT_OQ), magnitude);
  }
  const float row_largest = _mm512_reduce_max_ps(largest);
  const bool usable = finite == 0xFFFF && row_largest >= std::numeric_limits<float>::min();
  const float scale = finite != 0xFFFF ? std::numeric_limits<float>::quiet_NaN()
                      : usable         ? row_largest / 127.0F
                                       : 0.0F;
  const __m512 inverse = _mm512_set1_ps(usable ? 127.0F / row_largest : 0.0F);
  const Index blocks = depth / kQuantBlock;
  const __m512i ones = _mm512_set1_epi8(1);
  for (Index group = 0; group < q4_groups(depth); ++group) {
    std::int8_t* group_out = out + group * kQ4QueryGroupBytes;
    for (Index k = 0; k < kQ4BlocksPerGroup; ++k) {
      const Index block = group * kQ4BlocksPerGroup + k;
      for (Index half = 0; half < 2; ++half) {
        __m128i codes = _mm_setzero_si128();
        if (block < blocks && usable) {
          const __m512 x = _mm512_loadu_ps(q + block * kQuantBlock + 16 * half) * inverse;
          codes = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(x));
        }
        _mm_storeu_si128(reinterpret_cast<__m128i*>(group_out + 64 * half + 16 * k), codes);
      }
    }
    const __m512i low = _mm512_loadu_si512(group_out);
    const __m512i high = _mm512_loadu_si512(group_out + 64);
    const __m512i sums =
        _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, low), ones, high);
    _mm512_storeu_si512(group_out + 128, _mm512_mullo_epi32(sums, _mm512_set1_epi32(-8)));
  }
  std::copy_n(reinterpret_cast<const std::int8_t*>(&scale), sizeof(scale),
              out + q4_groups(depth) * kQ4QueryGroupBytes);
}

inline float q4_query_scale(const std::int8_t* row, Index depth) {
  float scale = 0.0F;
  std::copy_n(row + q4_groups(depth) * kQ4QueryGroupBytes, sizeof(scale),
              reinterpret_cast<std::int8_t*>(&scale));
  return scale;
}

// The codes of `count` (1 to 4) consecutive blocks of a row from `first`: in *low, block k's codes
// of values 0-15 at bytes 16k, in *high of values 16-31, each as its nibble c in [0, 15], zeros
// past the last block; returned, the blocks' scales, lane l holding block l / 4's (0 past the
// last). Two loads and one byte permutation for up to 128 values; the loads reach no byte past
// the blocks (masked where there are fewer than four).
__attribute__((target("avx512f,avx512bw,avx512vbmi"), always_inline)) inline __m512 q4_group_codes(
    const Q4Block* first, Index count, __m512i& low, __m512i& high) {
  const auto* bytes = reinterpret_cast<const char*>(first);
  __m512i head, tail;
  if (count == kQ4BlocksPerGroup) {
    head = _mm512_loadu_si512(bytes);
    tail = _mm512_maskz_loadu_epi8(0xFF, bytes + 64);
  } else {
    const auto valid = static_cast<__mmask64>((std::uint64_t{1} << (18 * count)) - 1);
    head = _mm512_maskz_loadu_epi8(valid, bytes);
    tail = _mm512_setzero_si512();
  }
  const __m512i codes = _mm512_permutex2var_epi8(
      head, _mm512_load_si512(static_cast<const void*>(kQ4GroupIndices.codes)), tail);
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  low = _mm512_and_si512(codes, nibble);
  high = _mm512_and_si512(_mm512_srli_epi16(codes, 4), nibble);
  return _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(
      0xAAAAAAAA, _mm512_load_si512(static_cast<const void*>(kQ4GroupIndices.scales)), head));
}

// Rows ahead that the q4 products request (q4_request_ahead): a whole sub-block, since
// q4_value_weights reads the scales of the next sub-block's rows all at once.
constexpr Index kQ4RowsAhead = kQ4SubBlock;

// The `blocks` blocks from `row`, kQ4RowsAhead rows further on, requested from memory now (see
// QuantizedRows): their first and last bytes' lines. (As an address only: it may lie
// past the cache's last row, and a prefetch does not fault.)
__attribute__((target("avx512f"), always_inline)) inline void q4_request_ahead(const Q4Block* row,
                                                                               Index stride,
                                                                               Index blocks) {
  const std::uintptr_t ahead = reinterpret_cast<std::uintptr_t>(row) +
                               static_cast<std::uintptr_t>(kQ4RowsAhead * stride) * sizeof(Q4Block);
  const auto last = static_cast<std::uintptr_t>(blocks) * sizeof(Q4Block) - 1;
  // NOLINTNEXTLINE(performance-no-int-to-ptr): addresses to prefetch, never dereferenced
  _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
  // NOLINTNEXTLINE(performance-no-int-to-ptr)
  _mm_prefetch(reinterpret_cast<const char*>(ahead + last), _MM_HINT_T0);
}

// out[r · out_stride + j] = q_r · key_j · factor lane r · Keys + j, for r < Rows and j < valid
// (at most Keys): q as prepare_q4_query left each row (row_bytes apart), the keys' first blocks
// of the head `stride` blocks apart; `factors`, the softmax's scale times each row's query scale.
// A key past `valid` repeats the last one (its scores are not stored). As decode_products.hpp's
// scaled_dot_block, each (row, key) sums in its own register, across lanes once per block.
template <Index Rows, Index Keys>
__attribute__((target("avx512f,avx512bw,avx512vbmi,avx512vnni"), always_inline)) inline void
q4_scaled_dot_block(Index depth, const std::int8_t* q, Index row_bytes, const Q4Block* keys,
                    Index stride, Index valid, __m512 factors, float* out, Index out_stride) {
  static_assert(Keys % 4 == 0 && Rows * Keys <= 16, "a block's sums fill at most 16 packets");
  const Index blocks = depth / kQuantBlock;
  __m512 sums[16];
  MHA_UNROLL
  for (__m512& sum : sums) sum = _mm512_setzero_ps();
  const Q4Block* key[Keys];
  MHA_UNROLL
  for (Index j = 0; j < Keys; ++j) {
    key[j] = keys + std::min<Index>(j, valid - 1) * stride;
    q4_request_ahead(key[j], stride, blocks);
  }
  // Groups outside, keys and rows unrolled inside: the sums stay in registers.
  for (Index group = 0; group * kQ4BlocksPerGroup < blocks; ++group) {
    const Index first = group * kQ4BlocksPerGroup;
    const Index count = std::min(kQ4BlocksPerGroup, blocks - first);
    const std::int8_t* query = q + group * kQ4QueryGroupBytes;
    MHA_UNROLL
    for (Index j = 0; j < Keys; ++j) {
      __m512i low, high;
      const __m512 scales = q4_group_codes(key[j] + first, count, low, high);
      MHA_UNROLL
      for (Index r = 0; r < Rows; ++r) {
        const std::int8_t* row = query + r * row_bytes;
        __m512i dots = _mm512_loadu_si512(row + 128);
        dots = _mm512_dpbusd_epi32(dots, low, _mm512_loadu_si512(row));
        dots = _mm512_dpbusd_epi32(dots, high, _mm512_loadu_si512(row + 64));
        __m512& sum = sums[4 * (j % 4) + r * (Keys / 4) + j / 4];
        sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), scales, sum);
      }
    }
  }
  const __m512 result = factors * reduce_sixteen(sums);
  const auto row_mask = static_cast<__mmask16>((1U << valid) - 1);
  MHA_UNROLL
  for (Index r = 0; r < Rows; ++r) {
    // (Keys floats before row r's scores lie inside `out`'s rows: out_stride >= Keys.)
    _mm512_mask_storeu_ps(out + r * (out_stride - Keys),
                          static_cast<__mmask16>(row_mask << (r * Keys)), result);
  }
}

template <Index Rows, Index Keys>
__attribute__((target("avx512f,avx512bw,avx512vbmi,avx512vnni"), noinline)) void
q4_scaled_dot_rows_of(const std::int8_t* q, Index row_bytes, const Q4Block* keys, Index stride,
                      Index count, Index depth, float scale, float* scores, Index score_stride) {
  alignas(64) float factors[16] = {};
  for (Index r = 0; r < Rows; ++r) {
    const float row_scale = scale * q4_query_scale(q + r * row_bytes, depth);
    std::fill(factors + r * Keys, factors + (r + 1) * Keys, row_scale);
  }
  const __m512 factor = _mm512_load_ps(factors);
  for (Index j = 0; j < count; j += Keys) {
    q4_scaled_dot_block<Rows, Keys>(depth, q, row_bytes, keys + j * stride, stride,
                                    std::min<Index>(Keys, count - j), factor, scores + j,
                                    score_stride);
  }
}

// weights[(r · blocks + b) · kQ4SubBlock + j] = p[r · p_stride + j] · the scale of value row j's
// block b, rounded to bfloat16, for r < rows, j < count (at most kQ4SubBlock; 0 for j from
// count to kQ4SubBlock), b < blocks: the value rows' blocks of a head from `values`, rows
// `stride` blocks apart. The scales of 16 rows' block b by one gather.
__attribute__((target("avx512f,avx512bf16"))) inline void q4_value_weights(
    const float* p, Index p_stride, Index rows, const Q4Block* values, Index stride, Index count,
    Index blocks, std::uint16_t* weights) {
  const auto valid = static_cast<__mmask16>((1U << count) - 1);
  const __m512i offsets = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(static_cast<int>(stride * static_cast<Index>(sizeof(Q4Block)))));
  for (Index b = 0; b < blocks; ++b) {
    // Each row's scale and first code byte pair, the scale shifted into the top half.
    const __m512i words =
        _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, offsets, values + b, 1);
    const __m512 scales = _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
    for (Index r = 0; r < rows; ++r) {
      const __m256bh rounded =
          _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(valid, p + r * p_stride) * scales);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(weights + (r * blocks + b) * kQ4SubBlock),
                          reinterpret_cast<const __m256i&>(rounded));
    }
  }
}

// The levels c - 8 of a q4 code c as bfloat16 (exact), for `vpermw`, which reads the low five
// bits of each index: entry i is (i mod 16) - 8, so that a byte's high nibble above its low one
// does not change the lookup.
struct Q4Levels {
  alignas(64) std::uint16_t bf16[32];
};

constexpr Q4Levels make_q4_levels() {
  Q4Levels levels{};
  // bfloat16 bits of -8 to 7: sign, exponent and the top mantissa bits of each small integer.
  constexpr std::uint16_t kBits[16] = {0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040,
                                       0xC000, 0xBF80, 0x0000, 0x3F80, 0x4000, 0x4040,
                                       0x4080, 0x40A0, 0x40C0, 0x40E0};
  for (int i = 0; i < 32; ++i) levels.bf16[i] = kBits[i % 16];
  return levels;
}

inline constexpr Q4Levels kQ4Levels = make_q4_levels();

// acc[r · acc_stride + c] = (first ? 0 : acc) + Σ_j weight(r, j, b) · level(value row j, c), for r
// < Rows and c < 32 · Blocks (b = c / 32), j < count: the value rows' blocks from `values`, rows
// `stride` blocks apart; weights as q4_value_weights leaves them for this block's first row and
// block (rows blocks · kQ4SubBlock apart). Keys in pairs, `vdpbf16ps` multiplying each lane's
// two levels (one column of two value rows) by the pair's two weights: each block's codes of
// two rows interleaved byte by byte, widened to words and looked up as bfloat16 levels, once
// for all the block's rows. An odd count pairs the last row with itself, at weight 0.
template <Index Rows, Index Blocks>
__attribute__((target("avx512f,avx512bw,avx512bf16"), always_inline)) inline void q4_value_block(
    Index count, const std::uint16_t* weights, Index weight_row_stride, const Q4Block* values,
    Index stride, bool first, float* acc, Index acc_stride) {
  static_assert(Rows * Blocks <= 8, "a block's sums fill at most 16 registers");
  const __m512i levels = _mm512_load_si512(static_cast<const void*>(kQ4Levels.bf16));
  // Sum i: row i / (2 · Blocks), columns 16 · (i mod 2 · Blocks) on (two packets a block).
  constexpr Index kPackets = 2 * Blocks;
  __m512 sums[Rows * kPackets];
  const auto sums_at = [&](Index i) {
    return acc + i / kPackets * acc_stride + 16 * (i % kPackets);
  };
  MHA_UNROLL
  for (Index i = 0; i < Rows * kPackets; ++i) {
    sums[i] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(sums_at(i));
  }
  for (Index j = 0; j < count; j += 2) {
    const Q4Block* row = values + j * stride;
    const Q4Block* next = values + std::min(j + 1, count - 1) * stride;
    q4_request_ahead(row, stride, Blocks);
    q4_request_ahead(next, stride, Blocks);
    MHA_UNROLL
    for (Index b = 0; b < Blocks; ++b) {
      const __m128i one = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row[b].codes));
      const __m128i two = _mm_loadu_si128(reinterpret_cast<const __m128i*>(next[b].codes));
      // Word 2c: row j's byte c, word 2c + 1: row j + 1's (values c and 16 + c in its nibbles).
      const __m512i bytes = _mm512_cvtepu8_epi16(
          _mm256_set_m128i(_mm_unpackhi_epi8(one, two), _mm_unpacklo_epi8(one, two)));
      const auto low = reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(bytes, levels));
      const auto high =
          reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), levels));
      MHA_UNROLL
      for (Index r = 0; r < Rows; ++r) {
        std::uint32_t pair = 0;
        std::memcpy(&pair, weights + r * weight_row_stride + b * kQ4SubBlock + j, sizeof(pair));
        const auto weight = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pair)));
        __m512& low_sum = sums[r * kPackets + 2 * b];
        __m512& high_sum = sums[r * kPackets + 2 * b + 1];
        low_sum = _mm512_dpbf16_ps(low_sum, low, weight);
        high_sum = _mm512_dpbf16_ps(high_sum, high, weight);
      }
    }
  }
  MHA_UNROLL
  for (Index i = 0; i < Rows * kPackets; ++i) _mm512_storeu_ps(sums_at(i), sums[i]);
}

// q4_value_block for `Rows` rows across a head of `blocks` blocks: Blocks at a time, then one.
template <Index Rows, Index Blocks>
__attribute__((target("avx512f,avx512bw,avx512bf16"), noinline)) void q4_value_rows_of(
    Index count, const std::uint16_t* weights, Index blocks, const Q4Block* values, Index stride,
    bool first, float* acc, Index acc_stride) {
  const Index weight_row_stride = blocks * kQ4SubBlock;
  Index b = 0;
  for (; b + Blocks <= blocks; b += Blocks) {
    q4_value_block<Rows, Blocks>(count, weights + b * kQ4SubBlock, weight_row_stride, values + b,
                                 stride, first, acc + b * kQuantBlock, acc_stride);
  }
  for (; b < blocks; ++b) {
    q4_value_block<Rows, 1>(count, weights + b * kQ4SubBlock, weight_row_stride, values + b, stride,
                            first, acc + b * kQuantBlock, acc_stride);
  }
}
#endif

// scores[r · score_stride + j] = scale · q_r · key_j for r < rows, j < count: q as
// prepare_q4_query left each row (row_bytes apart), the keys' first blocks of the head `stride`
// blocks apart. Blocks of 4 rows × 4 keys, then 3 × 4, 2 × 8 or 1 × 16. Only where
// q4_products_available().
inline void q4_scaled_dot_rows(const std::int8_t* q, Index row_bytes, Index rows,
                               const Q4Block* keys, Index stride, Index count, Index depth,
                               float scale, float* scores, Index score_stride) {
#ifdef MHA_PACKED_GEMM_X86
  Index r = 0;
  for (; r + 4 <= rows; r += 4) {
    q4_scaled_dot_rows_of<4, 4>(q + r * row_bytes, row_bytes, keys, stride, count, depth, scale,
                                scores + r * score_stride, score_stride);
  }
  const std::int8_t* q_left = q + r * row_bytes;
  float* scores_left = scores + r * score_stride;
  if (rows - r == 3) {
    q4_scaled_dot_rows_of<3, 4>(q_left, row_bytes, keys, stride, count, depth, scale, scores_left,
                                score_stride);
  } else if (rows - r == 2) {
    q4_scaled_dot_rows_of<2, 8>(q_left, row_bytes, keys, stride, count, depth, scale, scores_left,
                                score_stride);
  } else if (rows - r == 1) {
    q4_scaled_dot_rows_of<1, 16>(q_left, row_bytes, keys, stride, count, depth, scale, scores_left,
                                 score_stride);
  }
#else
  arguments_unused(q, row_bytes, rows, keys, stride, count, depth, scale, scores, score_stride);
#endif
}

// acc[r · acc_stride + c] = (first ? 0 : acc) + Σ_j p[r · p_stride + j] · values_j[c] for r <
// rows, c < value_dim, j < count (at most kQ4SubBlock): the value rows' first blocks of the head
// `stride` blocks apart; `weights`, room for rows · value_dim / 2 bfloat16. Blocks of 4 rows × 2
// value blocks, then 3 × 2, 2 × 4 or 1 × 4. Only where q4_products_available().
inline void q4_value_rows(const float* p, Index p_stride, Index rows, const Q4Block* values,
                          Index stride, Index count, Index value_dim, bool first,
                          std::uint16_t* weights, float* acc, Index acc_stride) {
#ifdef MHA_PACKED_GEMM_X86
  const Index blocks = value_dim / kQuantBlock;
  q4_value_weights(p, p_stride, rows, values, stride, count, blocks, weights);
  const Index weight_row_stride = blocks * kQ4SubBlock;
  Index r = 0;
  for (; r + 4 <= rows; r += 4) {
    q4_value_rows_of<4, 2>(count, weights + r * weight_row_stride, blocks, values, stride, first,
                           acc + r * acc_stride, acc_stride);
  }
  const std::uint16_t* weights_left = weights + r * weight_row_stride;
  float* acc_left = acc + r * acc_stride;
  if (rows - r == 3) {
    q4_value_rows_of<3, 2>(count, weights_left, blocks, values, stride, first, acc_left,
                           acc_stride);
  } else if (rows - r == 2) {
    q4_value_rows_of<2, 4>(count, weights_left, blocks, values, stride, first, acc_left,
                           acc_stride);
  } else if (rows - r == 1) {
    q4_value_rows_of<1, 4>(count, weights_left, blocks, values, stride, first, acc_left,
                           acc_stride);
  }
#else
  arguments_unused(p, p_stride, rows, values, stride, count, value_dim, first, weights, acc,
                   acc_stride);
#endif
}

}  // namespace mha::detail
