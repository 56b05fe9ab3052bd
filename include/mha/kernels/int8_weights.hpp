// Weight-only int8: a projection's weight W [N, K] kept as int8 with one scale per output row,
// and the products of a few rows with it (a decoding step's tokens), which read a quarter of a
// float weight's bytes:
//   Ŵ[n][k] = scale[n] · q[n][k],  q in [-127, 127],  scale[n] = max_k |W[n][k]| / 127
//   dst [M, N] = x [M, K] · Ŵᵀ,  dst[m][n] = scale[n] · Σ_k q[n][k] · x[m][k]
// Symmetric, per output channel, rounded to nearest: PyTorch's per-channel symmetric weight
// quantization and CTranslate2's int8 weights. The sums are fp32: 16 weights at a time (8 with
// AVX2 alone) widened in registers (vpmovsxbd, vcvtdq2ps) and multiplied into the rows' sums; the
// scale is applied once per output. A decoding step reads every weight once, so its projections are
// bound by those bytes, not by the arithmetic.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "mha/kernels/common.hpp"
#include "mha/kernels/packed_gemm.hpp"

namespace mha::detail {

struct Int8Weight {
  Index outputs = 0, depth = 0;
  std::vector<std::int8_t> values;  // q [outputs, depth], row-major
  std::vector<float> scales;        // [outputs]

  bool empty() const { return values.empty(); }
  // Ŵ[n][k], the weight the int8 values stand for.
  float dequantized(Index n, Index k) const {
    return scales[static_cast<std::size_t>(n)] *
           static_cast<float>(values[static_cast<std::size_t>(n * depth + k)]);
  }
};

// W [outputs, depth] (rows `stride` elements apart) quantized into `out`. A row of zeros gets
// scale 0 and zeros; W must be finite (the caller checks). A row whose largest magnitude is below
// 127 subnormal steps (about 1.8e-43) would get a scale that rounds to 0, and 0 / 0 levels: its
// scale is the smallest subnormal instead, whose multiples hold such a row exactly.
template <class Source>
void quantize_int8_weight(const Source* weight, Index outputs, Index depth, Index stride,
                          Int8Weight& out) {
  out.outputs = outputs;
  out.depth = depth;
  out.values.assign(static_cast<std::size_t>(outputs * depth), 0);
  out.scales.assign(static_cast<std::size_t>(outputs), 0.0F);
  for (Index n = 0; n < outputs; ++n) {
    const Source* row = weight + n * stride;
    float largest = 0.0F;
    for (Index k = 0; k < depth; ++k)
      largest = std::max(largest, std::abs(static_cast<float>(row[k])));
    if (largest == 0.0F) continue;
    float scale = std::max(largest / 127.0F, std::numeric_limits<float>::denorm_min());
    // Near FLT_MAX, largest / 127 rounded up would make the weight 127 · scale infinite.
    if (!std::isfinite(127.0F * scale)) scale = std::nextafter(scale, 0.0F);
    out.scales[static_cast<std::size_t>(n)] = scale;
    for (Index k = 0; k < depth; ++k) {
      const float level = std::nearbyint(static_cast<float>(row[k]) / scale);
      out.values[static_cast<std::size_t>(n * depth + k)] =
          static_cast<std::int8_t>(std::clamp(level, -127.0F, 127.0F));
    }
  }
}

#ifdef MHA_PACKED_GEMM_X86
// dst[m][n0 + o] = scale · Σ_k q[n0 + o][k] · x[m][k] for o < Outputs and m < Rows: Outputs ×
// Rows fp32 sums of 16 lanes, each weight row's 16 int8 widened once for all the rows; the depth
// past the last whole 16 one element at a time.
template <int Outputs, int Rows>
__attribute__((target("avx512f"))) inline void int8_block_avx512(const float* x, Index x_stride,
                                                                 const Int8Weight& w, Index n0,
                                                                 float* dst, Index ld) {
  const Index depth = w.depth, whole = depth / 16 * 16;
  const std::int8_t* q = w.values.data() + n0 * depth;
  __m512 sums[Outputs][Rows];
  MHA_UNROLL
  for (auto& output_sums : sums) {
    MHA_UNROLL
    for (__m512& sum : output_sums) sum = _mm512_setzero_ps();
  }
  for (Index k = 0; k < whole; k += 16) {
    __m512 rows[Rows];
    MHA_UNROLL
    for (int m = 0; m < Rows; ++m) rows[m] = _mm512_loadu_ps(x + m * x_stride + k);
    MHA_UNROLL
    for (int o = 0; o < Outputs; ++o) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + o * depth + k));
      const __m512 weights = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
      MHA_UNROLL
      for (int m = 0; m < Rows; ++m) sums[o][m] = _mm512_fmadd_ps(weights, rows[m], sums[o][m]);
    }
  }
  MHA_UNROLL
  for (int o = 0; o < Outputs; ++o) {
    MHA_UNROLL
    for (int m = 0; m < Rows; ++m) {
      float sum = _mm512_reduce_add_ps(sums[o][m]);
      for (Index k = whole; k < depth; ++k) {
        sum += static_cast<float>(q[o * depth + k]) * x[m * x_stride + k];
      }
      dst[m * ld + n0 + o] = w.scales[static_cast<std::size_t>(n0 + o)] * sum;
    }
  }
}

// int8_block_avx512's sums with AVX2 (8 lanes; the depth past the last whole 8 one element at
// a time), for CPUs without AVX-512: Outputs · Rows <= 8 sums, in AVX2's 16 registers.
template <int Outputs, int Rows>
__attribute__((target("avx2,fma"))) inline void int8_block_avx2(const float* x, Index x_stride,
                                                                const Int8Weight& w, Index n0,
                                                                float* dst, Index ld) {
  static_assert(Outputs * Rows <= 8, "a block's sums fill at most 8 registers");
  const Index depth = w.depth, whole = depth / 8 * 8;
  const std::int8_t* q = w.values.data() + n0 * depth;
  __m256 sums[Outputs][Rows];
  MHA_UNROLL
  for (auto& output_sums : sums) {
    MHA_UNROLL
    for (__m256& sum : output_sums) sum = _mm256_setzero_ps();
  }
  for (Index k = 0; k < whole; k += 8) {
    MHA_UNROLL
    for (int o = 0; o < Outputs; ++o) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + o * depth + k));
      const __m256 weights = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
      MHA_UNROLL
      for (int m = 0; m < Rows; ++m) {
        sums[o][m] = _mm256_fmadd_ps(weights, _mm256_loadu_ps(x + m * x_stride + k), sums[o][m]);
      }
    }
  }
  MHA_UNROLL
  for (int o = 0; o < Outputs; ++o) {
    MHA_UNROLL
    for (int m = 0; m < Rows; ++m) {
      __m128 lanes = _mm256_castps256_ps128(sums[o][m]) + _mm256_extractf128_ps(sums[o][m], 1);
      lanes = lanes + _mm_movehl_ps(lanes, lanes);
      float sum = _mm_cvtss_f32(lanes + _mm_movehdup_ps(lanes));
      for (Index k = whole; k < depth; ++k) {
        sum += static_cast<float>(q[o * depth + k]) * x[m * x_stride + k];
      }
      dst[m * ld + n0 + o] = w.scales[static_cast<std::size_t>(n0 + o)] * sum;
    }
  }
}

// Rows m0 .. m0 + Rows - 1 against outputs [first, end): blocks of four outputs (with AVX2 as
// many as 8 sums hold: 8 / Rows), then one at a time.
template <bool Avx512, int Rows>
inline void int8_rows(const float* x, Index x_stride, const Int8Weight& w, Index first, Index end,
                      float* dst, Index ld) {
  constexpr int kOutputs = Avx512 ? 4 : 8 / Rows;
  Index n = first;
  if constexpr (Avx512) {
    for (; n + kOutputs <= end; n += kOutputs) {
      int8_block_avx512<kOutputs, Rows>(x, x_stride, w, n, dst, ld);
    }
    for (; n < end; ++n) int8_block_avx512<1, Rows>(x, x_stride, w, n, dst, ld);
  } else {
    for (; n + kOutputs <= end; n += kOutputs) {
      int8_block_avx2<kOutputs, Rows>(x, x_stride, w, n, dst, ld);
    }
    for (; n < end; ++n) int8_block_avx2<1, Rows>(x, x_stride, w, n, dst, ld);
  }
}

// Every row of x against outputs [first, end): four rows at a time, then the rest.
template <bool Avx512>
void int8_task(const float* x, Index rows, Index x_stride, const Int8Weight& w, Index first,
               Index end, float* dst, Index ld) {
  Index m = 0;
  for (; m + 4 <= rows; m += 4) {
    int8_rows<Avx512, 4>(x + m * x_stride, x_stride, w, first, end, dst + m * ld, ld);
  }
  const float* rest = x + m * x_stride;
  float* out = dst + m * ld;
  switch (rows - m) {
    case 3:
      int8_rows<Avx512, 3>(rest, x_stride, w, first, end, out, ld);
      break;
    case 2:
      int8_rows<Avx512, 2>(rest, x_stride, w, first, end, out, ld);
      break;
    case 1:
      int8_rows<Avx512, 1>(rest, x_stride, w, first, end, out, ld);
      break;
    default:
      break;
  }
}
#endif

// Outputs per task of int8_product: 64 rows of q (128 KiB at K = 2048) while x's rows stay in L1.
constexpr Index kInt8OutputsPerTask = 64;

// dst [rows, N] (rows ld apart) = x [rows, K] (rows x_stride apart) · Ŵᵀ (see the top), for a
// few rows: the threads split the outputs, and each task sweeps its 64 rows of q once for up to
// four rows of x (again for each further four). Every element gets the same operations whatever
// the thread count.
inline void int8_product(const float* x, Index rows, Index x_stride, const Int8Weight& w,
                         float* dst, Index ld) {
  const Index outputs = w.outputs;
  const Index tasks = (outputs + kInt8OutputsPerTask - 1) / kInt8OutputsPerTask;
  [[maybe_unused]] const double work =
      static_cast<double>(rows) * static_cast<double>(outputs) * static_cast<double>(w.depth);
  MHA_OMP_PRAGMA(omp parallel for schedule(static) if (max_threads() > 1 && work >= kMinParallelWork))
  for (Index task = 0; task < tasks; ++task) {
    const Index first = task * kInt8OutputsPerTask;
    const Index end = std::min(outputs, first + kInt8OutputsPerTask);
#ifdef MHA_PACKED_GEMM_X86
    if (cpu_has_avx512f()) {
      int8_task<true>(x, rows, x_stride, w, first, end, dst, ld);
      continue;
    }
    if (cpu_has_avx2_fma()) {
      int8_task<false>(x, rows, x_stride, w, first, end, dst, ld);
      continue;
    }
#endif
    for (Index m = 0; m < rows; ++m) {
      for (Index n = first; n < end; ++n) {
        const std::int8_t* q = w.values.data() + n * w.depth;
        float sum = 0.0F;
        for (Index k = 0; k < w.depth; ++k) sum += static_cast<float>(q[k]) * x[m * x_stride + k];
        dst[m * ld + n] = w.scales[static_cast<std::size_t>(n)] * sum;
      }
    }
  }
}

}  // namespace mha::detail
