// The translation unit that tools/lint gives clang-tidy in place of the test programs: every
// header of include/mha, and the library's class templates instantiated for float, so that
// clang-tidy sees each member function's body with a real type (header-only: the layer's member
// functions instantiate the rooms of mha/layer/ and the kernels). clang-tidy takes about as long on
// one Eigen-heavy test program as on this whole unit; all the tests would take ~40 minutes.
// tools/lint fails when a header of include/mha is missing here.

#include "mha/attention.hpp"
#include "mha/compiled.hpp"
#include "mha/diagnostics.hpp"
#include "mha/dual.hpp"
#include "mha/errors.hpp"
#include "mha/finite.hpp"
#include "mha/flex.hpp"
#include "mha/flex_layer.hpp"
#include "mha/frozen.hpp"
#include "mha/heads.hpp"
#include "mha/heatmap.hpp"
#include "mha/heatmap_impl.hpp"
#include "mha/init.hpp"
#include "mha/io/checkpoints.hpp"
#include "mha/io/element_bits.hpp"
#include "mha/io/int8_checkpoint.hpp"
#include "mha/io/safetensors.hpp"
#include "mha/io/safetensors_format.hpp"
#include "mha/io/safetensors_format_impl.hpp"
#include "mha/kernels/bf16_gemm.hpp"
#include "mha/kernels/bf16_matrix_product.hpp"
#include "mha/kernels/bf16_projection.hpp"
#include "mha/kernels/common.hpp"
#include "mha/kernels/convert.hpp"
#include "mha/kernels/decode.hpp"
#include "mha/kernels/decode_avx2.hpp"
#include "mha/kernels/decode_products.hpp"
#include "mha/kernels/decode_q4.hpp"
#include "mha/kernels/flash.hpp"
#include "mha/kernels/flash_bf16.hpp"
#include "mha/kernels/flash_panels.hpp"
#include "mha/kernels/flash_small_head.hpp"
#include "mha/kernels/flex_tile.hpp"
#include "mha/kernels/fp16_products.hpp"
#include "mha/kernels/gemm.hpp"
#include "mha/kernels/int8_gemm.hpp"
#include "mha/kernels/int8_weights.hpp"
#include "mha/kernels/packed_gemm.hpp"
#include "mha/kernels/prepacked_gemm.hpp"
#include "mha/kernels/quantized_cache.hpp"
#include "mha/kernels/reference.hpp"
#include "mha/kernels/sinks.hpp"
#include "mha/kernels/talking_heads.hpp"
#include "mha/kernels/tile_product.hpp"
#include "mha/kernels/unroll.hpp"
#include "mha/kv_cache.hpp"
#include "mha/layer/config.hpp"
#include "mha/layer/decode.hpp"
#include "mha/layer/forward.hpp"
#include "mha/layer/head_surgery.hpp"
#include "mha/layer/options.hpp"
#include "mha/layer/parameters.hpp"
#include "mha/layer/projections.hpp"
#include "mha/layer/training.hpp"
#include "mha/loss_scaling.hpp"
#include "mha/mask.hpp"
#include "mha/mha.hpp"
#include "mha/mods.hpp"
#include "mha/multihead_attention.hpp"
#include "mha/optim.hpp"
#include "mha/paged_kv_cache.hpp"
#include "mha/parameters.hpp"
#include "mha/print.hpp"
#include "mha/rotary.hpp"
#include "mha/softmax.hpp"
#include "mha/tensor.hpp"
#include "mha/version.hpp"
#if defined(MHA_LINT_PNG)  // mha::png, when stb was found
#include "mha/io/heatmap_png.hpp"
#endif

template class mha::MultiHeadAttention<float>;
template class mha::FrozenMultiHeadAttention<float>;
template class mha::KVCache<float>;
template class mha::Mask<float>;
template class mha::GradScaler<float>;
template class mha::Sgd<float>;
template class mha::Adam<float>;
template class mha::AdamW<float>;
template class mha::BlockMask<mha::mods::Causal>;
template struct mha::mods::RelativeBias<float>;
template struct mha::mods::LearnedAlibi<float>;
template struct mha::Dual<float>;

// flex_attention's forward and backward, with a score_mod of the row form (ALiBi) and one of
// calls only (a chain), so that clang-tidy reads the flash kernels' flex paths.
mha::AttentionGradients<float> lint_flex_attention(const mha::Tensor<float>& q) {
  const auto mask = mha::create_block_mask(mha::mods::causal(), 1, 1, q.dim(1), q.dim(1));
  const mha::mods::Alibi<float> alibi{mha::alibi_slopes<float>(q.dim(0)), 0};
  const auto chain = mha::mods::score_chain(alibi, mha::mods::Softcap<float>{5.0F});
  const auto result = mha::flex_attention(q, q, q, alibi, mask);
  (void)mha::flex_attention_backward(q, q, q, result, q, alibi, mask);
  const auto chained = mha::flex_attention(q, q, q, chain);
  return mha::flex_attention_backward(q, q, q, chained, q, chain);
}

// flex_decode with a mask_mod over a KVCache and a block mask over a paged cache, and
// flex_forward, so that clang-tidy reads the layer's flex paths.
mha::Tensor<float> lint_flex_decode(const mha::MultiHeadAttention<float>& layer,
                                    const mha::Tensor<float>& x) {
  auto cache = layer.make_kv_cache(x.dim(0), 64);
  const mha::mods::Softcap<float> softcap{5.0F};
  (void)mha::flex_decode(layer, x, cache, softcap, mha::mods::SlidingWindow{8, 0});
  auto paged = layer.make_paged_kv_cache(48, 4);
  const mha::Index sequence = paged.add_sequence();
  const auto mask = mha::create_block_mask(mha::mods::causal(), 1, 1, 64, 64);
  (void)mha::flex_forward(layer, x, softcap, mask);
  return mha::flex_decode(layer, x, paged, {sequence}, mha::no_score_mod, mask).output;
}
