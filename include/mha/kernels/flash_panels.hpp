// The flash kernel's keys and values as the packed GEMM's right-hand panels (packed_gemm.hpp), so
// that its tile products run on the micro-kernel without packing the same keys and values again
// for every query block: one thread's packed copy of the head it is working on, keys as panels
// of kNr keys over D, values as panels of kNr value columns over S'. (The left operands, a
// query block and a tile's probabilities, are read by the micro-kernel as the rows they are.)
//
// Shapes: a head's keys k [S', D] and values v [S', Dv]; a key block j0 .. j0 + cols - 1.
#pragma once

#include <vector>

#include "mha/kernels/packed_gemm.hpp"

namespace mha::detail {

class FlashPanels {
 public:
  // Forgets the packed head: a new call's keys and values may sit where the last call's did.
  void forget() { keys_of_ = values_of_ = nullptr; }

  // k [S', D] as panels of kNr keys, each D x kNr, packed once per head (keys_of_ remembers
  // which): key block j0 (a multiple of kNr) starts at panel j0 / kNr.
  const float* head_keys(const ConstStridedMap<float>& k) {
    if (keys_of_ != k.data()) {
      grow(keys_, packed_size(k.rows(), PackedGemmShape::kNr, k.cols()));
      pack_rhs(PackedOperand{k.data(), 1, k.outerStride()}, 0, k.cols(), 0, k.rows(), keys_.data());
      keys_of_ = k.data();
    }
    return keys_.data();
  }
  // v [S', Dv] as panels of kNr value columns, each S' x kNr: a key block's rows of panel p start
  // at p * value_panel_stride(v) + j0 * kNr.
  const float* head_values(const ConstStridedMap<float>& v) {
    if (values_of_ != v.data()) {
      grow(values_, packed_size(v.cols(), PackedGemmShape::kNr, v.rows()));
      pack_rhs(PackedOperand{v.data(), v.outerStride(), 1}, 0, v.rows(), 0, v.cols(),
               values_.data());
      values_of_ = v.data();
    }
    return values_.data();
  }
  static Index value_panel_stride(const ConstStridedMap<float>& v) {
    return v.rows() * PackedGemmShape::kNr;
  }

  // Keys j0 .. j0 + cols - 1 of k as panels of their own, for a block that does not start at a
  // panel of the packed head (a window's or a pattern's first visible key).
  const float* block_keys(const ConstStridedMap<float>& k, Index j0, Index cols) {
    grow(block_keys_, packed_size(cols, PackedGemmShape::kNr, k.cols()));
    pack_rhs(PackedOperand{k.data(), 1, k.outerStride()}, 0, k.cols(), j0, cols,
             block_keys_.data());
    return block_keys_.data();
  }

 private:
  using Buffer = std::vector<float, Eigen::aligned_allocator<float>>;
  // Buffers only grow: a thread's calls of the same shapes allocate nothing.
  static void grow(Buffer& buffer, Index size) {
    if (static_cast<Index>(buffer.size()) < size) buffer.resize(static_cast<std::size_t>(size));
  }

  Buffer keys_, values_, block_keys_;
  const float* keys_of_ = nullptr;
  const float* values_of_ = nullptr;
};

}  // namespace mha::detail
