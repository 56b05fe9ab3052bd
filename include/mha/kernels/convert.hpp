// Widening 16-bit floats (Eigen::half, Eigen::bfloat16) to float, n contiguous elements at a
// time: how 16-bit layers read their weights, inputs and cached keys and values.
//
// Why not Eigen's cast<float>(): in Eigen 3.4 it converts one element at a time (22 GB/s of half
// and 7.5 GB/s of bfloat16 from L2 on this project's machine, against 82 GB/s for the code below,
// timed by a throwaway program; see bench/RESULTS.md), which made a 16-bit decoding step slower
// than a float one although it reads half the bytes. Both are exact: every 16-bit value is a
// float.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "mha/tensor.hpp"

#if defined(__AVX512F__) || defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace mha::detail {

// dst[i] = float(src[i]) for i < n.
inline void widen(const Eigen::half* src, Index n, float* dst) {
  Index i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(bits));
  }
#elif defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(bits));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// bfloat16 is the top half of a float: widening is a 16-bit shift.
inline void widen(const Eigen::bfloat16* src, Index n, float* dst) {
  Index i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    const __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16);
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(wide));
  }
#elif defined(__AVX2__)
  for (; i + 8 <= n; i += 8) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m256i wide = _mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16);
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(wide));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// dst[i] = src[i] rounded to the 16-bit type, to nearest even (NaN stays NaN), for i < n: how a
// 16-bit layer stores its results. Eigen's scalar conversion gives the same bits, element by
// element, several times slower.
inline void narrow(const float* src, Index n, Eigen::half* dst) {
  Index i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m256i bits = _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), bits);
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<Eigen::half>(src[i]);
}
inline void narrow(const float* src, Index n, Eigen::bfloat16* dst) {
  Index i = 0;
#if defined(__AVX512F__)
  // Round to nearest even on the float's bits: add 0x7FFF plus the lowest kept bit, keep the top
  // half. NaN would round into infinity or wrap, so NaN lanes keep their top half with the quiet
  // bit set, as Eigen does.
  const __m512i round_base = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
  const __m512i quiet = _mm512_set1_epi32(0x00400000);
  for (; i + 16 <= n; i += 16) {
    const __m512 values = _mm512_loadu_ps(src + i);
    const __m512i bits = _mm512_castps_si512(values);
    const __m512i lowest_kept = _mm512_and_si512(_mm512_srli_epi32(bits, 16), one);
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(round_base, lowest_kept));
    const __mmask16 nan = _mm512_cmp_ps_mask(values, values, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(bits, quiet));
    const __m256i top = _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), top);
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<Eigen::bfloat16>(src[i]);
}
template <class T>
void narrow(const T* src, Index n, T* dst) {
  std::copy(src, src + n, dst);
}

#if defined(__AVX512F__)
#define MHA_FUSED_16BIT_DOT 1
// 16 elements widened into a register.
inline __m512 widen16(const Eigen::half* src) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
}
inline __m512 widen16(const Eigen::bfloat16* src) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// A tile of a few tokens' projection with weights read as they are stored: for i < MR and
// j < NW, dst[i·dst_stride + j] (+)= Σ_k x[i·x_stride + k] · float(w[j·K + k]). Each weight row
// is widened in registers, 16 elements at a time, and used by every token of the tile, so a
// decoding step streams the 16-bit weights from memory once and never writes them back as float.
template <int MR, int NW, class Stored>
void dot_tile(const float* x, Index x_stride, const Stored* w, Index K, float* dst,
              Index dst_stride, bool accumulate) {
  __m512 acc[MR][NW];
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NW; ++j) acc[i][j] = _mm512_setzero_ps();
  }
  Index k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 weights[NW];
    for (int j = 0; j < NW; ++j) weights[j] = widen16(w + j * K + k);
    for (int i = 0; i < MR; ++i) {
      const __m512 xs = _mm512_loadu_ps(x + i * x_stride + k);
      for (int j = 0; j < NW; ++j) acc[i][j] = _mm512_fmadd_ps(weights[j], xs, acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NW; ++j) {
      float sum = _mm512_reduce_add_ps(acc[i][j]);
      for (Index t = k; t < K; ++t) sum += x[i * x_stride + t] * static_cast<float>(w[j * K + t]);
      float& out = dst[i * dst_stride + j];
      out = accumulate ? out + sum : sum;
    }
  }
}

// dst [M, n] (+)= x [M, K] · W[first .. first + n)ᵀ for M ≤ 16 tokens, in tiles of 4 tokens × 4
// weight rows (16 accumulators, half the vector registers).
template <class Stored>
void fused_dot_rows(const float* x, Index rows, Index x_stride, const Stored* weight, Index K,
                    Index first, Index count, float* dst, Index dst_stride, bool accumulate) {
  using Tile = void (*)(const float*, Index, const Stored*, Index, float*, Index, bool);
  static constexpr Tile kTiles[4][4] = {{dot_tile<1, 1, Stored>, dot_tile<1, 2, Stored>,
                                         dot_tile<1, 3, Stored>, dot_tile<1, 4, Stored>},
                                        {dot_tile<2, 1, Stored>, dot_tile<2, 2, Stored>,
                                         dot_tile<2, 3, Stored>, dot_tile<2, 4, Stored>},
                                        {dot_tile<3, 1, Stored>, dot_tile<3, 2, Stored>,
                                         dot_tile<3, 3, Stored>, dot_tile<3, 4, Stored>},
                                        {dot_tile<4, 1, Stored>, dot_tile<4, 2, Stored>,
                                         dot_tile<4, 3, Stored>, dot_tile<4, 4, Stored>}};
  for (Index n = 0; n < count; n += 4) {
    const Index nw = std::min<Index>(4, count - n);
    for (Index m = 0; m < rows; m += 4) {
      const Index mr = std::min<Index>(4, rows - m);
      kTiles[mr - 1][nw - 1](x + m * x_stride, x_stride, weight + (first + n) * K, K,
                             dst + m * dst_stride + n, dst_stride, accumulate);
    }
  }
}
#endif

// rows × cols of a row-major source whose rows are `stride` apart, into the first rows of `dst`
// (a row-major matrix with at least `rows` rows of `cols` columns).
template <class Stored, class T>
void widen_rows(const Stored* src, Index rows, Index cols, Index stride, Matrix<T>& dst) {
  if (stride == cols && dst.cols() == cols) {
    widen(src, rows * cols, dst.data());
    return;
  }
  for (Index r = 0; r < rows; ++r) widen(src + r * stride, cols, dst.data() + r * dst.cols());
}

}  // namespace mha::detail
