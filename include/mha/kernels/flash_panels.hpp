// The flash kernels' operands as the packed GEMM's right-hand panels (packed_gemm.hpp), so that
// their tile products run on the micro-kernel without packing the same rows again for every
// tile: one thread's packed copy of each matrix of the head it is working on. (The left
// operands, a query block, a tile of probabilities or of score gradients, are read by the
// micro-kernel as they are.)
//
// Two ways to pack a matrix m [R, C] (a head's keys, values, queries or output gradients):
//   transposed  for products x · mᵀ: panels of kNr rows of m, each C x kNr; rows j0 (a multiple
//               of kNr) onwards start at panel j0 / kNr, j0 · C floats in;
//   rows        for products x · m: panels of kNr columns of m, each R x kNr (panel stride
//               R · kNr); rows i0 onwards of every panel start i0 · kNr floats into it.
#pragma once

#include <vector>

#include "mha/kernels/bf16_gemm.hpp"
#include "mha/kernels/packed_gemm.hpp"

namespace mha::detail {

// One matrix packed one way, kept while the same matrix is asked for again.
class PanelBuffer {
 public:
  // Forgets the packed matrix: a new call's operands may sit where the last call's did.
  void forget() { packed_of_ = nullptr; }

  const float* transposed(const ConstStridedMap<float>& m) {
    if (packed_of_ != m.data()) {
      grow(packed_size(m.rows(), PackedGemmShape::kNr, m.cols()));
      pack_rhs(PackedOperand{m.data(), 1, m.outerStride()}, 0, m.cols(), 0, m.rows(),
               buffer_.data());
      packed_of_ = m.data();
    }
    return buffer_.data();
  }

  const float* rows(const ConstStridedMap<float>& m) {
    if (packed_of_ != m.data()) {
      grow(packed_size(m.cols(), PackedGemmShape::kNr, m.rows()));
      pack_rhs(PackedOperand{m.data(), m.outerStride(), 1}, 0, m.rows(), 0, m.cols(),
               buffer_.data());
      packed_of_ = m.data();
    }
    return buffer_.data();
  }
  static Index row_panel_stride(const ConstStridedMap<float>& m) {
    return m.rows() * PackedGemmShape::kNr;
  }

  // Rows j0 .. j0 + count - 1 of m, transposed, as panels of their own, packed at every call: a
  // block that does not start at a panel of the whole (a window's or a pattern's first key).
  const float* block_transposed(const ConstStridedMap<float>& m, Index j0, Index count) {
    grow(packed_size(count, PackedGemmShape::kNr, m.cols()));
    pack_rhs(PackedOperand{m.data(), 1, m.outerStride()}, 0, m.cols(), j0, count, buffer_.data());
    packed_of_ = nullptr;
    return buffer_.data();
  }

 private:
  // The buffer only grows: a thread's calls of the same shapes allocate nothing.
  void grow(Index size) {
    if (static_cast<Index>(buffer_.size()) < size) buffer_.resize(static_cast<std::size_t>(size));
  }

  std::vector<float, Eigen::aligned_allocator<float>> buffer_;
  const float* packed_of_ = nullptr;
};

// One matrix packed as bf16 panels (bf16_gemm.hpp's B, for Precision::bf16's tiles), kept while
// the same matrix is asked for again, two ways as PanelBuffer packs:
//   transposed  for products x · mᵀ: panels of 16 rows of m over its C columns' pairs; rows j0 (a
//               multiple of 16) onwards start at panel j0 / 16, transposed_stride(m) lanes apart;
//   rows        for products x · m: panels of 16 columns of m over its R rows' pairs
//               (rows_stride(m) lanes apart); rows i0 (even) onwards start i0 / 2 · 16 lanes in.
class Bf16PanelBuffer {
 public:
  void forget() { packed_of_ = nullptr; }

  const std::uint32_t* transposed(const ConstStridedMap<float>& m) {
    if (packed_of_ != m.data()) {
      grow(bf16_panels(m.rows()) * transposed_stride(m));
      pack_bf16_transposed(m.data(), m.rows(), m.cols(), m.outerStride(), buffer_.data(), rounded_);
      packed_of_ = m.data();
    }
    return buffer_.data();
  }
  static Index transposed_stride(const ConstStridedMap<float>& m) {
    return bf16_pairs(m.cols()) * Bf16GemmShape::kNr;
  }

  const std::uint32_t* rows(const ConstStridedMap<float>& m) {
    if (packed_of_ != m.data()) {
      grow(bf16_panels(m.cols()) * rows_stride(m));
      pack_bf16_columns(m.data(), m.rows(), m.cols(), m.outerStride(), buffer_.data());
      packed_of_ = m.data();
    }
    return buffer_.data();
  }
  static Index rows_stride(const ConstStridedMap<float>& m) {
    return bf16_pairs(m.rows()) * Bf16GemmShape::kNr;
  }

  // Rows j0 .. j0 + count - 1 of m alone, packed at every call (a block that does not start
  // where the whole head's panels or pairs do), transposed or as rows; their panels are then
  // bf16_pairs(m.cols()) · 16, or bf16_pairs(count) · 16, lanes apart.
  const std::uint32_t* block_transposed(const ConstStridedMap<float>& m, Index j0, Index count) {
    grow(bf16_panels(count) * transposed_stride(m));
    pack_bf16_transposed(m.data() + j0 * m.outerStride(), count, m.cols(), m.outerStride(),
                         buffer_.data(), rounded_);
    packed_of_ = nullptr;
    return buffer_.data();
  }
  const std::uint32_t* block_rows(const ConstStridedMap<float>& m, Index j0, Index count) {
    grow(bf16_panels(m.cols()) * bf16_pairs(count) * Bf16GemmShape::kNr);
    pack_bf16_columns(m.data() + j0 * m.outerStride(), count, m.cols(), m.outerStride(),
                      buffer_.data());
    packed_of_ = nullptr;
    return buffer_.data();
  }

 private:
  void grow(Index size) {
    if (static_cast<Index>(buffer_.size()) < size) buffer_.resize(static_cast<std::size_t>(size));
  }

  Bf16Lanes buffer_, rounded_;
  const float* packed_of_ = nullptr;
};

// A thread's packed operands. The forward: keys transposed (q kᵀ), values as rows (p v). The
// backward also: values transposed (dO vᵀ), keys as rows (dS k), and each query head's queries
// and output gradients as rows (dSᵀ q, Pᵀ dO).
struct FlashPanels {
  PanelBuffer keys, values, block_keys;
  PanelBuffer values_transposed, key_rows, queries, grad_out, block_values;
  // Precision::bf16's tiles (flash_bf16.hpp), the same matrices packed the same ways as bf16
  // panels, and one buffer each way for a block packed apart (one that does not start at a
  // panel or pair of the whole); a block of queries or output gradients, and a tile of
  // probabilities or score gradients, as rows of pairs; a tile's columns through panels into
  // rows of pairs (its transpose, for Pᵀ dO and dSᵀ q).
  Bf16PanelBuffer bf16_keys, bf16_values, bf16_values_transposed, bf16_key_rows, bf16_query_rows,
      bf16_grad_out_rows, bf16_block_transposed, bf16_block_rows;
  Bf16Lanes bf16_queries, bf16_grad_out, bf16_probabilities, bf16_tile_panels, bf16_tile_columns;

  void forget() {
    for (PanelBuffer* buffer : {&keys, &values, &block_keys, &values_transposed, &key_rows,
                                &queries, &grad_out, &block_values}) {
      buffer->forget();
    }
    for (Bf16PanelBuffer* buffer :
         {&bf16_keys, &bf16_values, &bf16_values_transposed, &bf16_key_rows, &bf16_query_rows,
          &bf16_grad_out_rows, &bf16_block_transposed, &bf16_block_rows}) {
      buffer->forget();
    }
  }

  // Rows j0 .. j0 + count - 1 of m transposed (keys for q kᵀ, values for dO vᵀ): from the whole
  // head's panels where j0 starts one, else packed apart.
  static const float* transposed_block(PanelBuffer& whole, PanelBuffer& block,
                                       const ConstStridedMap<float>& m, Index j0, Index count) {
    return j0 % PackedGemmShape::kNr == 0 ? whole.transposed(m) + j0 * m.cols()
                                          : block.block_transposed(m, j0, count);
  }
};

}  // namespace mha::detail
