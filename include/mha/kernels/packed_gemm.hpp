// The library's own fp32 GEMM: operands packed into panels and multiplied by a register-blocked
// micro-kernel, chosen at run time from what the CPU has: AVX-512 (one or two panels of kMr rows
// by two panels of kNr columns a call) or AVX2 with FMA (kMr x kNr), whatever Eigen was compiled
// for (see packed_gemm_available; elsewhere tile_product keeps Eigen's GEMM). Serial: the
// callers thread it (gemm.hpp's slabs, the attention kernels' tasks).
//
// Shapes: dst [M, N] = (or +=) alpha · op(lhs) [M, K] · op(rhs) [K, N], all row-major blocks.
// Loops (BLIS's order): for each kKc-deep slice of K, pack op(rhs)'s slice [kc, N] into panels of
// kNr columns (k-major: kNr values per k); for each kMc rows of op(lhs), pack them into panels of
// kMr rows (kMr values per k); then each (kMr x kNr) tile of dst (two side by side with AVX-512)
// is one micro-kernel call, its sums in registers for the whole slice, the lhs panel (kKc · kMr
// floats, 6 KiB) in L1 and the rhs panels streamed past it from L2 (see multiply_panels).
//
// Why not Eigen's GEMM: on the layer's shapes on an AVX2 machine it ran at 10-43 % of the FMA
// peak where OpenBLAS and oneDNN ran at 35-74 %, and this GEMM at 35-72 % (bench/RESULTS.md,
// 2026-12-02); on an AVX-512 machine, the layer's projections took 0.59-0.65 of the time they
// took on Eigen's GEMM compiled for AVX-512 (2026-12-02, fourth session); and the flash kernel's
// tiles need a micro-kernel of their own.
//
// Rounding: each element of dst gets alpha times each of its kc-slice sums (a chain of FMAs in k
// order) added by one more FMA, slice after slice. Slices start at multiples of kKc from k = 0 and
// partial tiles are computed whole on zero-padded panels, so an element's arithmetic does not
// depend on where a product is cut into slabs, nor so on the thread count.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

// GCC's and clang's target attributes choose the instructions per function. MHA_NO_X86_KERNELS
// leaves them out on x86-64 too, as on every other platform: tools/lint compiles the headers
// that way, so that the branch other platforms take is compiled on every change.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(MHA_NO_X86_KERNELS)
#include <immintrin.h>
#define MHA_PACKED_GEMM_X86 1
#endif

#include "mha/kernels/unroll.hpp"
#include "mha/tensor.hpp"

namespace mha::detail {

struct PackedGemmShape {
  static constexpr Index kMr = 6;    // rows of a micro-tile
  static constexpr Index kNr = 16;   // columns: two 8-float AVX registers
  static constexpr Index kKc = 256;  // depth of a slice
  static constexpr Index kMc = 72;   // rows of op(lhs) packed at once
};

// An operand as the packing reads it: element (i, j) of op(X) at data[i * row_step + j *
// col_step] (a row-major block as stored: (stride, 1); transposed: (1, stride)).
struct PackedOperand {
  const float* data;
  Index row_step;
  Index col_step;
  float at(Index i, Index j) const { return data[i * row_step + j * col_step]; }
};

#ifdef MHA_PACKED_GEMM_X86
// rows[c][k] becomes rows[k][c] for c, k < 8: the unpack, shuffle and lane-swap network.
__attribute__((target("avx2"))) inline void transpose_8x8(__m256 (&rows)[8]) {
  __m256 pairs[8];  // rows 2i and 2i + 1 interleaved, within each 128-bit lane
  MHA_UNROLL
  for (Index i = 0; i < 4; ++i) {
    pairs[2 * i] = _mm256_unpacklo_ps(rows[2 * i], rows[2 * i + 1]);
    pairs[2 * i + 1] = _mm256_unpackhi_ps(rows[2 * i], rows[2 * i + 1]);
  }
  __m256 quads[8];  // columns k and k + 4 of four rows: rows 0-3 in quads[0-3], rows 4-7 in [4-7]
  MHA_UNROLL
  for (Index half = 0; half < 2; ++half) {
    const __m256* p = pairs + 4 * half;
    quads[4 * half + 0] = _mm256_shuffle_ps(p[0], p[2], 0x44);
    quads[4 * half + 1] = _mm256_shuffle_ps(p[0], p[2], 0xEE);
    quads[4 * half + 2] = _mm256_shuffle_ps(p[1], p[3], 0x44);
    quads[4 * half + 3] = _mm256_shuffle_ps(p[1], p[3], 0xEE);
  }
  MHA_UNROLL
  for (Index k = 0; k < 4; ++k) {
    rows[k] = _mm256_permute2f128_ps(quads[k], quads[k + 4], 0x20);
    rows[k + 4] = _mm256_permute2f128_ps(quads[k], quads[k + 4], 0x31);
  }
}

// dst[k * dst_stride + c] = src[c * src_stride + k] for c, k < 8.
__attribute__((target("avx2"))) inline void transpose_block_8x8(const float* src, Index src_stride,
                                                                float* dst, Index dst_stride) {
  __m256 rows[8];
  MHA_UNROLL
  for (Index c = 0; c < 8; ++c) rows[c] = _mm256_loadu_ps(src + c * src_stride);
  transpose_8x8(rows);
  MHA_UNROLL
  for (Index k = 0; k < 8; ++k) _mm256_storeu_ps(dst + k * dst_stride, rows[k]);
}

// packed[k * 6 + r] = src[r * src_stride + k] for r < 6, k < 8, and two more floats written
// after them (packed[48], packed[49]), which the caller overwrites next: each step's six values
// are stored as a whole register, the next step's store covering the two extra lanes.
__attribute__((target("avx2"))) inline void pack_six_rows(const float* src, Index src_stride,
                                                          float* packed) {
  __m256 rows[8];
  MHA_UNROLL
  for (Index r = 0; r < 6; ++r) rows[r] = _mm256_loadu_ps(src + r * src_stride);
  rows[6] = rows[7] = _mm256_setzero_ps();
  transpose_8x8(rows);
  MHA_UNROLL
  for (Index k = 0; k < 8; ++k) _mm256_storeu_ps(packed + k * 6, rows[k]);
}
#endif

// Whether the CPU runs the AVX2 packing and micro-kernel (checked once).
inline bool cpu_has_avx2_fma() {
#ifdef MHA_PACKED_GEMM_X86
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
#else
  return false;
#endif
}

// Rows [i0, i0 + rows) and depth [k0, k0 + depth) of op(lhs) into panels of kMr rows, each
// depth x kMr (k-major), zero-padded to whole panels.
inline void pack_lhs(const PackedOperand& lhs, Index i0, Index rows, Index k0, Index depth,
                     float* packed) {
  constexpr Index mr = PackedGemmShape::kMr;
  static_assert(mr == 6, "pack_six_rows packs panels of six rows");
  Index p = 0;
  if (lhs.row_step == 1) {
    // Columns contiguous (a transposed lhs: the backward's dYᵀ X): each step's row of the stored
    // matrix read along its length once, six floats into every whole panel. (Panel by panel,
    // every step fell on another row, 4 KiB or more apart: 5 cycles an element.)
    const Index whole = rows / mr * mr;
    for (Index k = 0; k < depth; ++k) {
      const float* row = lhs.data + i0 + (k0 + k) * lhs.col_step;
      for (Index q = 0; q < whole; q += mr) {
        float* out = packed + q * depth + k * mr;
        for (Index r = 0; r < mr; ++r) out[r] = row[q + r];
      }
    }
    p = whole;
    packed += whole * depth;
  }
  for (; p < rows; p += mr, packed += depth * mr) {
    const Index height = std::min(mr, rows - p);
    Index k = 0;
#ifdef MHA_PACKED_GEMM_X86
    // Rows contiguous in k (the projections' inputs): eight steps at a time, transposed in
    // registers (scalar, 6 % of a 2048 x 512 x 512 product). A block's two extra floats fall on
    // the next block or panel, written after it, so the last block of the last panel stays scalar.
    if (height == mr && lhs.col_step == 1 && cpu_has_avx2_fma()) {
      const bool panel_follows = p + mr < rows;
      for (; k + 8 <= depth && (k + 8 < depth || panel_follows); k += 8) {
        pack_six_rows(lhs.data + (i0 + p) * lhs.row_step + k0 + k, lhs.row_step, packed + k * mr);
      }
    }
#endif
    for (; k < depth; ++k) {
      Index r = 0;
      for (; r < height; ++r) packed[k * mr + r] = lhs.at(i0 + p + r, k0 + k);
      for (; r < mr; ++r) packed[k * mr + r] = 0.0F;
    }
  }
}

// One panel of kNr columns of a transposed rhs (x Wᵀ): column c of op(rhs) is `columns + c ·
// column_step`, contiguous in k, for c < width; packed[k · kNr + c], zero for c >= width. Whole
// 8 x 8 blocks are transposed in registers: read scalar by scalar, 2304 x 768 took 2.6 ms, half
// the time of the product it was packed for.
inline void pack_contiguous_columns(const float* columns, Index column_step, Index depth,
                                    Index width, float* packed) {
  constexpr Index nr = PackedGemmShape::kNr;
  for (Index c0 = 0; c0 < nr; c0 += 8) {
    Index k = 0;
#ifdef MHA_PACKED_GEMM_X86
    if (c0 + 8 <= width && cpu_has_avx2_fma()) {
      for (; k + 8 <= depth; k += 8) {
        transpose_block_8x8(columns + c0 * column_step + k, column_step, packed + k * nr + c0, nr);
      }
    }
#endif
    for (Index c = c0; c < c0 + 8; ++c) {
      for (Index kk = k; kk < depth; ++kk) {
        packed[kk * nr + c] = c < width ? columns[c * column_step + kk] : 0.0F;
      }
    }
  }
}

// dst [cols, rows] (row stride dst_stride) = src [rows, cols]ᵀ (row stride src_stride): whole
// 8 x 8 blocks transposed in registers, the edges element by element.
inline void transpose_into(const float* src, Index src_stride, Index rows, Index cols, float* dst,
                           Index dst_stride) {
  Index r0 = 0;
#ifdef MHA_PACKED_GEMM_X86
  if (cpu_has_avx2_fma()) {
    for (; r0 + 8 <= rows; r0 += 8) {
      Index c = 0;
      for (; c + 8 <= cols; c += 8) {
        transpose_block_8x8(src + r0 * src_stride + c, src_stride, dst + c * dst_stride + r0,
                            dst_stride);
      }
      for (; c < cols; ++c) {
        for (Index r = r0; r < r0 + 8; ++r) dst[c * dst_stride + r] = src[r * src_stride + c];
      }
    }
  }
#endif
  for (Index c = 0; c < cols; ++c) {
    for (Index r = r0; r < rows; ++r) dst[c * dst_stride + r] = src[r * src_stride + c];
  }
}

// Depth [k0, k0 + depth) and columns [j0, j0 + cols) of op(rhs) into panels of kNr columns,
// each depth x kNr (k-major), zero-padded to whole panels.
inline void pack_rhs(const PackedOperand& rhs, Index k0, Index depth, Index j0, Index cols,
                     float* packed) {
  constexpr Index nr = PackedGemmShape::kNr;
  if (rhs.col_step == 1) {
    // Rows of op(rhs) contiguous (rhs as stored): each row read along its length once, for up to
    // eight panels at a time. (Panel by panel, a row's 64 bytes at a time, every read fell on
    // another row: 256 pages per panel.)
    constexpr Index kPanelsAtOnce = 8;
    for (Index p0 = 0; p0 < cols; p0 += kPanelsAtOnce * nr) {
      const Index group_end = std::min(cols, p0 + kPanelsAtOnce * nr);
      for (Index k = 0; k < depth; ++k) {
        const float* row = rhs.data + (k0 + k) * rhs.row_step + j0;
        for (Index p = p0; p < group_end; p += nr) {
          const Index width = std::min(nr, cols - p);
          float* out = packed + p * depth + k * nr;
          if (width == nr) {
            // A whole panel's row: a fixed-size copy, inlined (std::copy of a run-time width
            // called memmove for every 64 bytes).
            for (Index c = 0; c < nr; ++c) out[c] = row[p + c];
            continue;
          }
          std::copy(row + p, row + p + width, out);
          std::fill(out + width, out + nr, 0.0F);
        }
      }
    }
    return;
  }
  for (Index p = 0; p < cols; p += nr, packed += depth * nr) {
    const Index width = std::min(nr, cols - p);
    const float* columns = rhs.data + (j0 + p) * rhs.col_step + k0 * rhs.row_step;
    if (rhs.row_step == 1) {
      pack_contiguous_columns(columns, rhs.col_step, depth, width, packed);
      continue;
    }
    for (Index c = 0; c < nr; ++c) {
      for (Index k = 0; k < depth; ++k) {
        packed[k * nr + c] = c < width ? columns[c * rhs.col_step + k * rhs.row_step] : 0.0F;
      }
    }
  }
}

// What a platform's branch leaves unused (multiply_panels without x86's micro-kernel).
template <class... Arguments>
void arguments_unused(const Arguments&... /*unused*/) {}

#ifdef MHA_PACKED_GEMM_X86
// out[0, 16) = scale · (left, right) + (first ? 0 : out), each element one fused multiply-add
// (one rounding; with scale 1, the plain sum). (A function rather than a lambda: a lambda would
// not inherit the caller's target attribute.)
__attribute__((target("avx2,fma"))) inline void store_tile_row(float* out, __m256 left,
                                                               __m256 right, __m256 scale,
                                                               bool first) {
  const __m256 zero = _mm256_setzero_ps();
  _mm256_storeu_ps(out, _mm256_fmadd_ps(scale, left, first ? zero : _mm256_loadu_ps(out)));
  _mm256_storeu_ps(out + 8, _mm256_fmadd_ps(scale, right, first ? zero : _mm256_loadu_ps(out + 8)));
}

// tile [kMr, kNr] (row stride ld) = (first ? 0 : tile) + alpha · A · B over `depth`, A's
// element (r, k) at a[r * a_row_step + k * a_k_step] (a packed panel: steps 1 and kMr; rows of
// a row-major block: its row stride and 1), B's row k the kNr floats at b + k * b_k_step (a
// packed panel: kNr; a row-major block's columns: its row stride): 12 accumulators of 8 floats, two
// rhs registers and one broadcast lhs value, 15 of the 16 AVX registers, two FMAs per broadcast.
__attribute__((target("avx2,fma"))) inline void micro_kernel_avx2(Index depth, const float* a,
                                                                  Index a_row_step, Index a_k_step,
                                                                  const float* b, Index b_k_step,
                                                                  float alpha, bool first,
                                                                  float* tile, Index ld) {
  // The tile's rows (6 lines of dst, a row stride apart, often in the same cache set) are fetched
  // while the sums are formed: reading them cold after the loop cost a fifth of the time.
  if (!first) {
    MHA_UNROLL
    for (Index r = 0; r < 6; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(tile + r * ld), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(tile + r * ld + 15), _MM_HINT_T0);
    }
  }
  __m256 c00 = _mm256_setzero_ps(), c01 = _mm256_setzero_ps();
  __m256 c10 = _mm256_setzero_ps(), c11 = _mm256_setzero_ps();
  __m256 c20 = _mm256_setzero_ps(), c21 = _mm256_setzero_ps();
  __m256 c30 = _mm256_setzero_ps(), c31 = _mm256_setzero_ps();
  __m256 c40 = _mm256_setzero_ps(), c41 = _mm256_setzero_ps();
  __m256 c50 = _mm256_setzero_ps(), c51 = _mm256_setzero_ps();
  const Index r1 = a_row_step, r2 = 2 * r1, r3 = 3 * r1, r4 = 4 * r1, r5 = 5 * r1;
  // Unrolled by four: on a core slowed by the shared host's other load (a 2-core Zen 3, both cores
  // busy) the kernel ran at 83-87 GFLOP/s against 75-81 a step at a time, level on an idle core.
  MHA_UNROLL4
  for (Index k = 0; k < depth; ++k, a += a_k_step, b += b_k_step) {
    const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
    __m256 x = _mm256_broadcast_ss(a);
    c00 = _mm256_fmadd_ps(x, b0, c00);
    c01 = _mm256_fmadd_ps(x, b1, c01);
    x = _mm256_broadcast_ss(a + r1);
    c10 = _mm256_fmadd_ps(x, b0, c10);
    c11 = _mm256_fmadd_ps(x, b1, c11);
    x = _mm256_broadcast_ss(a + r2);
    c20 = _mm256_fmadd_ps(x, b0, c20);
    c21 = _mm256_fmadd_ps(x, b1, c21);
    x = _mm256_broadcast_ss(a + r3);
    c30 = _mm256_fmadd_ps(x, b0, c30);
    c31 = _mm256_fmadd_ps(x, b1, c31);
    x = _mm256_broadcast_ss(a + r4);
    c40 = _mm256_fmadd_ps(x, b0, c40);
    c41 = _mm256_fmadd_ps(x, b1, c41);
    x = _mm256_broadcast_ss(a + r5);
    c50 = _mm256_fmadd_ps(x, b0, c50);
    c51 = _mm256_fmadd_ps(x, b1, c51);
  }
  const __m256 scale = _mm256_set1_ps(alpha);
  store_tile_row(tile, c00, c01, scale, first);
  store_tile_row(tile + ld, c10, c11, scale, first);
  store_tile_row(tile + 2 * ld, c20, c21, scale, first);
  store_tile_row(tile + 3 * ld, c30, c31, scale, first);
  store_tile_row(tile + 4 * ld, c40, c41, scale, first);
  store_tile_row(tile + 5 * ld, c50, c51, scale, first);
}

// Whether the CPU runs the AVX-512 micro-kernels below (checked once).
inline bool cpu_has_avx512f() {
  static const bool has = __builtin_cpu_supports("avx512f");
  return has;
}

// micro_kernel_avx2's tile with AVX-512, for one or two panels of kMr rows of A (RowPanels, the
// second a_panel_step floats after the first: the next packed panel, or kMr rows further down a
// row-major block) by one panel of B (Panels = 1: kNr columns) or two side by side (Panels = 2,
// the second b_panel_step floats after the first: the next packed panel, or the next 16 columns
// of a row-major block). One 16-float register per row and panel of B, and one broadcast of A
// per row and step for all of B's panels.
//
// Why these shapes: one panel of B has six chains of FMAs (three quarters of the FMA's latency
// covered), and twelve rows over one panel take twelve broadcasts for twelve FMAs, whose loads
// then bound it: in L1, one thread, 93 % of the peak for 6 x 32 against 78 % for 12 x 16 (Zen 5,
// 2026-12-02). 12 x 32 (24 chains, ONNX Runtime's MLAS kernel's shape) reads half of 6 x 32's
// bytes of B per FMA: where B streams from beyond L2, as the first row panel of a chunk takes
// it, 6 x 32 ran at 0.46 of the FMA peak and 12 x 32 at 0.73-0.74, on one thread and on two;
// from L2, both at 0.81-0.94 (mha_bench's micro_tile/, Emerald Rapids, bench/RESULTS.md
// 2026-12-05).
//
// Each element gets the same arithmetic as micro_kernel_avx2 gives it (a chain of FMAs in k
// order, then one FMA with alpha and the old value), so results do not depend on which kernel
// ran. Not inlined: inlined into a caller, GCC 12 scheduled P·V's tiles at two thirds of the
// speed.
template <int RowPanels, int Panels>
__attribute__((target("avx512f"), noinline)) inline void micro_tile_avx512(
    Index depth, const float* a, Index a_row_step, Index a_k_step, Index a_panel_step,
    const float* b, Index b_panel_step, Index b_k_step, float alpha, bool first, float* tile,
    Index ld) {
  static_assert(RowPanels == 1 || RowPanels == 2, "one or two panels of A");
  static_assert(Panels == 1 || Panels == 2, "one or two panels of B");
  constexpr Index kRows = RowPanels * PackedGemmShape::kMr;
  if (!first) {
    MHA_UNROLL
    for (Index r = 0; r < kRows; ++r) {
      MHA_UNROLL
      for (Index p = 0; p < Panels; ++p) {
        _mm_prefetch(reinterpret_cast<const char*>(tile + r * ld + p * 16), _MM_HINT_T0);
      }
    }
  }
  __m512 sums[kRows][Panels];
  MHA_UNROLL
  for (auto& row_sums : sums) {
    MHA_UNROLL
    for (__m512& sum : row_sums) sum = _mm512_setzero_ps();
  }
  // Each panel of A from its own pointer, with the same six row offsets: twelve offsets of their
  // own took more general registers than x86-64 has, and GCC 12 reloaded three of them from the
  // stack at every step.
  Index offsets[PackedGemmShape::kMr];
  MHA_UNROLL
  for (Index r = 0; r < PackedGemmShape::kMr; ++r) offsets[r] = r * a_row_step;
  const float* panels[RowPanels];
  MHA_UNROLL
  for (Index q = 0; q < RowPanels; ++q) panels[q] = a + q * a_panel_step;
  for (Index k = 0; k < depth; ++k, b += b_k_step) {
    __m512 row[Panels];
    MHA_UNROLL
    for (Index p = 0; p < Panels; ++p) row[p] = _mm512_loadu_ps(b + p * b_panel_step);
    MHA_UNROLL
    for (Index r = 0; r < kRows; ++r) {
      const __m512 x =
          _mm512_set1_ps(panels[r / PackedGemmShape::kMr][offsets[r % PackedGemmShape::kMr]]);
      MHA_UNROLL
      for (Index p = 0; p < Panels; ++p) sums[r][p] = _mm512_fmadd_ps(x, row[p], sums[r][p]);
    }
    MHA_UNROLL
    for (const float*& panel : panels) panel += a_k_step;
  }
  const __m512 scale = _mm512_set1_ps(alpha);
  MHA_UNROLL
  for (Index r = 0; r < kRows; ++r) {
    MHA_UNROLL
    for (Index p = 0; p < Panels; ++p) {
      float* out = tile + r * ld + p * 16;
      const __m512 old = first ? _mm512_setzero_ps() : _mm512_loadu_ps(out);
      _mm512_storeu_ps(out, _mm512_fmadd_ps(scale, sums[r][p], old));
    }
  }
}

// One panel of kMr rows of A by one or two panels of B (micro_tile_avx512).
template <int Panels>
inline void micro_kernel_avx512(Index depth, const float* a, Index a_row_step, Index a_k_step,
                                const float* b, Index b_panel_step, Index b_k_step, float alpha,
                                bool first, float* tile, Index ld) {
  micro_tile_avx512<1, Panels>(depth, a, a_row_step, a_k_step, 0, b, b_panel_step, b_k_step, alpha,
                               first, tile, ld);
}

// One tile of kMr x kNr (see micro_kernel_avx2) with the widest kernel the CPU runs.
inline void micro_kernel(Index depth, const float* a, Index a_row_step, Index a_k_step,
                         const float* b, Index b_k_step, float alpha, bool first, float* tile,
                         Index ld) {
  if (cpu_has_avx512f()) {
    micro_kernel_avx512<1>(depth, a, a_row_step, a_k_step, b, 0, b_k_step, alpha, first, tile, ld);
  } else {
    micro_kernel_avx2(depth, a, a_row_step, a_k_step, b, b_k_step, alpha, first, tile, ld);
  }
}
#endif

// Whether the packed GEMM runs here (checked once): where the CPU has AVX2 and FMA, with the
// AVX-512 micro-kernels where it has those too, whatever instructions Eigen was compiled for.
inline bool packed_gemm_available() {
#ifdef MHA_PACKED_GEMM_X86
  return cpu_has_avx2_fma();
#else
  return false;
#endif
}

// The left operand of multiply_panels: panels of kMr rows packed by pack_lhs (k-major, depth ·
// kMr floats apart), or a block as it is, element (r, k) at data[r · row_stride + k · k_step]:
// the rows of a row-major block (k_step 1: the flash kernels' query blocks and probability
// tiles) or its columns (row_stride 1, k_step its row stride: a tile transposed, Pᵀ and dSᵀ in
// the flash backward).
struct LeftOperand {
  const float* data = nullptr;
  Index row_stride = 0;  // unused when packed
  bool packed = false;
  Index k_step = 1;  // unused when packed
};

// dst [rows, cols] (row stride ld) = (first ? 0 : dst) + alpha · A · B over `depth`, B as panels
// of kNr columns (k-major, b_stride floats apart). A partial tile is computed whole into
// `edge` (kMr x kNr floats) and its part copied, and an unpacked A's last rows, fewer than kMr,
// are packed first, zero-padded: every element gets the same arithmetic. Only where
// packed_gemm_available().
inline void multiply_panels(Index rows, Index cols, Index depth, const LeftOperand& a,
                            const float* b, Index b_stride, float alpha, bool first, float* dst,
                            Index ld, float* edge) {
#ifdef MHA_PACKED_GEMM_X86
  using S = PackedGemmShape;
  thread_local std::vector<float, Eigen::aligned_allocator<float>> last_rows;
  // Row panels outside, column panels inside: A's panel, or pair of panels (6 or 12 KiB at kKc),
  // stays in L1 and B's panels stream past it from L2. BLIS's order (B's panel held in L1, A's
  // panels streamed) ran at 70-81 % of the one-thread peak against 87-100 % for this one on a 72 x
  // 256 block of A and 16 to 2048 columns (AVX2 Zen 3, 2026-12-02): the six broadcasts a step takes
  // from a streamed panel wait more than B's two full-width loads do. B is taken a chunk of at most
  // 256 KiB at a time, which every row panel passes over while it is in L2; the whole of a wider B
  // would be read again from L3 or memory for each row panel.
  constexpr Index kChunkFloats = Index{1} << 16;
  const Index chunk =
      std::max(2 * S::kNr, kChunkFloats / std::max<Index>(depth, 1) / (2 * S::kNr) * (2 * S::kNr));
  // With AVX-512, two panels of B a call (micro_kernel_avx512<2>) wherever more than one
  // panel's columns are left, and two panels of A where twelve whole rows are (micro_tile_avx512).
  const bool avx512 = cpu_has_avx512f();
  const Index step = (avx512 ? 2 : 1) * S::kNr;
  // Row panel i's first element and steps (see LeftOperand), an unpacked A's last rows, fewer
  // than kMr, packed first, zero-padded.
  struct Panel {
    const float* data;
    Index row_step, k_step;
  };
  const auto panel_at = [&](Index i) {
    const Index height = std::min(S::kMr, rows - i);
    if (a.packed) return Panel{a.data + i * depth, 1, S::kMr};
    if (height == S::kMr) return Panel{a.data + i * a.row_stride, a.row_stride, a.k_step};
    if (static_cast<Index>(last_rows.size()) < S::kMr * depth) {
      last_rows.resize(static_cast<std::size_t>(S::kMr * depth));
    }
    pack_lhs(PackedOperand{a.data + i * a.row_stride, a.row_stride, a.k_step}, 0, height, 0, depth,
             last_rows.data());
    return Panel{last_rows.data(), 1, S::kMr};
  };
  // Rows [i, i + kMr) by columns [j, j + width), width <= step.
  const auto six_rows = [&](Index i, const Panel& panel, Index j, Index width) {
    const Index height = std::min(S::kMr, rows - i);
    const float* b_panel = b + (j / S::kNr) * b_stride;
    const bool two = width > S::kNr;
    float* tile = dst + i * ld + j;
    const bool whole = height == S::kMr && width % S::kNr == 0;
    // A partial tile is computed whole into `out` (one panel's in `edge`, two panels' in
    // wide_edge) and its part copied.
    float wide_edge[S::kMr * 2 * S::kNr];
    float* out = whole ? tile : two ? wide_edge : edge;
    const Index out_ld = whole ? ld : two ? 2 * S::kNr : S::kNr;
    for (Index r = 0; r < height && !whole && !first; ++r) {
      std::copy(tile + r * ld, tile + r * ld + width, out + r * out_ld);
    }
    if (two) {
      micro_kernel_avx512<2>(depth, panel.data, panel.row_step, panel.k_step, b_panel, b_stride,
                             S::kNr, alpha, first, out, out_ld);
    } else {
      micro_kernel(depth, panel.data, panel.row_step, panel.k_step, b_panel, S::kNr, alpha, first,
                   out, out_ld);
    }
    for (Index r = 0; r < height && !whole; ++r) {
      std::copy(out + r * out_ld, out + r * out_ld + width, tile + r * ld);
    }
  };
  for (Index j0 = 0; j0 < cols; j0 += chunk) {
    const Index chunk_end = std::min(cols, j0 + chunk);
    for (Index i = 0; i < rows;) {
      const Panel panel = panel_at(i);
      if (avx512 && i + 2 * S::kMr <= rows) {
        const Panel lower = panel_at(i + S::kMr);
        for (Index j = j0; j < chunk_end; j += step) {
          const Index width = std::min(step, chunk_end - j);
          if (width == 2 * S::kNr) {
            micro_tile_avx512<2, 2>(depth, panel.data, panel.row_step, panel.k_step,
                                    lower.data - panel.data, b + (j / S::kNr) * b_stride, b_stride,
                                    S::kNr, alpha, first, dst + i * ld + j, ld);
          } else {
            six_rows(i, panel, j, width);
            six_rows(i + S::kMr, lower, j, width);
          }
        }
        i += 2 * S::kMr;
        continue;
      }
      for (Index j = j0; j < chunk_end; j += step) {
        six_rows(i, panel, j, std::min(step, chunk_end - j));
      }
      i += S::kMr;
    }
  }
#else
  arguments_unused(rows, cols, depth, a, b, b_stride, alpha, first, dst, ld, edge);
#endif
}

// Floats that panels of `count` rows (or columns) hold at `depth`: whole panels of `unit`.
inline Index packed_size(Index count, Index unit, Index depth) {
  return (count + unit - 1) / unit * unit * depth;
}

// This thread's packing buffers, grown to the largest request and then kept: repeated products
// allocate nothing.
struct PackedGemmBuffers {
  std::vector<float, Eigen::aligned_allocator<float>> lhs, rhs;
  float edge[PackedGemmShape::kMr * PackedGemmShape::kNr] = {};  // a partial tile, computed whole
};
inline PackedGemmBuffers& packed_gemm_buffers() {
  thread_local PackedGemmBuffers buffers;
  return buffers;
}

// op(rhs) [depth, cols] packed whole, for products that share it (gemm.hpp's slabs of rows):
// slice after slice of kKc (the last one shorter), each as panels of kNr columns, slice k0 at
// k0 · packed_width(cols) floats. pack_rhs fills it, a slice's range of panels at a time.
inline Index packed_width(Index cols) {
  return (cols + PackedGemmShape::kNr - 1) / PackedGemmShape::kNr * PackedGemmShape::kNr;
}

// dst [rows, cols] = (or +=) alpha · op(lhs) · B over depth, B packed whole as above: the same
// arithmetic as packed_gemm's, element for element.
inline void multiply_packed_rhs(Index rows, Index cols, Index depth, const PackedOperand& lhs,
                                const float* packed_rhs, float alpha, bool accumulate, float* dst,
                                Index ld) {
  using S = PackedGemmShape;
  PackedGemmBuffers& buffers = packed_gemm_buffers();
  const auto lhs_size = static_cast<std::size_t>(
      packed_size(std::min(S::kMc, rows), S::kMr, std::min(S::kKc, depth)));
  if (buffers.lhs.size() < lhs_size) buffers.lhs.resize(lhs_size);
  for (Index k0 = 0; k0 < depth; k0 += S::kKc) {
    const Index kc = std::min(S::kKc, depth - k0);
    const float* slice = packed_rhs + k0 * packed_width(cols);
    for (Index i0 = 0; i0 < rows; i0 += S::kMc) {
      const Index mc = std::min(S::kMc, rows - i0);
      pack_lhs(lhs, i0, mc, k0, kc, buffers.lhs.data());
      multiply_panels(mc, cols, kc, LeftOperand{buffers.lhs.data(), 0, true}, slice, kc * S::kNr,
                      alpha, k0 == 0 && !accumulate, dst + i0 * ld, ld, buffers.edge);
    }
  }
}

// dst [rows, cols] (row stride ld) = (or +=) alpha · op(lhs) · op(rhs) over depth; see the top of
// this file. Only where packed_gemm_available().
inline void packed_gemm(Index rows, Index cols, Index depth, const PackedOperand& lhs,
                        const PackedOperand& rhs, float alpha, bool accumulate, float* dst,
                        Index ld) {
  using S = PackedGemmShape;
  if (rows == 0 || cols == 0) return;
  if (depth == 0) {
    if (!accumulate) {
      for (Index i = 0; i < rows; ++i) std::fill(dst + i * ld, dst + i * ld + cols, 0.0F);
    }
    return;
  }
  PackedGemmBuffers& buffers = packed_gemm_buffers();
  const Index slice = std::min(S::kKc, depth);
  const auto rhs_size = static_cast<std::size_t>(packed_size(cols, S::kNr, slice));
  const auto lhs_size =
      static_cast<std::size_t>(packed_size(std::min(S::kMc, rows), S::kMr, slice));
  if (buffers.rhs.size() < rhs_size) buffers.rhs.resize(rhs_size);
  if (buffers.lhs.size() < lhs_size) buffers.lhs.resize(lhs_size);
  for (Index k0 = 0; k0 < depth; k0 += S::kKc) {
    const Index kc = std::min(S::kKc, depth - k0);
    pack_rhs(rhs, k0, kc, 0, cols, buffers.rhs.data());
    for (Index i0 = 0; i0 < rows; i0 += S::kMc) {
      const Index mc = std::min(S::kMc, rows - i0);
      pack_lhs(lhs, i0, mc, k0, kc, buffers.lhs.data());
      multiply_panels(mc, cols, kc, LeftOperand{buffers.lhs.data(), 0, true}, buffers.rhs.data(),
                      kc * S::kNr, alpha, k0 == 0 && !accumulate, dst + i0 * ld, ld, buffers.edge);
    }
  }
}

}  // namespace mha::detail
