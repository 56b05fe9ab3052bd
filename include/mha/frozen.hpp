// FrozenMultiHeadAttention<T>: a MultiHeadAttention for inference only, whose projection weights
// are packed once, when it is made, as ONNX Runtime packs them when its session is created and
// torch.jit.freeze folds a module's parameters into constants.
//
//   const mha::FrozenMultiHeadAttention<float> frozen(layer);  // copies and packs the weights
//   auto result = frozen.forward(x, options);                   // bit for bit layer.forward's
//
// Why a type of its own: a layer hands out views of its parameters that optimisers and
// set_parameter write through, and packed copies kept inside it would go stale. A frozen layer
// owns its copy and offers no way to change it, so its packed weights always match; to change
// the weights, change the layer and freeze it again.
//
// Which layers pack: float ones, on CPUs where the library's packed GEMM runs (AVX2 with FMA or
// AVX-512, kernels/packed_gemm.hpp); weights_packed() says whether this one did. Other types
// and CPUs compute exactly as the layer does. The packed panels take about as much memory as the
// weights themselves, beside the copy. Products of a few rows (a decoding step's tokens) are dot
// products, as in the layer, for which packing gains nothing: decode runs as the layer's.
//
// Threads: as a MultiHeadAttention's const members (forward and decode may be called at once
// from many threads, each with its own Workspace, result and cache).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "mha/multihead_attention.hpp"

namespace mha {

template <class T>
class FrozenMultiHeadAttention {
 public:
  // A copy of `layer` as it is now, with its weights packed.
  explicit FrozenMultiHeadAttention(const MultiHeadAttention<T>& layer)
      : layer_(layer), packed_(detail::PackedProjections::pack(layer_.parameters_)) {}

  // MultiHeadAttention::from_state_dict, frozen.
  static FrozenMultiHeadAttention from_state_dict(const std::map<std::string, Tensor<T>>& state,
                                                  Index num_heads, bool add_zero_attn = false) {
    return FrozenMultiHeadAttention(
        MultiHeadAttention<T>::from_state_dict(state, num_heads, add_zero_attn));
  }

  // The frozen layer, to read (config, parameters, state_dict).
  const MultiHeadAttention<T>& layer() const { return layer_; }
  const MultiHeadAttentionConfig& config() const { return layer_.config(); }

  // Whether the projections run on weights packed once (see the top of this file).
  bool weights_packed() const { return !packed_.query.empty(); }

  // MultiHeadAttention::forward, with the same checks and results.
  ForwardResult<T> forward(TensorView<const T> query, TensorView<const T> key,
                           TensorView<const T> value, const ForwardOptions<T>& options = {}) const {
    Workspace<T> workspace;
    ForwardResult<T> result;
    forward(query, key, value, options, workspace, result);
    return result;
  }
  void forward(TensorView<const T> query, TensorView<const T> key, TensorView<const T> value,
               const ForwardOptions<T>& options, Workspace<T>& workspace,
               ForwardResult<T>& result) const {
    const detail::LayerParameters<T>& parameters = layer_.parameters_;
    const detail::ForwardPlan plan = detail::plan_forward(parameters, query, key, value, options);
    const auto core = detail::core_options(parameters, plan, options);
    detail::run_forward(parameters, plan, core, query, key, value, options, workspace, result,
                        nullptr, weights_packed() ? &packed_ : nullptr);
  }
  ForwardResult<T> forward(TensorView<const T> x, const ForwardOptions<T>& options = {}) const {
    return forward(x, x, x, options);
  }

  // MultiHeadAttention::decode.
  ForwardResult<T> decode(
      TensorView<const T> x, KVCache<T>& cache,
      const ForwardOptions<T>& options = MultiHeadAttention<T>::decode_options(),
      const std::vector<Index>& new_tokens = {}) const {
    return layer_.decode(x, cache, options, new_tokens);
  }

 private:
  MultiHeadAttention<T> layer_;
  detail::PackedProjections packed_;
};

}  // namespace mha
