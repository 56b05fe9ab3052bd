// bf16 products with fp32 sums: the packed panels and the register-blocked micro-kernel of
// `vdpbf16ps` (AVX512_BF16), which this CPU family runs at twice its fp32 FMA rate (each 32-bit
// lane adds two bf16 products to an fp32 sum). Chosen at run time from CPUID
// (bf16_dot_available): a binary built for plain x86-64 runs everywhere, and its callers keep
// to fp32 where the instruction is absent. The first step of the reduced-precision work (issue
// 18): the flash tiles and the layer's bf16 mode are to build on these.
//
// Shapes: dst [M, N] = (or +=) op(A) [M, K] · op(B) [K, N], both operands rounded to bf16 (to
// nearest, ties to even) as they are packed, the sums kept in fp32. The depth is taken in pairs:
// a panel of B (kNr = 16 columns) holds, for pair p (depths 2p and 2p + 1), sixteen 32-bit lanes,
// lane j holding B[2p][j] in its low half and B[2p + 1][j] in its high half; a panel of A (kMr = 6
// rows) holds, for pair p, six such 32-bit pairs (A[i][2p], A[i][2p + 1]). `vdpbf16ps` multiplies
// a broadcast pair of A with sixteen pairs of B lane by lane and adds both products to the lane's
// sum. An odd K is padded with a zero depth, partial panels with zero rows and columns.
//
// Rounding: each product of two bf16 values is exact in fp32; the instruction adds the two of a
// lane to the sum with the rounding of fp32 arithmetic (denormal inputs and results flushed to
// zero, whatever MXCSR says: test_bf16_gemm checks it). So an element's error against the exact
// product of the rounded
// operands is that of a K-term fp32 sum, and its error against the float operands adds their
// rounding to bf16 (8 significant bits: a relative 2^-9 per operand).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "mha/kernels/common.hpp"
#include "mha/kernels/packed_gemm.hpp"

#ifdef MHA_PACKED_GEMM_X86
#include <cpuid.h>
#endif

namespace mha::detail {

struct Bf16GemmShape {
  static constexpr Index kMr = 6;   // rows of a micro-tile
  static constexpr Index kNr = 16;  // columns of a panel of B: one 512-bit register of pairs
};

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

// The pair (x at depth 2p, y at depth 2p + 1) as one 32-bit lane of a packed panel.
inline std::uint32_t bf16_pair(float low, float high) {
  return static_cast<std::uint32_t>(to_bf16_bits(low)) |
         (static_cast<std::uint32_t>(to_bf16_bits(high)) << 16);
}

// Depth pairs of a K-deep product.
inline Index bf16_pairs(Index depth) {
  return (depth + 1) / 2;
}

// `count` rows of X [count, depth] (element (i, k) at at(i, k)) into panels of `unit` rows,
// panel q at out + q · pairs · unit as [pairs, unit]: lane (p, i) holds the pair (X(q·unit + i,
// 2p), X(q·unit + i, 2p + 1)), zeros past the last row and depth.
template <class At>
void pack_bf16_panels(const At& at, Index count, Index depth, Index unit, std::uint32_t* out) {
  const Index pairs = bf16_pairs(depth);
  for (Index i0 = 0; i0 < count; i0 += unit) {
    std::uint32_t* panel = out + (i0 / unit) * pairs * unit;
    for (Index p = 0; p < pairs; ++p) {
      for (Index i = 0; i < unit; ++i) {
        const bool inside = i0 + i < count;
        const float low = inside ? at(i0 + i, 2 * p) : 0.0F;
        const float high = inside && 2 * p + 1 < depth ? at(i0 + i, 2 * p + 1) : 0.0F;
        panel[p * unit + i] = bf16_pair(low, high);
      }
    }
  }
}

// op(B) [depth, cols] (element (k, j) at b.at(k, j)) into panels of kNr columns, panel q at out +
// q · pairs · kNr as [pairs, kNr] (see the top).
inline void pack_bf16_rhs(const PackedOperand& b, Index depth, Index cols, std::uint32_t* out) {
  pack_bf16_panels([&b](Index j, Index k) { return b.at(k, j); }, cols, depth, Bf16GemmShape::kNr,
                   out);
}

// op(A) [rows, depth] (element (i, k) at a.at(i, k)) into panels of kMr rows, panel q at out + q ·
// pairs · kMr as [pairs, kMr] (see the top).
inline void pack_bf16_lhs(const PackedOperand& a, Index rows, Index depth, std::uint32_t* out) {
  pack_bf16_panels([&a](Index i, Index k) { return a.at(i, k); }, rows, depth, Bf16GemmShape::kMr,
                   out);
}

#ifdef MHA_PACKED_GEMM_X86
// tile [kMr, 16 · Panels] (rows ld floats apart) = (first ? 0 : tile) + one packed panel of A
// ([pairs, kMr]) times one or two packed panels of B ([pairs, kNr] each, the second
// b_panel_step lanes after the first). One fp32 register of sums per row and panel of B, one
// broadcast pair of A per row and pair for both panels: 6 × 32, the fp32 kernel's tile
// (micro_tile_avx512), twelve chains of `vdpbf16ps`. Only where bf16_dot_available().
template <int Panels>
__attribute__((target("avx512f,avx512bf16"), noinline)) inline void micro_tile_bf16(
    Index pairs, const std::uint32_t* a, const std::uint32_t* b, Index b_panel_step, bool first,
    float* tile, Index ld) {
  static_assert(Panels == 1 || Panels == 2, "one or two panels of B");
  constexpr Index kRows = Bf16GemmShape::kMr;
  __m512 sums[kRows][Panels];
  MHA_UNROLL
  for (auto& row_sums : sums) {
    MHA_UNROLL
    for (__m512& sum : row_sums) sum = _mm512_setzero_ps();
  }
  for (Index p = 0; p < pairs; ++p, a += kRows, b += Bf16GemmShape::kNr) {
    __m512bh row[Panels];
    MHA_UNROLL
    for (Index q = 0; q < Panels; ++q) {
      row[q] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + q * b_panel_step));
    }
    MHA_UNROLL
    for (Index r = 0; r < kRows; ++r) {
      const auto x = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(a[r])));
      MHA_UNROLL
      for (Index q = 0; q < Panels; ++q) sums[r][q] = _mm512_dpbf16_ps(sums[r][q], x, row[q]);
    }
  }
  MHA_UNROLL
  for (Index r = 0; r < kRows; ++r) {
    MHA_UNROLL
    for (Index q = 0; q < Panels; ++q) {
      float* out = tile + r * ld + q * 16;
      _mm512_storeu_ps(out, first ? sums[r][q] : _mm512_loadu_ps(out) + sums[r][q]);
    }
  }
}
#endif

// A projection's weight W [N, K] (x Wᵀ's, as a layer stores it) packed once as bf16 panels of
// kNr outputs over the whole depth (panel q at q · pairs · kNr, see the top): half of W's bytes.
struct Bf16PackedWeight {
  Index outputs = 0, depth = 0;
  std::vector<std::uint32_t, Eigen::aligned_allocator<std::uint32_t>> panels;
};

// W [outputs, depth], rows `stride` floats apart, into `packed`.
inline void pack_bf16_weight(const float* weight, Index outputs, Index depth, Index stride,
                             Bf16PackedWeight& packed) {
  using S = Bf16GemmShape;
  packed.outputs = outputs;
  packed.depth = depth;
  const Index panels = (outputs + S::kNr - 1) / S::kNr;
  packed.panels.assign(static_cast<std::size_t>(panels * bf16_pairs(depth) * S::kNr), 0U);
  pack_bf16_rhs(PackedOperand{weight, 1, stride}, depth, outputs, packed.panels.data());
}

// Depth pairs a slice of bf16_projection: a panel of A (6 rows) is 6 KiB of them, as kKc makes
// the fp32 kernel's.
constexpr Index kBf16SlicePairs = 256;
// Columns of W a thread's products take at a time: a slice of them (256 KiB) stays in L2 while
// every panel of x passes over it.
constexpr Index kBf16ChunkColumns = 256;

// dst [M, N] (rows ld apart) = (or +=) x [M, K] (rows x_stride apart) · Wᵀ, in bf16 with fp32
// sums (see the top), W packed by pack_bf16_weight. x is rounded and packed into panels of kMr
// rows once, shared by the threads (`packed_x` grows to it and is kept), then each thread takes
// a range of W's column panels, slice by slice of kBf16SlicePairs pairs, a chunk of
// kBf16ChunkColumns at a time. Every element gets the same arithmetic wherever the work is cut,
// so results do not depend on the thread count. Only where bf16_dot_available().
inline void bf16_projection(
    const float* x, Index rows, Index x_stride, const Bf16PackedWeight& w, float* dst, Index ld,
    bool accumulate,
    std::vector<std::uint32_t, Eigen::aligned_allocator<std::uint32_t>>& packed_x) {
#ifdef MHA_PACKED_GEMM_X86
  using S = Bf16GemmShape;
  const Index depth = w.depth, outputs = w.outputs, pairs = bf16_pairs(depth);
  const Index row_panels = (rows + S::kMr - 1) / S::kMr;
  const Index column_pairs = (outputs + 2 * S::kNr - 1) / (2 * S::kNr);  // 32-column tiles
  const auto size = static_cast<std::size_t>(row_panels * pairs * S::kMr);
  if (packed_x.size() < size) packed_x.resize(size);
  std::uint32_t* const packed = packed_x.data();
  const std::uint32_t* const panels = w.panels.data();
  [[maybe_unused]] const double work =
      static_cast<double>(rows) * static_cast<double>(outputs) * static_cast<double>(depth);
  MHA_OMP_PRAGMA(omp parallel if (max_threads() > 1 && work >= kMinParallelWork)) {
    MHA_OMP_PRAGMA(omp for schedule(static))
    for (Index panel = 0; panel < row_panels; ++panel) {
      const Index i0 = panel * S::kMr;
      pack_bf16_lhs(PackedOperand{x + i0 * x_stride, x_stride, 1}, std::min(S::kMr, rows - i0),
                    depth, packed + panel * pairs * S::kMr);
    }
    // Each thread's 32-column tiles, as even a share as whole tiles allow.
    const Index team = team_size(), me = thread_index();
    const Index first_tile = column_pairs * me / team, end_tile = column_pairs * (me + 1) / team;
    float edge[S::kMr * 2 * S::kNr];
    for (Index c0 = first_tile * 2 * S::kNr; c0 < end_tile * 2 * S::kNr; c0 += kBf16ChunkColumns) {
      const Index c1 = std::min({c0 + kBf16ChunkColumns, end_tile * 2 * S::kNr, outputs});
      for (Index p0 = 0; p0 < pairs; p0 += kBf16SlicePairs) {
        const Index count = std::min(kBf16SlicePairs, pairs - p0);
        const bool first = p0 == 0 && !accumulate;
        for (Index panel = 0; panel < row_panels; ++panel) {
          const Index i0 = panel * S::kMr, height = std::min(S::kMr, rows - i0);
          const std::uint32_t* a = packed + panel * pairs * S::kMr + p0 * S::kMr;
          for (Index j = c0; j < c1; j += 2 * S::kNr) {
            const Index width = std::min(2 * S::kNr, c1 - j);
            const std::uint32_t* b = panels + (j / S::kNr) * pairs * S::kNr + p0 * S::kNr;
            float* tile = dst + i0 * ld + j;
            if (height == S::kMr && width == 2 * S::kNr) {
              micro_tile_bf16<2>(count, a, b, pairs * S::kNr, first, tile, ld);
              continue;
            }
            // A partial tile: computed whole into `edge`, its part added to (or written into)
            // dst with the same one addition as the whole tiles'.
            if (width > S::kNr) {
              micro_tile_bf16<2>(count, a, b, pairs * S::kNr, true, edge, 2 * S::kNr);
            } else {
              micro_tile_bf16<1>(count, a, b, 0, true, edge, 2 * S::kNr);
            }
            for (Index r = 0; r < height; ++r) {
              for (Index c = 0; c < width; ++c) {
                float& out = tile[r * ld + c];
                out = first ? edge[r * 2 * S::kNr + c] : out + edge[r * 2 * S::kNr + c];
              }
            }
          }
        }
      }
    }
  }
#else
  arguments_unused(x, rows, x_stride, w, dst, ld, accumulate, packed_x);
#endif
}

}  // namespace mha::detail
