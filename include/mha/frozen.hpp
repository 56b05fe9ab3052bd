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
// On CPUs with AVX512_BF16 every frozen layer also packs its weights as bf16 panels (half of a
// float layer's weight bytes more) for Precision::bf16, in forward and in decode, whose
// projections then read half the bytes of float weights.
//
// FrozenWeights::int8 quantizes the projection weights (W_q, W_k, W_v, W_o) to int8, one scale
// per output row (kernels/int8_weights.hpp), as PyTorch's and ONNX Runtime's dynamic
// quantization and CTranslate2's int8 do: the frozen layer's weights become the quantized Ŵ
// (layer() holds them; bias and everything else are kept), every product multiplies by Ŵ, and
// the products of a few rows (a decoding step's tokens) read the int8 values, a quarter of float
// weights' bytes. With Precision::int8 the projections also quantize their inputs, a scale per
// row, and run as int8 × int8 products (kernels/int8_gemm.hpp). Float layers only.
//
// Threads: as a MultiHeadAttention's const members (forward and decode may be called at once
// from many threads, each with its own Workspace, result and cache).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "mha/multihead_attention.hpp"

namespace mha {

// What a frozen layer does with its projection weights (see the top): keeps them, or quantizes
// them to int8.
enum class FrozenWeights { as_given, int8 };

template <class T>
class FrozenMultiHeadAttention {
 public:
  // A copy of `layer` as it is now, with its weights packed (and quantized, with
  // FrozenWeights::int8).
  explicit FrozenMultiHeadAttention(const MultiHeadAttention<T>& layer,
                                    FrozenWeights weights = FrozenWeights::as_given)
      : layer_(layer) {
    std::map<std::string, detail::Int8Weight> int8;
    if (weights == FrozenWeights::int8) int8 = quantize_weights();
    packed_ = detail::PackedProjections::pack(layer_.parameters_);
    if (weights == FrozenWeights::int8) split_int8(int8);
  }

  // A frozen layer on int8 weights quantized before (as int8_weights() returns them, by weight
  // name): how io::load_int8 restores a saved one without quantizing again. The layer's
  // projection weights become what the int8 values stand for; the names, shapes, scales (finite,
  // >= 0) and values (in [-127, 127]) are checked.
  FrozenMultiHeadAttention(const MultiHeadAttention<T>& layer,
                           std::map<std::string, detail::Int8Weight> int8)
      : layer_(layer) {
    check_float_layer();
    adopt_int8(int8);
    packed_ = detail::PackedProjections::pack(layer_.parameters_);
    split_int8(int8);
  }

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
  // Whether the weights were quantized to int8 (FrozenWeights::int8).
  bool weights_int8() const { return !packed_.int8_output.empty(); }
  // The int8 weights by the layer's weight names (in_proj_weight, or q_proj_weight,
  // k_proj_weight and v_proj_weight; out_proj.weight); empty unless weights_int8().
  std::map<std::string, detail::Int8Weight> int8_weights() const {
    std::map<std::string, detail::Int8Weight> int8;
    if (!weights_int8()) return int8;
    const detail::Int8Weight* inputs[] = {&packed_.int8_query, &packed_.int8_key,
                                          &packed_.int8_value};
    if (layer_.parameters_.packed_projection()) {
      detail::Int8Weight& whole = int8["in_proj_weight"];
      whole.depth = inputs[0]->depth;
      for (const detail::Int8Weight* part : inputs) {
        whole.outputs += part->outputs;
        whole.values.insert(whole.values.end(), part->values.begin(), part->values.end());
        whole.scales.insert(whole.scales.end(), part->scales.begin(), part->scales.end());
      }
    } else {
      for (int which = 0; which < 3; ++which) {
        int8[weight_names()[static_cast<std::size_t>(which)]] = *inputs[which];
      }
    }
    int8["out_proj.weight"] = packed_.int8_output;
    return int8;
  }

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
                        nullptr, &packed_);
  }
  ForwardResult<T> forward(TensorView<const T> x, const ForwardOptions<T>& options = {}) const {
    return forward(x, x, x, options);
  }

  // MultiHeadAttention::decode; with Precision::bf16 (which the layer refuses for decode) its
  // projections run in bf16 on the weights' bf16 panels, packed once.
  ForwardResult<T> decode(
      TensorView<const T> x, KVCache<T>& cache,
      const ForwardOptions<T>& options = MultiHeadAttention<T>::decode_options(),
      const std::vector<Index>& new_tokens = {}) const {
    return detail::Decoding<T>::step(layer_.parameters_, x, cache, options, new_tokens, &packed_);
  }
  ForwardResult<T> decode(
      TensorView<const T> x, PagedKVCache<T>& cache, const std::vector<Index>& sequences,
      const ForwardOptions<T>& options = MultiHeadAttention<T>::decode_options(),
      const std::vector<Index>& new_tokens = {}) const {
    return detail::Decoding<T>::step(layer_.parameters_, x, cache, sequences, options, new_tokens,
                                     &packed_);
  }

  // MultiHeadAttention::encode_memory (the memory is projected once, in fp32, as the layer does)
  // and cross_attend, whose query and output projections run on the packed weights, in bf16 or
  // int8 as options.precision asks.
  KVCache<T> encode_memory(TensorView<const T> memory, const std::vector<Index>& lengths = {},
                           KVCacheFormat format = KVCacheFormat::as_layer) const {
    return layer_.encode_memory(memory, lengths, format);
  }
  ForwardResult<T> cross_attend(
      TensorView<const T> x, KVCache<T>& memory,
      const ForwardOptions<T>& options = MultiHeadAttention<T>::cross_attention_options(),
      const std::vector<Index>& new_tokens = {}) const {
    return detail::Decoding<T>::cross_step(layer_.parameters_, x, memory, options, new_tokens,
                                           &packed_);
  }

 private:
  // The projection weights' names: in_proj_weight holds W_q, W_k and W_v as row blocks.
  std::vector<std::string> weight_names() const {
    if (layer_.parameters_.packed_projection()) return {"in_proj_weight", "out_proj.weight"};
    return {"q_proj_weight", "k_proj_weight", "v_proj_weight", "out_proj.weight"};
  }

  void check_float_layer() const {
    if (!std::is_same_v<T, float>) {
      detail::throw_argument("weights", "int8 weights are for float layers");
    }
  }

  // Each projection weight quantized to int8 (returned by name) and replaced by its Ŵ.
  std::map<std::string, detail::Int8Weight> quantize_weights() {
    check_float_layer();
    std::map<std::string, detail::Int8Weight> int8;
    for (const std::string& name : weight_names()) {
      const TensorView<const T> weight = std::as_const(layer_).parameter(name);
      if (!weight.matrix().allFinite()) {
        detail::throw_argument(
            "weights", "int8 quantization needs finite weights; " + name + " is not finite");
      }
      const Index rows = weight.dim(0), cols = weight.dim(1);
      detail::quantize_int8_weight(weight.data(), rows, cols, cols, int8[name]);
    }
    adopt_int8(int8);
    return int8;
  }

  // The layer's projection weights replaced by what the int8 weights stand for, after checking
  // that they are this layer's weights and valid int8 weights.
  void adopt_int8(const std::map<std::string, detail::Int8Weight>& int8) {
    const std::vector<std::string> names = weight_names();
    for (const auto& entry : int8) {
      if (std::find(names.begin(), names.end(), entry.first) == names.end()) {
        detail::throw_argument("int8",
                               "'" + entry.first + "' is not a projection weight of this layer");
      }
    }
    for (const std::string& name : names) {
      const auto found = int8.find(name);
      if (found == int8.end()) detail::throw_argument("int8", "missing the int8 weight " + name);
      const detail::Int8Weight& weight = found->second;
      const Shape shape = std::as_const(layer_).parameter(name).shape();
      const Index rows = shape[0], cols = shape[1];
      if (weight.outputs != rows || weight.depth != cols) {
        detail::throw_shape("int8 " + name, detail::format_shape(shape),
                            Shape{weight.outputs, weight.depth});
      }
      if (weight.values.size() != static_cast<std::size_t>(rows * cols) ||
          weight.scales.size() != static_cast<std::size_t>(rows)) {
        detail::throw_argument("int8", name + ": expected " + std::to_string(rows * cols) +
                                           " values and " + std::to_string(rows) + " scales");
      }
      for (const float scale : weight.scales) {
        if (!std::isfinite(scale) || scale < 0.0F) {
          detail::throw_argument(
              "int8", name + ": expected finite scales >= 0, got " + std::to_string(scale));
        }
      }
      for (const std::int8_t value : weight.values) {
        if (value < -127) {
          detail::throw_argument("int8", name + ": expected values in [-127, 127], got -128");
        }
      }
      Tensor<T> dequantized(shape);
      for (Index n = 0; n < rows; ++n) {
        for (Index k = 0; k < cols; ++k) {
          dequantized.data()[n * cols + k] = static_cast<T>(weight.dequantized(n, k));
        }
      }
      layer_.set_parameter(name, dequantized.view());
    }
  }

  // The quantized weights as the projections' (in_proj_weight's row blocks apart).
  void split_int8(std::map<std::string, detail::Int8Weight>& int8) {
    const detail::LayerParameters<T>& parameters = layer_.parameters_;
    detail::Int8Weight* inputs[] = {&packed_.int8_query, &packed_.int8_key, &packed_.int8_value};
    for (int which = 0; which < 3; ++which) {
      const detail::Int8Weight& whole =
          parameters.packed_projection() ? int8.at("in_proj_weight")
                                         : int8.at(weight_names()[static_cast<std::size_t>(which)]);
      const Index first = parameters.packed_projection() ? parameters.bias_offset(which) : 0;
      const Index rows = parameters.projection_width(which), depth = whole.depth;
      detail::Int8Weight& part = *inputs[which];
      part.outputs = rows;
      part.depth = depth;
      part.values.assign(whole.values.begin() + first * depth,
                         whole.values.begin() + (first + rows) * depth);
      part.scales.assign(whole.scales.begin() + first, whole.scales.begin() + first + rows);
    }
    packed_.int8_output = std::move(int8.at("out_proj.weight"));
    // Precision::int8's panels, where the CPU runs their products and their int32 sums cannot
    // overflow.
    if (detail::int8_dot_available()) {
      detail::Int8PackedWeight* panels[] = {&packed_.int8_panels_query, &packed_.int8_panels_key,
                                            &packed_.int8_panels_value,
                                            &packed_.int8_panels_output};
      for (int which = 0; which < 4; ++which) {
        if (packed_.int8_weight(which).depth > detail::kInt8MaxDepth) continue;
        detail::pack_int8_weight(packed_.int8_weight(which), *panels[which]);
      }
    }
  }

  MultiHeadAttention<T> layer_;
  detail::PackedProjections packed_;
};

}  // namespace mha
