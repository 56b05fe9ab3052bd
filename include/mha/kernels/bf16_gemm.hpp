// bf16 products with fp32 sums: rounding to bf16, the operands' layouts, their packing, and the
// register-blocked micro-kernel of `vdpbf16ps` (AVX512_BF16), which this CPU family runs at twice
// its fp32 FMA rate (each 32-bit lane adds two bf16 products to an fp32 sum). Chosen at run time
// from CPUID (bf16_dot_available): a binary built for plain x86-64 runs everywhere, and its
// callers keep to fp32 where the instruction is absent. The layer's projections
// (bf16_projection.hpp) and the flash kernel's tiles (flash_bf16.hpp) are built on these.
//
// Shapes: dst [M, N] = (or +=) scale · A [M, K] · B [K, N], both operands rounded to bf16 (to
// nearest, ties to even) as they are laid out, the sums kept in fp32. The depth is taken in pairs
// (depths 2p and 2p + 1), one 32-bit lane holding a pair, the lower depth in its low half:
//   A  as rows of pairs: row i at a + i · a_stride lanes, lane p = (A[i][2p], A[i][2p + 1]), what
//      a row-major A is once each row is rounded (round_rows_bf16); the micro-kernel broadcasts
//      a lane of each of 6 rows;
//   B  as panels of kNr = 16 columns: panel q at b + q · panel_stride lanes, [pairs, 16], lane
//      (p, j) = (B[2p][q·16 + j], B[2p + 1][q·16 + j]); `vdpbf16ps` multiplies the broadcast pair
//      with sixteen pairs of B lane by lane and adds both products to the lane's sum.
// An odd K is padded with a zero depth, partial panels of B with zero columns.
//
// Rounding: each product of two bf16 values is exact in fp32; the instruction adds the two of a
// lane to the sum with the rounding of fp32 arithmetic (denormal inputs and results flushed to
// zero, whatever MXCSR says: test_bf16_gemm checks it). So an element's error against the exact
// product of the rounded operands is that of a K-term fp32 sum, and its error against the float
// operands adds their rounding to bf16 (8 significant bits: a relative 2^-8 per operand at most).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "mha/kernels/packed_gemm.hpp"

#ifdef MHA_PACKED_GEMM_X86
#include <cpuid.h>
#endif

namespace mha::detail {

struct Bf16GemmShape {
  static constexpr Index kMr = 6;   // rows of a micro-tile
  static constexpr Index kNr = 16;  // columns of a panel of B: one 512-bit register of pairs
};

// Buffers of packed lanes (aligned for the 512-bit loads).
using Bf16Lanes = std::vector<std::uint32_t, Eigen::aligned_allocator<std::uint32_t>>;

// Whether this CPU runs `vdpbf16ps` (AVX512_BF16, CPUID leaf 7 sub-leaf 1, EAX bit 5) on an
// operating system that keeps the AVX-512 registers.
inline bool bf16_dot_available() {
#ifdef MHA_PACKED_GEMM_X86
  static const bool has = [] {
    if (!cpu_has_avx512f()) return false;
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) == 0) return false;
    return (eax & (1U << 5)) != 0;
  }();
  return has;
#else
  return false;
#endif
}

// x rounded to bf16, to nearest with ties to even, as its 16 bits; a NaN stays a (quiet) NaN.
inline std::uint16_t to_bf16_bits(float x) {
  std::uint32_t bits = 0;
  std::memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7F800000U) == 0x7F800000U && (bits & 0x007FFFFFU) != 0) {
    return static_cast<std::uint16_t>((bits >> 16) | 0x0040U);
  }
  bits += 0x7FFFU + ((bits >> 16) & 1U);
  return static_cast<std::uint16_t>(bits >> 16);
}

// The bf16 value of bits as a float (exact).
inline float from_bf16_bits(std::uint16_t bits) {
  const std::uint32_t wide = static_cast<std::uint32_t>(bits) << 16;
  float x = 0;
  std::memcpy(&x, &wide, sizeof x);
  return x;
}

// The pair (x at depth 2p, y at depth 2p + 1) as one 32-bit lane.
inline std::uint32_t bf16_pair(float low, float high) {
  return static_cast<std::uint32_t>(to_bf16_bits(low)) |
         (static_cast<std::uint32_t>(to_bf16_bits(high)) << 16);
}

// Depth pairs of a K-deep product.
inline Index bf16_pairs(Index depth) {
  return (depth + 1) / 2;
}

// Panels of 16 for `count` columns.
inline Index bf16_panels(Index count) {
  return (count + Bf16GemmShape::kNr - 1) / Bf16GemmShape::kNr;
}

// The element-by-element packing, which the vectorised packers below must equal (the tests
// compare them) and which packs what they do not take (16-bit sources): `count` columns of B
// [depth, count] (element (k, j) at at(j, k)) into panels of 16 at out + q · pairs · 16.
template <class At>
void pack_bf16_panels(const At& at, Index count, Index depth, std::uint32_t* out) {
  constexpr Index kNr = Bf16GemmShape::kNr;
  const Index pairs = bf16_pairs(depth);
  for (Index j0 = 0; j0 < count; j0 += kNr) {
    std::uint32_t* panel = out + (j0 / kNr) * pairs * kNr;
    for (Index p = 0; p < pairs; ++p) {
      for (Index j = 0; j < kNr; ++j) {
        const bool inside = j0 + j < count;
        const float low = inside ? static_cast<float>(at(j0 + j, 2 * p)) : 0.0F;
        const float high =
            inside && 2 * p + 1 < depth ? static_cast<float>(at(j0 + j, 2 * p + 1)) : 0.0F;
        panel[p * kNr + j] = bf16_pair(low, high);
      }
    }
  }
}

#ifdef MHA_PACKED_GEMM_X86
// The lanes 16 · i to 16 · i + 15 of a row of `count` floats: a mask of the ones inside it.
inline __mmask16 lanes_inside(Index count, Index first) {
  const Index inside = std::clamp<Index>(count - first, 0, 16);
  return static_cast<__mmask16>((1U << inside) - 1U);
}

// One row of `cols` floats as bf16_pairs(cols) lanes of pairs, 32 floats at a time.
__attribute__((target("avx512f,avx512bf16"))) inline void round_row_bf16_avx512(
    const float* x, Index cols, std::uint32_t* out) {
  for (Index c = 0; c < cols; c += 32) {
    const __m512 low = _mm512_maskz_loadu_ps(lanes_inside(cols, c), x + c);
    const __m512 high = _mm512_maskz_loadu_ps(lanes_inside(cols, c + 16), x + c + 16);
    // (high, low): the first sixteen bf16 from low, in order, so lane p holds floats 2p, 2p + 1.
    const auto pairs = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(high, low));
    _mm512_mask_storeu_epi32(out + c / 2, lanes_inside(bf16_pairs(cols), c / 2), pairs);
  }
}
#endif

// A [rows, cols] (rows x_stride floats apart) as rows of pairs (see the top), row i at out + i ·
// out_stride lanes; an odd cols' last lane holds a zero high half. `vcvtne2ps2bf16` rounds as
// to_bf16_bits does but for denormals, which it flushes to zero, as `vdpbf16ps` would take them.
inline void round_rows_bf16(const float* x, Index rows, Index cols, Index x_stride,
                            std::uint32_t* out, Index out_stride) {
#ifdef MHA_PACKED_GEMM_X86
  if (bf16_dot_available()) {
    for (Index i = 0; i < rows; ++i)
      round_row_bf16_avx512(x + i * x_stride, cols, out + i * out_stride);
    return;
  }
#endif
  for (Index i = 0; i < rows; ++i) {
    const float* row = x + i * x_stride;
    for (Index p = 0; p < bf16_pairs(cols); ++p) {
      out[i * out_stride + p] = bf16_pair(row[2 * p], 2 * p + 1 < cols ? row[2 * p + 1] : 0.0F);
    }
  }
}

#ifdef MHA_PACKED_GEMM_X86
// rows[r] lane c becomes rows[c] lane r, for 16 rows of 16 32-bit lanes: pairs of lanes, then
// pairs of pairs interleaved within each 128-bit quarter, then the quarters exchanged.
__attribute__((target("avx512f"))) inline void transpose_16x16(__m512i (&rows)[16]) {
  __m512i pairs[16];
  MHA_UNROLL
  for (Index i = 0; i < 8; ++i) {
    pairs[2 * i] = _mm512_unpacklo_epi32(rows[2 * i], rows[2 * i + 1]);
    pairs[2 * i + 1] = _mm512_unpackhi_epi32(rows[2 * i], rows[2 * i + 1]);
  }
  // quads[4g + k], quarter L: lane 4L + k of rows 4g .. 4g + 3.
  __m512i quads[16];
  MHA_UNROLL
  for (Index g = 0; g < 4; ++g) {
    const __m512i* p = pairs + 4 * g;
    quads[4 * g + 0] = _mm512_unpacklo_epi64(p[0], p[2]);
    quads[4 * g + 1] = _mm512_unpackhi_epi64(p[0], p[2]);
    quads[4 * g + 2] = _mm512_unpacklo_epi64(p[1], p[3]);
    quads[4 * g + 3] = _mm512_unpackhi_epi64(p[1], p[3]);
  }
  MHA_UNROLL
  for (Index k = 0; k < 4; ++k) {
    // Quarters (0, 2) and (1, 3) of the four row groups, then the groups in order.
    const __m512i even01 = _mm512_shuffle_i32x4(quads[k], quads[4 + k], 0x88);
    const __m512i odd01 = _mm512_shuffle_i32x4(quads[k], quads[4 + k], 0xDD);
    const __m512i even23 = _mm512_shuffle_i32x4(quads[8 + k], quads[12 + k], 0x88);
    const __m512i odd23 = _mm512_shuffle_i32x4(quads[8 + k], quads[12 + k], 0xDD);
    rows[k] = _mm512_shuffle_i32x4(even01, even23, 0x88);
    rows[4 + k] = _mm512_shuffle_i32x4(odd01, odd23, 0x88);
    rows[8 + k] = _mm512_shuffle_i32x4(even01, even23, 0xDD);
    rows[12 + k] = _mm512_shuffle_i32x4(odd01, odd23, 0xDD);
  }
}

// pack_bf16_transposed for float rows, where bf16_dot_available(): 16 rows are rounded into
// `rounded` ([16, pairs]), and each 16 x 16 block of its lanes transposed in registers.
__attribute__((target("avx512f,avx512bf16"))) inline void pack_bf16_transposed_avx512(
    const float* m, Index count, Index depth, Index stride, std::uint32_t* out,
    Bf16Lanes& rounded) {
  constexpr Index kNr = Bf16GemmShape::kNr;
  const Index pairs = bf16_pairs(depth), padded = (pairs + kNr - 1) / kNr * kNr;
  if (static_cast<Index>(rounded.size()) < kNr * padded) {
    rounded.resize(static_cast<std::size_t>(kNr * padded));
  }
  for (Index j0 = 0; j0 < count; j0 += kNr) {
    const Index rows = std::min(kNr, count - j0);
    std::fill(rounded.begin(), rounded.begin() + kNr * padded, 0U);
    round_rows_bf16(m + j0 * stride, rows, depth, stride, rounded.data(), padded);
    std::uint32_t* panel = out + (j0 / kNr) * pairs * kNr;
    for (Index p0 = 0; p0 < pairs; p0 += kNr) {
      __m512i block[16];
      MHA_UNROLL
      for (Index r = 0; r < 16; ++r)
        block[r] = _mm512_loadu_si512(rounded.data() + r * padded + p0);
      transpose_16x16(block);
      const Index count_p = std::min(kNr, pairs - p0);
      for (Index p = 0; p < count_p; ++p) _mm512_storeu_si512(panel + (p0 + p) * kNr, block[p]);
    }
  }
}

// pack_bf16_columns for float rows, where bf16_dot_available(): rows 2p and 2p + 1 rounded 16
// columns at a time and their bf16 interleaved (the low row's zero-extended, the high row's
// shifted into the upper halves).
__attribute__((target("avx512f,avx512bf16"))) inline void pack_bf16_columns_avx512(
    const float* m, Index depth, Index cols, Index stride, std::uint32_t* out) {
  constexpr Index kNr = Bf16GemmShape::kNr;
  const Index pairs = bf16_pairs(depth);
  for (Index j0 = 0; j0 < cols; j0 += kNr) {
    const __mmask16 inside = lanes_inside(cols, j0);
    std::uint32_t* panel = out + (j0 / kNr) * pairs * kNr;
    for (Index p = 0; p < pairs; ++p) {
      const __m512 low = _mm512_maskz_loadu_ps(inside, m + 2 * p * stride + j0);
      const __m512 high = 2 * p + 1 < depth
                              ? _mm512_maskz_loadu_ps(inside, m + (2 * p + 1) * stride + j0)
                              : _mm512_setzero_ps();
      const __m512i low_bits =
          _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(low)));
      const __m512i high_bits =
          _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(high)));
      _mm512_storeu_si512(panel + p * kNr,
                          _mm512_or_si512(low_bits, _mm512_slli_epi32(high_bits, 16)));
    }
  }
}
#endif

// B = Mᵀ for M [count, depth] (rows `stride` apart: keys for q kᵀ, a weight W for x Wᵀ): M's rows
// become the panels' columns, panel q at out + q · pairs · 16. `rounded` is scratch that grows.
template <class Source>
void pack_bf16_transposed(const Source* m, Index count, Index depth, Index stride,
                          std::uint32_t* out, Bf16Lanes& rounded) {
#ifdef MHA_PACKED_GEMM_X86
  if constexpr (std::is_same_v<Source, float>) {
    if (bf16_dot_available())
      return pack_bf16_transposed_avx512(m, count, depth, stride, out, rounded);
  }
#endif
  static_cast<void>(rounded);
  pack_bf16_panels([&](Index j, Index k) { return m[j * stride + k]; }, count, depth, out);
}

// B = M for M [depth, cols] (rows `stride` apart: values for p v): M's columns become the panels'
// columns, panel q at out + q · pairs · 16.
template <class Source>
void pack_bf16_columns(const Source* m, Index depth, Index cols, Index stride, std::uint32_t* out) {
#ifdef MHA_PACKED_GEMM_X86
  if constexpr (std::is_same_v<Source, float>) {
    if (bf16_dot_available()) return pack_bf16_columns_avx512(m, depth, cols, stride, out);
  }
#endif
  pack_bf16_panels([&](Index j, Index k) { return m[k * stride + j]; }, cols, depth, out);
}

#ifdef MHA_PACKED_GEMM_X86
// panels_to_rows, where bf16_dot_available(): 16 × 16 blocks of lanes transposed in registers.
__attribute__((target("avx512f"))) inline void panels_to_rows_avx512(const std::uint32_t* panels,
                                                                     Index count, Index pairs,
                                                                     std::uint32_t* out,
                                                                     Index out_stride) {
  constexpr Index kNr = Bf16GemmShape::kNr;
  for (Index j0 = 0; j0 < count; j0 += kNr) {
    const std::uint32_t* panel = panels + (j0 / kNr) * pairs * kNr;
    const Index columns = std::min(kNr, count - j0);
    for (Index p0 = 0; p0 < pairs; p0 += kNr) {
      __m512i block[16];
      MHA_UNROLL
      for (Index r = 0; r < 16; ++r) {
        block[r] =
            p0 + r < pairs ? _mm512_loadu_si512(panel + (p0 + r) * kNr) : _mm512_setzero_si512();
      }
      transpose_16x16(block);
      const __mmask16 inside = lanes_inside(pairs, p0);
      for (Index j = 0; j < columns; ++j)
        _mm512_mask_storeu_epi32(out + (j0 + j) * out_stride + p0, inside, block[j]);
    }
  }
}
#endif

// A = Mᵀ as rows of pairs (row j at out + j · out_stride lanes) for M [depth, count], from M's
// columns packed as panels (pack_bf16_columns: panel q at panels + q · pairs · 16, lane (p, j) the
// pair of column 16q + j at depths 2p and 2p + 1): a transposition of 32-bit lanes.
inline void panels_to_rows(const std::uint32_t* panels, Index count, Index pairs,
                           std::uint32_t* out, Index out_stride) {
  constexpr Index kNr = Bf16GemmShape::kNr;
#ifdef MHA_PACKED_GEMM_X86
  if (bf16_dot_available()) return panels_to_rows_avx512(panels, count, pairs, out, out_stride);
#endif
  for (Index j = 0; j < count; ++j) {
    const std::uint32_t* panel = panels + (j / kNr) * pairs * kNr + j % kNr;
    for (Index p = 0; p < pairs; ++p) out[j * out_stride + p] = panel[p * kNr];
  }
}

#ifdef MHA_PACKED_GEMM_X86
// tile [kMr, 16 · Panels] (rows ld floats apart) = (first ? 0 : tile) + scale · (6 rows of A as
// rows of pairs, a_stride lanes apart) · (one or two panels of B, the second b_panel_step lanes
// after the first). One fp32 register of sums per row and panel of B, one broadcast pair of A
// per row and pair for both panels: 6 × 32, the fp32 kernel's tile (micro_tile_avx512), twelve
// chains of `vdpbf16ps`. Only where bf16_dot_available().
template <int Panels>
__attribute__((target("avx512f,avx512bf16"), noinline)) inline void micro_tile_bf16(
    Index pairs, const std::uint32_t* a, Index a_stride, const std::uint32_t* b, Index b_panel_step,
    float scale, bool first, float* tile, Index ld) {
  static_assert(Panels == 1 || Panels == 2, "one or two panels of B");
  constexpr Index kRows = Bf16GemmShape::kMr;
  __m512 sums[kRows][Panels];
  MHA_UNROLL
  for (auto& row_sums : sums) {
    MHA_UNROLL
    for (__m512& sum : row_sums) sum = _mm512_setzero_ps();
  }
  for (Index p = 0; p < pairs; ++p, ++a, b += Bf16GemmShape::kNr) {
    __m512bh row[Panels];
    MHA_UNROLL
    for (Index q = 0; q < Panels; ++q) {
      row[q] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + q * b_panel_step));
    }
    MHA_UNROLL
    for (Index r = 0; r < kRows; ++r) {
      const auto x =
          reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(a[r * a_stride])));
      MHA_UNROLL
      for (Index q = 0; q < Panels; ++q) sums[r][q] = _mm512_dpbf16_ps(sums[r][q], x, row[q]);
    }
  }
  const __m512 factor = _mm512_set1_ps(scale);
  MHA_UNROLL
  for (Index r = 0; r < kRows; ++r) {
    MHA_UNROLL
    for (Index q = 0; q < Panels; ++q) {
      float* out = tile + r * ld + q * 16;
      const __m512 scaled = factor * sums[r][q];
      _mm512_storeu_ps(out, first ? scaled : _mm512_loadu_ps(out) + scaled);
    }
  }
}
#endif

// dst [rows, cols] (rows ld apart) = (first ? 0 : dst) + scale · A · B over `pairs` depth pairs,
// A as rows of pairs (a_stride lanes apart; rows up to the next multiple of 6 readable, their
// products discarded) and B as panels (panel_stride lanes apart), in 6 × 32 micro-tiles. A
// partial tile is computed whole into a buffer and its part added with the same one addition as
// the whole tiles', so an element's sum is the same wherever the product is cut. One thread;
// only where bf16_dot_available().
inline void bf16_tile_product(Index rows, Index cols, Index pairs, const std::uint32_t* a,
                              Index a_stride, const std::uint32_t* b, Index panel_stride,
                              float scale, bool first, float* dst, Index ld) {
#ifdef MHA_PACKED_GEMM_X86
  using S = Bf16GemmShape;
  float edge[S::kMr * 2 * S::kNr];
  for (Index i0 = 0; i0 < rows; i0 += S::kMr) {
    const Index height = std::min(S::kMr, rows - i0);
    const std::uint32_t* a_rows = a + i0 * a_stride;
    for (Index j = 0; j < cols; j += 2 * S::kNr) {
      const Index width = std::min(2 * S::kNr, cols - j);
      const std::uint32_t* b_panel = b + (j / S::kNr) * panel_stride;
      float* tile = dst + i0 * ld + j;
      if (height == S::kMr && width == 2 * S::kNr) {
        micro_tile_bf16<2>(pairs, a_rows, a_stride, b_panel, panel_stride, scale, first, tile, ld);
        continue;
      }
      if (width > S::kNr) {
        micro_tile_bf16<2>(pairs, a_rows, a_stride, b_panel, panel_stride, scale, true, edge,
                           2 * S::kNr);
      } else {
        micro_tile_bf16<1>(pairs, a_rows, a_stride, b_panel, 0, scale, true, edge, 2 * S::kNr);
      }
      for (Index r = 0; r < height; ++r) {
        for (Index c = 0; c < width; ++c) {
          float& out = tile[r * ld + c];
          out = first ? edge[r * 2 * S::kNr + c] : out + edge[r * 2 * S::kNr + c];
        }
      }
    }
  }
#else
  arguments_unused(rows, cols, pairs, a, a_stride, b, panel_stride, scale, first, dst, ld);
#endif
}

}  // namespace mha::detail
