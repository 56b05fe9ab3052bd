// The layer's projections in bf16 with fp32 sums (bf16_gemm.hpp's arithmetic):
//   dst [M, N] = (or +=) x [M, K] · Wᵀ, W [N, K] as a layer stores it
// W packed once into bf16 panels of 16 outputs (Bf16PackedWeight: half of W's bytes), x rounded
// into rows of pairs at every call.
#pragma once

#include <algorithm>
#include <cstdint>

#include "mha/kernels/bf16_gemm.hpp"
#include "mha/kernels/common.hpp"

namespace mha::detail {

// A projection's weight W [N, K] packed as bf16 panels of 16 outputs over the whole depth
// (panel q at q · pairs · 16; bf16_gemm.hpp's B = Wᵀ).
struct Bf16PackedWeight {
  Index outputs = 0, depth = 0;
  Bf16Lanes panels;

  bool empty() const { return panels.empty(); }
  Index panel_stride() const { return bf16_pairs(depth) * Bf16GemmShape::kNr; }
};

// W [outputs, depth] (rows `stride` elements apart, float or 16-bit) into `packed`; `rounded` is
// scratch that grows.
template <class Source>
void pack_bf16_weight(const Source* weight, Index outputs, Index depth, Index stride,
                      Bf16PackedWeight& packed, Bf16Lanes& rounded) {
  packed.outputs = outputs;
  packed.depth = depth;
  packed.panels.resize(static_cast<std::size_t>(bf16_panels(outputs) * packed.panel_stride()));
  pack_bf16_transposed(weight, outputs, depth, stride, packed.panels.data(), rounded);
}

// A layer's bf16 projections in one forward call: a weight packed for it where no frozen packing
// is given (kept while the same weight is asked for again, forgotten at every call, since an
// optimiser changes weights in place), the rows being projected, and the packing's scratch.
struct Bf16Scratch {
  Bf16PackedWeight weight;
  const void* weight_of = nullptr;
  Bf16Lanes rows, rounded;

  void forget() { weight_of = nullptr; }

  // W [outputs, depth] (rows contiguous) packed, or as packed by the last call for it.
  template <class Source>
  const Bf16PackedWeight& packed(const Source* w, Index outputs, Index depth) {
    if (weight_of != w || weight.outputs != outputs || weight.depth != depth) {
      pack_bf16_weight(w, outputs, depth, depth, weight, rounded);
      weight_of = w;
    }
    return weight;
  }
};

// Depth pairs a slice of bf16_projection: 6 rows of x's pairs are 6 KiB of them, as kKc makes
// the fp32 kernel's.
constexpr Index kBf16SlicePairs = 256;
// Columns of W a thread's products take at a time: a slice of them (256 KiB) stays in L2 while
// every 6 rows of x pass over it.
constexpr Index kBf16ChunkColumns = 256;

// This thread's share of dst [rows, cols] (rows ld apart) = (or +=) A · B over `pairs` pairs, A as
// rows of pairs (a_stride lanes apart, rows up to a multiple of 6 readable), B as panels
// (panel_stride lanes apart): as even a share of the 32-column tiles as whole tiles allow, slice
// by slice of kBf16SlicePairs pairs, kBf16ChunkColumns at a time, so that an element's sums are
// the same whatever the team.
inline void bf16_team_columns(Index rows, Index cols, Index pairs, const std::uint32_t* a,
                              Index a_stride, const std::uint32_t* b, Index panel_stride,
                              bool accumulate, float* dst, Index ld) {
  constexpr Index kNr = Bf16GemmShape::kNr;
  const Index tiles = (cols + 2 * kNr - 1) / (2 * kNr);
  const Index team = team_size(), me = thread_index();
  const Index first_column = tiles * me / team * 2 * kNr;
  const Index end_column = std::min(cols, tiles * (me + 1) / team * 2 * kNr);
  for (Index c0 = first_column; c0 < end_column; c0 += kBf16ChunkColumns) {
    const Index width = std::min(kBf16ChunkColumns, end_column - c0);
    for (Index p0 = 0; p0 < pairs; p0 += kBf16SlicePairs) {
      bf16_tile_product(rows, width, std::min(kBf16SlicePairs, pairs - p0), a + p0, a_stride,
                        b + (c0 / kNr) * panel_stride + p0 * kNr, panel_stride, 1.0F,
                        p0 == 0 && !accumulate, dst + c0, ld);
    }
  }
}

// dst [M, N] (rows ld apart) = (or +=) x [M, K] (rows x_stride apart) · Wᵀ, in bf16 with fp32
// sums, W packed by pack_bf16_weight. x is rounded into rows of pairs once (`rounded_x` grows to
// them and is kept; rows up to a multiple of 6, the extra ones zero), shared by the threads, then
// each thread takes a range of W's 32-column tiles, slice by slice of kBf16SlicePairs pairs, a
// chunk of kBf16ChunkColumns at a time. Every element gets the same arithmetic wherever the work
// is cut, so results do not depend on the thread count. Only where bf16_dot_available().
inline void bf16_projection(const float* x, Index rows, Index x_stride, const Bf16PackedWeight& w,
                            float* dst, Index ld, bool accumulate, Bf16Lanes& rounded_x) {
  using S = Bf16GemmShape;
  const Index depth = w.depth, outputs = w.outputs, pairs = bf16_pairs(depth);
  const Index padded_rows = (rows + S::kMr - 1) / S::kMr * S::kMr;
  const auto size = static_cast<std::size_t>(padded_rows * pairs);
  if (rounded_x.size() < size) rounded_x.resize(size);
  std::uint32_t* const a = rounded_x.data();
  std::fill(a + rows * pairs, a + padded_rows * pairs, 0U);
  [[maybe_unused]] const double work =
      static_cast<double>(rows) * static_cast<double>(outputs) * static_cast<double>(depth);
  MHA_OMP_PRAGMA(omp parallel if (max_threads() > 1 && work >= kMinParallelWork)) {
    MHA_OMP_PRAGMA(omp for schedule(static))
    for (Index i0 = 0; i0 < rows; i0 += S::kMr) {
      round_rows_bf16(x + i0 * x_stride, std::min(S::kMr, rows - i0), depth, x_stride,
                      a + i0 * pairs, pairs);
    }
    bf16_team_columns(rows, outputs, pairs, a, pairs, w.panels.data(), w.panel_stride(), accumulate,
                      dst, ld);
  }
}

}  // namespace mha::detail
