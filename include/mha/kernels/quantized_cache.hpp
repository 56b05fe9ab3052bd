// Quantized KV cache rows (KVCacheFormat::q8 and q4, kv_cache.hpp): each cached row of H_kv·D
// keys or values is cut into blocks of kQuantBlock = 32 consecutive values, each stored as small
// integer codes and one scale, llama.cpp's q8_0 and q4_0 layout:
//   Q8Block  value = scale · code,        code in [-127, 127]   34 bytes per 32 values
//   Q4Block  value = scale · (code - 8),  code - 8 in [-7, 7]    18 bytes per 32 values
// against 64 bytes for 32 values of a 16-bit cache and 128 of a float one. Symmetric, rounded to
// nearest: scale = max |value| / 127 (q8) or / 7 (q4), so that every value is within scale / 2 of
// what it stands for. The scale is a bfloat16 rounded up (where llama.cpp keeps a half): a
// float's range, so that no finite block overflows or flushes its scale, and rounded up so that
// no code leaves its range. A block holding infinity or NaN dequantizes to NaN, as those values
// would make the attention's output NaN in a float cache. (A block whose largest magnitude is
// within 2^-7 of float's largest may read back as infinity.)
//
// A decoding step quantizes its new rows once (quantize_rows). With AVX-512 the decoding kernel's
// register blocks read the codes and widen them in registers, 16 values at a time
// (QuantizedRows), and with AVX2 alone 8 at a time (decode_avx2.hpp); elsewhere it
// widens a sub-block of rows into a float tile in L1 (dequantize_rows) before its products, as it
// widens a 16-bit cache. Every code times its scale is exact in float (at most 7 + 8 significant
// bits), so the vector paths and the scalar one give the same floats.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "mha/kernels/common.hpp"
#include "mha/kernels/packed_gemm.hpp"

namespace mha::detail {

constexpr Index kQuantBlock = 32;

struct Q8Block {
  std::uint16_t scale;  // bfloat16 bits
  std::int8_t codes[kQuantBlock];
};

struct Q4Block {
  std::uint16_t scale;  // bfloat16 bits
  // Value i's code in the low four bits of byte i, value 16 + i's in the high four.
  std::uint8_t codes[kQuantBlock / 2];
};

static_assert(sizeof(Q8Block) == 34 && sizeof(Q4Block) == 18, "blocks are packed as llama.cpp's");

template <class Stored>
constexpr bool is_quantized_block_v =
    std::is_same_v<Stored, Q8Block> || std::is_same_v<Stored, Q4Block>;

// The largest code's magnitude: a block's scale is its largest |value| over this.
template <class Block>
constexpr float largest_code() {
  return std::is_same_v<Block, Q8Block> ? 127.0F : 7.0F;
}

inline float bf16_bits_to_float(std::uint16_t bits) {
  const std::uint32_t wide = std::uint32_t{bits} << 16U;
  float value = 0.0F;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

// The smallest bfloat16 at or above `scale` (finite, >= 0).
inline std::uint16_t bf16_bits_rounded_up(float scale) {
  std::uint32_t bits = 0;
  std::memcpy(&bits, &scale, sizeof(bits));
  if ((bits & 0xFFFFU) != 0) bits += 0x10000U;
  return static_cast<std::uint16_t>(bits >> 16U);
}

// A block's scale: its largest magnitude over the largest code, rounded up to a bfloat16 (the
// smallest positive one where that quotient underflows to 0, so that no value but 0 reads as 0).
inline std::uint16_t block_scale_bits(float largest, float levels) {
  if (largest == 0.0F) return 0;
  return std::max<std::uint16_t>(bf16_bits_rounded_up(largest / levels), 1);
}

constexpr std::uint16_t kBf16QuietNan = 0x7FC0;

// 32 values x into `block`.
template <class Block>
void quantize_block(const float* x, Block& block) {
  float largest = 0.0F;
  bool finite = true;
  for (Index i = 0; i < kQuantBlock; ++i) {
    finite = finite && std::isfinite(x[i]);
    largest = std::max(largest, std::abs(x[i]));
  }
  std::int8_t codes[kQuantBlock] = {};
  block.scale = finite ? block_scale_bits(largest, largest_code<Block>()) : kBf16QuietNan;
  const float scale = bf16_bits_to_float(block.scale);
  // A block of zeros (scale 0) keeps codes 0; so does NaN.
  if (finite && scale > 0.0F) {
    for (Index i = 0; i < kQuantBlock; ++i) {
      const float level = std::nearbyint(x[i] / scale);
      codes[i] = static_cast<std::int8_t>(
          std::clamp(level, -largest_code<Block>(), largest_code<Block>()));
    }
  }
  if constexpr (std::is_same_v<Block, Q8Block>) {
    std::copy(codes, codes + kQuantBlock, block.codes);
  } else {
    for (Index i = 0; i < kQuantBlock / 2; ++i) {
      const auto low = static_cast<unsigned>(codes[i] + 8);
      const auto high = static_cast<unsigned>(codes[i + kQuantBlock / 2] + 8);
      block.codes[i] = static_cast<std::uint8_t>(low | (high << 4U));
    }
  }
}

// The value a block's code i stands for: code times scale (code - 8 for q4).
template <class Block>
float dequantized(const Block& block, Index i) {
  const float scale = bf16_bits_to_float(block.scale);
  if constexpr (std::is_same_v<Block, Q8Block>) {
    return scale * static_cast<float>(block.codes[i]);
  } else {
    const unsigned byte = block.codes[i % (kQuantBlock / 2)];
    const unsigned code = i < kQuantBlock / 2 ? byte & 0xFU : byte >> 4U;
    return scale * static_cast<float>(static_cast<int>(code) - 8);
  }
}

// src [rows, width] (rows contiguous; width a multiple of kQuantBlock) into dst, rows of
// width / kQuantBlock blocks, contiguous.
template <class Block>
void quantize_rows(const float* src, Index rows, Index width, Block* dst) {
  for (Index i = 0; i < rows * width / kQuantBlock; ++i)
    quantize_block(src + i * kQuantBlock, dst[i]);
}

#ifdef MHA_PACKED_GEMM_X86
// Sixteen 4-bit codes (bytes 0 to 15) as the signed values they stand for, code - 8: a table
// lookup by pshufb.
__attribute__((target("ssse3"), always_inline)) inline __m128i minus_eight(__m128i codes) {
  const __m128i table = _mm_setr_epi8(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  return _mm_shuffle_epi8(table, codes);
}

// One block's 32 values into out, by 16-lane conversions.
__attribute__((target("avx512f"), always_inline)) inline void dequantize_block_avx512(
    const Q8Block& block, float* out) {
  const __m512 scale = _mm512_set1_ps(bf16_bits_to_float(block.scale));
  for (Index half = 0; half < 2; ++half) {
    const __m128i codes =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(block.codes + 16 * half));
    _mm512_storeu_ps(out + 16 * half, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes)) * scale);
  }
}

__attribute__((target("avx512f"), always_inline)) inline void dequantize_block_avx512(
    const Q4Block& block, float* out) {
  const __m512 scale = _mm512_set1_ps(bf16_bits_to_float(block.scale));
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block.codes));
  const __m128i nibble = _mm_set1_epi8(0x0F);
  // code - 8 in bytes, then widened: the products are the scalar path's (code · scale for a
  // code of 15 would overflow where the value it stands for, 7 · scale, does not).
  const __m128i low = minus_eight(_mm_and_si128(bytes, nibble));
  const __m128i high = minus_eight(_mm_and_si128(_mm_srli_epi16(bytes, 4), nibble));
  _mm512_storeu_ps(out, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(low)) * scale);
  _mm512_storeu_ps(out + 16, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(high)) * scale);
}

// A block's bfloat16 scale as 8 floats (broadcast_scale's 8-lane form).
__attribute__((target("avx2"), always_inline)) inline __m256 broadcast_scale_avx2(
    const std::uint16_t& scale) {
  const __m256i words = _mm256_broadcastd_epi32(_mm_loadu_si32(&scale));
  return _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
}

// Half `half` (0 or 1) of a quantized block's 32 values, widened in registers, 2 packets of 8
// (dequantize_block_avx512's floats by 8-lane conversions, for CPUs with AVX2 but not AVX-512);
// `scale`, broadcast_scale_avx2(block.scale).
__attribute__((target("avx2"), always_inline)) inline void widen_half_block_avx2(
    const Q8Block& block, Index half, __m256 scale, __m256 (&out)[2]) {
  MHA_UNROLL
  for (Index i = 0; i < 2; ++i) {
    const __m128i codes =
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block.codes + 16 * half + 8 * i));
    out[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)) * scale;
  }
}

__attribute__((target("avx2"), always_inline)) inline void widen_half_block_avx2(
    const Q4Block& block, Index half, __m256 scale, __m256 (&out)[2]) {
  __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block.codes));
  // Values 0-15 in the bytes' low nibbles, 16-31 in their high ones.
  if (half == 1) bytes = _mm_srli_epi16(bytes, 4);
  // code - 8 in bytes before the product, as dequantized(): code · scale may overflow where the
  // value does not.
  const __m128i levels = minus_eight(_mm_and_si128(bytes, _mm_set1_epi8(0x0F)));
  out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(levels)) * scale;
  out[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(levels, levels))) * scale;
}

// A quantized block's 32 values, widened in registers: 4 packets of 8.
template <class Block>
__attribute__((target("avx2"), always_inline)) inline void widen_block_avx2(const Block& block,
                                                                            __m256 (&out)[4]) {
  const __m256 scale = broadcast_scale_avx2(block.scale);
  MHA_UNROLL
  for (Index half = 0; half < 2; ++half) {
    __m256 packets[2];
    widen_half_block_avx2(block, half, scale, packets);
    out[2 * half] = packets[0];
    out[2 * half + 1] = packets[1];
  }
}

template <class Block>
__attribute__((target("avx2"), always_inline)) inline void dequantize_block_avx2(const Block& block,
                                                                                 float* out) {
  __m256 values[4];
  widen_block_avx2(block, values);
  MHA_UNROLL
  for (Index i = 0; i < 4; ++i) _mm256_storeu_ps(out + 8 * i, values[i]);
}

// A block's bfloat16 scale as 16 floats: the 32 bits from the scale's address (the scale, then
// the first codes, inside the block) broadcast from memory and shifted into each float's top
// half, with no move from a general register (which the loads waited on).
__attribute__((target("avx512f"), always_inline)) inline __m512 broadcast_scale(
    const std::uint16_t& scale) {
  const __m512i words = _mm512_broadcastd_epi32(_mm_loadu_si32(&scale));
  return _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
}

// The 16 values [e, e + 16) of a quantized row (e a multiple of 16: half a block), widened in
// registers: how the decoding kernel's register blocks read a quantized cache
// (decode_products.hpp, through QuantizedRows).
__attribute__((target("avx512f"), always_inline)) inline __m512 load_quantized(const Q8Block* row,
                                                                               Index e) {
  const Q8Block& block = row[e / kQuantBlock];
  const __m128i codes =
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(block.codes + e % kQuantBlock));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes)) * broadcast_scale(block.scale);
}

// A q4 block's sixteen values scale · (code - 8) as a table, looked up by `vpermps`, which reads
// the low four bits of each lane's index: the codes' bytes zero-extended into the lanes, shifted
// down by four for the high half. Two operations fewer than widening each code to a float and
// then scaling it, for the same floats (each product is exact).
__attribute__((target("avx512f"), always_inline)) inline __m512 load_quantized(const Q4Block* row,
                                                                               Index e) {
  const Q4Block& block = row[e / kQuantBlock];
  __m512i lanes =
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block.codes)));
  if (e % kQuantBlock != 0) lanes = _mm512_srli_epi32(lanes, 4);
  const __m512 levels = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  return _mm512_permutexvar_ps(lanes, levels * broadcast_scale(block.scale));
}

// How many rows ahead QuantizedRows requests what it loads: one sub-block of the decoding
// kernel's register blocks (kDecodeBlocksSubBlock). With these requests a step over 16384 cached
// tokens (q8, B = 4, H_kv = 4, the kernel alone, a throwaway program) took 5.9 ms instead of
// 10.6; 16 rows ahead, 6.1 ms (bench/RESULTS.md, 2026-12-06, fifth session).
constexpr Index kQuantizedRowsAhead = 8;

// A quantized cache's rows as a row source of the decoding kernel's register blocks (see
// FloatRows in decode_products.hpp): rows `stride` blocks apart, the block's columns from value
// `column` of each row (a multiple of 16).
template <class Block>
struct QuantizedRows {
  const Block* first = nullptr;
  Index stride = 0;
  Index column = 0;

  const Block* row(Index j) const { return first + j * stride; }
  QuantizedRows rows_from(Index j) const { return {row(j), stride, column}; }
  QuantizedRows columns_from(Index c) const { return {first, stride, column + c}; }
  __attribute__((target("avx512f"), always_inline)) __m512 load(const Block* row, Index e) const {
    // The same values kQuantizedRowsAhead rows further on, requested from memory now: the
    // register blocks walk a key/value head's slice of a few rows at a time, an order the
    // hardware's prefetchers do not follow. (As an address only: it may lie past the cache's
    // last row, and a prefetch does not fault.)
    const std::uintptr_t ahead =
        reinterpret_cast<std::uintptr_t>(row + (column + e) / kQuantBlock) +
        static_cast<std::uintptr_t>(kQuantizedRowsAhead * stride) * sizeof(Block);
    // NOLINTNEXTLINE(performance-no-int-to-ptr): an address to prefetch, never dereferenced
    _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
    return load_quantized(row, column + e);
  }
};

template <class Block>
__attribute__((target("avx512f"))) void dequantize_rows_avx512(const Block* src, Index rows,
                                                               Index width, Index stride,
                                                               float* dst, Index dst_stride) {
  const Index blocks = width / kQuantBlock;
  for (Index r = 0; r < rows; ++r) {
    for (Index i = 0; i < blocks; ++i) {
      dequantize_block_avx512(src[r * stride + i], dst + r * dst_stride + i * kQuantBlock);
    }
  }
}

template <class Block>
__attribute__((target("avx2"))) void dequantize_rows_avx2(const Block* src, Index rows, Index width,
                                                          Index stride, float* dst,
                                                          Index dst_stride) {
  const Index blocks = width / kQuantBlock;
  for (Index r = 0; r < rows; ++r) {
    for (Index i = 0; i < blocks; ++i) {
      dequantize_block_avx2(src[r * stride + i], dst + r * dst_stride + i * kQuantBlock);
    }
  }
}
#endif

// rows × width values of quantized rows `stride` blocks apart into rows of dst, dst_stride floats
// apart.
template <class Block>
void dequantize_rows(const Block* src, Index rows, Index width, Index stride, float* dst,
                     Index dst_stride) {
#ifdef MHA_PACKED_GEMM_X86
  if (cpu_has_avx512f()) {
    dequantize_rows_avx512(src, rows, width, stride, dst, dst_stride);
    return;
  }
  if (cpu_has_avx2_fma()) {
    dequantize_rows_avx2(src, rows, width, stride, dst, dst_stride);
    return;
  }
#endif
  for (Index r = 0; r < rows; ++r) {
    float* row = dst + r * dst_stride;
    for (Index i = 0; i < width; ++i) {
      row[i] = dequantized(src[r * stride + i / kQuantBlock], i % kQuantBlock);
    }
  }
}

// ... into the first rows of `dst` (a row-major matrix of at least `rows` rows of `width`
// columns): the decoding kernel's tile.
template <class Block>
void dequantize_rows(const Block* src, Index rows, Index width, Index stride, Matrix<float>& dst) {
  dequantize_rows(src, rows, width, stride, dst.data(), dst.cols());
}

}  // namespace mha::detail
