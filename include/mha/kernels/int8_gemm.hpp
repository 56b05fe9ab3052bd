// int8 × int8 projections with `vpdpbusd` (AVX512_VNNI), as ONNX Runtime's dynamic quantization
// runs them: the weight quantized once per output row (int8_weights.hpp's Ŵ = scale_w · q_w),
// each row of x quantized at the call, symmetric, one scale per row (per token):
//   x[i][k] ≈ s_x[i] · q_x[i][k],  q_x in [-127, 127],  s_x[i] = max_k |x[i][k]| / 127
//   y[i][j] = s_x[i] · scale_w[j] · Σ_k q_x[i][k] · q_w[j][k]
// `vpdpbusd` multiplies unsigned by signed bytes, so x is stored as q_x + 128 (1 .. 255) and each
// output's sum starts from -128 · Σ_k q_w[j][k]: every product four at a time in each 32-bit
// lane, four times the fp32 FMA's multiply-adds per instruction. The sums are exact in int32
// while every partial sum stays below 2^31: (128 + 255) · 127 · K < 2^31 for K up to
// kInt8MaxDepth.
//
// Layouts (as bf16_gemm.hpp's, with quads for pairs): x as rows of quads (lane p of row i holds
// bytes 4p .. 4p + 3, an unfinished quad padded with 128, the zero of q_x), rows up to the next
// multiple of 6 readable; W as panels of 16 outputs over the whole depth, [quads, 16].
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "mha/kernels/common.hpp"
#include "mha/kernels/int8_weights.hpp"
#include "mha/kernels/packed_gemm.hpp"

#ifdef MHA_PACKED_GEMM_X86
#include <cpuid.h>
#endif

namespace mha::detail {

struct Int8GemmShape {
  static constexpr Index kMr = 6;   // rows of a micro-tile
  static constexpr Index kNr = 16;  // outputs of a panel
};

// Whether this CPU runs `vpdpbusd` on 512-bit registers (AVX512_VNNI: CPUID leaf 7, ECX bit 11).
inline bool int8_dot_available() {
#ifdef MHA_PACKED_GEMM_X86
  static const bool has = [] {
    if (!cpu_has_avx512f()) return false;
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0) return false;
    return (ecx & (1U << 11)) != 0;
  }();
  return has;
#else
  return false;
#endif
}

// The deepest product whose int32 sums cannot overflow (see the top).
constexpr Index kInt8MaxDepth = 32768;

// Quads of a K-deep product.
inline Index int8_quads(Index depth) {
  return (depth + 3) / 4;
}

// A weight's int8 values as panels of 16 outputs, with the offsets (of x's storage as q_x + 128,
// which the sums start from) and the scales the epilogue needs.
struct Int8PackedWeight {
  Index outputs = 0, depth = 0;
  std::vector<std::uint32_t, Eigen::aligned_allocator<std::uint32_t>> panels;
  std::vector<std::int32_t> offsets;  // [outputs padded to 16]: -128 · Σ_k q_w[j][k]
  std::vector<float> scales;          // [outputs padded to 16]: scale_w[j], 0 past the last

  bool empty() const { return panels.empty(); }
  Index panel_stride() const { return int8_quads(depth) * Int8GemmShape::kNr; }
};

// w's values packed (once, at freeze; element by element).
inline void pack_int8_weight(const Int8Weight& w, Int8PackedWeight& packed) {
  constexpr Index kNr = Int8GemmShape::kNr;
  const Index quads = int8_quads(w.depth);
  const Index panels = (w.outputs + kNr - 1) / kNr;
  packed.outputs = w.outputs;
  packed.depth = w.depth;
  packed.panels.assign(static_cast<std::size_t>(panels * quads * kNr), 0U);
  packed.offsets.assign(static_cast<std::size_t>(panels * kNr), 0);
  packed.scales.assign(static_cast<std::size_t>(panels * kNr), 0.0F);
  for (Index j = 0; j < w.outputs; ++j) {
    const std::int8_t* row = w.values.data() + j * w.depth;
    std::int32_t sum = 0;
    for (Index p = 0; p < quads; ++p) {
      std::uint32_t lane = 0;
      for (Index b = 0; b < 4; ++b) {
        const Index k = 4 * p + b;
        const std::int8_t value = k < w.depth ? row[k] : std::int8_t{0};
        sum += value;
        lane |= static_cast<std::uint32_t>(static_cast<std::uint8_t>(value)) << (8 * b);
      }
      packed.panels[static_cast<std::size_t>((j / kNr) * quads * kNr + p * kNr + j % kNr)] = lane;
    }
    packed.offsets[static_cast<std::size_t>(j)] = -128 * sum;
    packed.scales[static_cast<std::size_t>(j)] = w.scales[static_cast<std::size_t>(j)];
  }
}

// Row x [cols] quantized: its scale s_x, and q_x + 128 into `out` (int8_quads(cols) lanes, an
// unfinished quad padded with 128). A row whose largest magnitude is 0, or so small (below
// 127 / FLT_MAX, about 3.7e-37) that 127 over it overflows, counts as zeros (scale 0); a row
// holding an infinity or a NaN gets scale NaN, so that its outputs are NaN, as the float
// product's would be. Scalar: the reference the vectorised form must equal.
inline float quantize_row_int8(const float* x, Index cols, std::uint8_t* out) {
  float largest = 0.0F, poison = 0.0F;
  for (Index k = 0; k < cols; ++k) {
    largest = std::max(largest, std::abs(x[k]));
    poison += x[k] * 0.0F;  // NaN when x[k] is infinite or NaN
  }
  const float inverse = largest > 0.0F ? 127.0F / largest : 0.0F;
  const bool zero = !std::isfinite(inverse) || std::isnan(poison);
  for (Index k = 0; k < 4 * int8_quads(cols); ++k) {
    const float level = k < cols && !zero ? std::nearbyint(x[k] * inverse) : 0.0F;
    out[k] = static_cast<std::uint8_t>(std::clamp(level, -127.0F, 127.0F) + 128.0F);
  }
  if (std::isnan(poison)) return poison;
  return std::isfinite(inverse) ? largest / 127.0F : 0.0F;
}

#ifdef MHA_PACKED_GEMM_X86
// quantize_row_int8, 16 floats at a time: the largest magnitude, then x · (127 / largest)
// rounded to nearest even (vcvtps2dq under the default MXCSR, as std::nearbyint), narrowed to
// bytes. |x| <= largest, so every level is within ±127 (127 / largest rounded up by an ulp still
// rounds 127.00002 to 127) and needs no clamp; q_x + 128 is the level's byte with its top bit
// flipped. The same bytes and scale as the scalar form.
__attribute__((target("avx512f"))) inline float quantize_row_int8_avx512(const float* x, Index cols,
                                                                         std::uint8_t* out) {
  __m512 largest = _mm512_setzero_ps(), poison = _mm512_setzero_ps();
  for (Index k = 0; k < cols; k += 16) {
    const __mmask16 inside = static_cast<__mmask16>((1U << std::min<Index>(16, cols - k)) - 1U);
    const __m512 values = _mm512_maskz_loadu_ps(inside, x + k);
    const __m512 magnitudes = _mm512_abs_ps(values);
    largest = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(magnitudes, largest, _CMP_GT_OQ), largest,
                                   magnitudes);
    poison = poison + values * _mm512_setzero_ps();
  }
  const float top = _mm512_reduce_max_ps(largest), nan = _mm512_reduce_add_ps(poison);
  const float inverse = top > 0.0F ? 127.0F / top : 0.0F;
  const Index padded = 4 * int8_quads(cols);
  const float scale = std::isnan(nan) ? nan : std::isfinite(inverse) ? top / 127.0F : 0.0F;
  if (!std::isfinite(inverse) || std::isnan(nan)) {
    std::fill(out, out + padded, std::uint8_t{128});
    return scale;
  }
  const __m512 factor = _mm512_set1_ps(inverse);
  const __m128i flip = _mm_set1_epi8(static_cast<char>(0x80));
  for (Index k = 0; k < padded; k += 16) {
    const Index count = std::min<Index>(16, padded - k);
    const __mmask16 inside =
        static_cast<__mmask16>((1U << std::clamp<Index>(cols - k, 0, 16)) - 1U);
    const __m512i levels = _mm512_cvtps_epi32(factor * _mm512_maskz_loadu_ps(inside, x + k));
    const __m128i bytes = _mm_xor_si128(_mm512_cvtepi32_epi8(levels), flip);
    alignas(16) std::uint8_t lanes[16];
    _mm_store_si128(reinterpret_cast<__m128i*>(lanes), bytes);
    std::copy(lanes, lanes + count, out + k);
  }
  return scale;
}

// tile [kMr, 16 · Panels] (rows ld floats apart) = s_x[r] · scale_w[j] · (offsets[j] + Σ quads of
// A's row r · B's column j): 6 rows of A as rows of quads (a_stride lanes apart) times one or two
// panels of B (the second b_panel_step lanes after the first), twelve int32 chains of
// `vpdpbusd` starting from the offsets, then the scales in fp32. Only where
// int8_dot_available().
template <int Panels>
__attribute__((target("avx512f,avx512vnni"), noinline)) inline void micro_tile_int8(
    Index quads, const std::uint32_t* a, Index a_stride, const std::uint32_t* b, Index b_panel_step,
    const float* row_scales, const std::int32_t* offsets, const float* column_scales, float* tile,
    Index ld) {
  static_assert(Panels == 1 || Panels == 2, "one or two panels of B");
  constexpr Index kRows = Int8GemmShape::kMr;
  __m512i start[Panels];
  MHA_UNROLL
  for (Index q = 0; q < Panels; ++q) start[q] = _mm512_loadu_si512(offsets + 16 * q);
  __m512i sums[kRows][Panels];
  MHA_UNROLL
  for (auto& row_sums : sums) {
    MHA_UNROLL
    for (Index q = 0; q < Panels; ++q) row_sums[q] = start[q];
  }
  for (Index p = 0; p < quads; ++p, ++a, b += Int8GemmShape::kNr) {
    __m512i row[Panels];
    MHA_UNROLL
    for (Index q = 0; q < Panels; ++q) row[q] = _mm512_loadu_si512(b + q * b_panel_step);
    MHA_UNROLL
    for (Index r = 0; r < kRows; ++r) {
      const __m512i x = _mm512_set1_epi32(static_cast<int>(a[r * a_stride]));
      MHA_UNROLL
      for (Index q = 0; q < Panels; ++q) sums[r][q] = _mm512_dpbusd_epi32(sums[r][q], x, row[q]);
    }
  }
  MHA_UNROLL
  for (Index q = 0; q < Panels; ++q) {
    const __m512 scales = _mm512_loadu_ps(column_scales + 16 * q);
    MHA_UNROLL
    for (Index r = 0; r < kRows; ++r) {
      const __m512 exact = _mm512_cvtepi32_ps(sums[r][q]);
      _mm512_storeu_ps(tile + r * ld + 16 * q, exact * (scales * _mm512_set1_ps(row_scales[r])));
    }
  }
}
#endif

// A call's quantized rows of x (as rows of quads) and their scales.
struct Int8Scratch {
  std::vector<std::uint32_t, Eigen::aligned_allocator<std::uint32_t>> rows;
  std::vector<float> row_scales;
};

// Columns a thread's products take at a time: 8 tiles of 32 (256 KiB of B at K = 1024, in L2)
// while every 6 rows of x pass over them.
constexpr Index kInt8ChunkColumns = 256;

// dst [M, N] (rows ld apart) = x [M, K] (rows x_stride apart) · Ŵᵀ with x quantized per row (see
// the top), W packed by pack_int8_weight. x's rows are quantized once into `scratch`, shared by
// the threads; then each thread takes a range of W's 32-column tiles, a chunk at a time, every 6
// rows of x over the chunk. Each element's sum is the same wherever the work is cut. Only where
// int8_dot_available().
inline void int8_gemm(const float* x, Index rows, Index x_stride, const Int8PackedWeight& w,
                      float* dst, Index ld, Int8Scratch& scratch) {
#ifdef MHA_PACKED_GEMM_X86
  using S = Int8GemmShape;
  const Index quads = int8_quads(w.depth), outputs = w.outputs;
  const Index padded_rows = (rows + S::kMr - 1) / S::kMr * S::kMr;
  const Index tiles = (outputs + 2 * S::kNr - 1) / (2 * S::kNr);
  scratch.rows.resize(static_cast<std::size_t>(padded_rows * quads));
  scratch.row_scales.assign(static_cast<std::size_t>(padded_rows), 0.0F);
  auto* const bytes = reinterpret_cast<std::uint8_t*>(scratch.rows.data());
  std::fill(bytes + rows * quads * 4, bytes + padded_rows * quads * 4, std::uint8_t{128});
  [[maybe_unused]] const double work =
      static_cast<double>(rows) * static_cast<double>(outputs) * static_cast<double>(w.depth);
  MHA_OMP_PRAGMA(omp parallel if (max_threads() > 1 && work >= kMinParallelWork)) {
    MHA_OMP_PRAGMA(omp for schedule(static))
    for (Index i = 0; i < rows; ++i) {
      scratch.row_scales[static_cast<std::size_t>(i)] =
          quantize_row_int8_avx512(x + i * x_stride, w.depth, bytes + i * quads * 4);
    }
    const Index team = team_size(), me = thread_index();
    const Index first_column = tiles * me / team * 2 * S::kNr;
    const Index end_column = std::min(outputs, tiles * (me + 1) / team * 2 * S::kNr);
    float edge[S::kMr * 2 * S::kNr];
    for (Index c0 = first_column; c0 < end_column; c0 += kInt8ChunkColumns) {
      const Index c1 = std::min(c0 + kInt8ChunkColumns, end_column);
      for (Index i0 = 0; i0 < rows; i0 += S::kMr) {
        const Index height = std::min(S::kMr, rows - i0);
        const std::uint32_t* a = scratch.rows.data() + i0 * quads;
        const float* row_scales = scratch.row_scales.data() + i0;
        for (Index j = c0; j < c1; j += 2 * S::kNr) {
          const Index width = std::min(2 * S::kNr, c1 - j);
          const std::uint32_t* b = w.panels.data() + (j / S::kNr) * w.panel_stride();
          const std::int32_t* sums = w.offsets.data() + j;
          const float* scales = w.scales.data() + j;
          if (height == S::kMr && width == 2 * S::kNr) {
            micro_tile_int8<2>(quads, a, quads, b, w.panel_stride(), row_scales, sums, scales,
                               dst + i0 * ld + j, ld);
            continue;
          }
          if (width > S::kNr) {
            micro_tile_int8<2>(quads, a, quads, b, w.panel_stride(), row_scales, sums, scales, edge,
                               2 * S::kNr);
          } else {
            micro_tile_int8<1>(quads, a, quads, b, 0, row_scales, sums, scales, edge, 2 * S::kNr);
          }
          for (Index r = 0; r < height; ++r) {
            std::copy(edge + r * 2 * S::kNr, edge + r * 2 * S::kNr + width,
                      dst + (i0 + r) * ld + j);
          }
        }
      }
    }
  }
#else
  arguments_unused(x, rows, x_stride, w, dst, ld, scratch);
#endif
}

}  // namespace mha::detail
