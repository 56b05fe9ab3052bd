// Saving and loading a FrozenMultiHeadAttention<float> with int8 weights
// (FrozenWeights::int8) as a safetensors file, so that a server loads the quantized layer as it
// was made, without the float weights and without quantizing again.
//
// The names in the file (docs/precision.md):
//   every entry of the frozen layer's state_dict but its projection weights, under its own name,
//     as F32 (biases, bias_k and bias_v, the talking-heads mixes);
//   each projection weight W (in_proj_weight, or q_proj_weight, k_proj_weight and v_proj_weight;
//     and out_proj.weight) as two tensors:
//       W.int8   I8  [N, K]  the values q, in [-127, 127]
//       W.scale  F32 [N]     one scale per output row: Ŵ[n][k] = scale[n] · q[n][k]
//   and the metadata entry "mha.weights" = "int8".
// As with MultiHeadAttention::from_state_dict, num_heads and add_zero_attn are not in the file:
// they are arguments. A file that is not such a file (no "mha.weights" = "int8", a W.int8
// without its W.scale, another dtype or shape, a value of -128, a scale negative or not finite)
// throws FileError naming the tensor; a state that is no layer's throws mha::ShapeError.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <utility>

#include "mha/frozen.hpp"
#include "mha/io/safetensors.hpp"

namespace mha::io {

inline constexpr const char* kInt8CodesSuffix = ".int8";
inline constexpr const char* kInt8ScalesSuffix = ".scale";

// The file's tensors and metadata for `frozen` (which must have int8 weights).
inline SafetensorsFile int8_file(const FrozenMultiHeadAttention<float>& frozen,
                                 std::map<std::string, std::string> metadata = {}) {
  if (!frozen.weights_int8()) {
    mha::detail::throw_argument("frozen",
                                "expected a layer with int8 weights "
                                "(FrozenWeights::int8), got one without");
  }
  SafetensorsFile file;
  file.metadata = std::move(metadata);
  file.metadata["mha.weights"] = "int8";
  const auto int8 = frozen.int8_weights();
  for (const auto& [name, tensor] : frozen.layer().state_dict()) {
    const auto weight = int8.find(name);
    if (weight == int8.end()) {
      file.tensors.emplace(name, from_tensor(tensor));
      continue;
    }
    StoredTensor codes;
    codes.dtype = Dtype::I8;
    codes.shape = Shape{weight->second.outputs, weight->second.depth};
    codes.bytes.resize(weight->second.values.size());
    for (std::size_t i = 0; i < codes.bytes.size(); ++i) {
      codes.bytes[i] = static_cast<unsigned char>(weight->second.values[i]);
    }
    file.tensors.emplace(name + kInt8CodesSuffix, std::move(codes));
    Tensor<float> scales(Shape{weight->second.outputs});
    std::copy(weight->second.scales.begin(), weight->second.scales.end(), scales.data());
    file.tensors.emplace(name + kInt8ScalesSuffix, from_tensor(scales));
  }
  return file;
}

inline void save_int8(const FrozenMultiHeadAttention<float>& frozen, const std::string& path,
                      std::map<std::string, std::string> metadata = {}) {
  write_safetensors(path, int8_file(frozen, std::move(metadata)));
}

namespace detail {

// The int8 weight stored as `name`.int8 and `name`.scale.
inline mha::detail::Int8Weight int8_weight_of(const SafetensorsFile& file,
                                              const std::string& name) {
  const std::string codes_name = name + kInt8CodesSuffix, scales_name = name + kInt8ScalesSuffix;
  const StoredTensor& codes = file.at(codes_name);
  if (codes.dtype != Dtype::I8 || codes.shape.size() != 2) {
    throw FileError("tensor " + quote(codes_name) + ": expected I8 [N, K], got " +
                    dtype_name(codes.dtype) + " " + mha::detail::format_shape(codes.shape));
  }
  if (!file.has(scales_name)) {
    throw FileError("tensor " + quote(codes_name) + " has no scales: missing tensor " +
                    quote(scales_name));
  }
  const Tensor<float> scales = to_tensor<float>(file.at(scales_name), scales_name);
  if (scales.shape() != Shape{codes.shape[0]}) {
    throw FileError("tensor " + quote(scales_name) + ": expected [" +
                    std::to_string(codes.shape[0]) + "], one scale per row of " +
                    quote(codes_name) + ", got " + mha::detail::format_shape(scales.shape()));
  }
  mha::detail::Int8Weight weight;
  weight.outputs = codes.shape[0];
  weight.depth = codes.shape[1];
  const std::size_t count = checked_element_count(codes, codes_name);
  weight.values.resize(count);
  for (std::size_t i = 0; i < count; ++i) {
    weight.values[i] = static_cast<std::int8_t>(codes.bytes[i]);
    if (weight.values[i] == -128) {
      throw FileError("tensor " + quote(codes_name) + ": expected values in [-127, 127], got -128");
    }
  }
  weight.scales.assign(scales.data(), scales.data() + scales.size());
  for (const float scale : weight.scales) {
    if (!std::isfinite(scale) || scale < 0.0F) {
      throw FileError("tensor " + quote(scales_name) + ": expected finite scales >= 0, got " +
                      std::to_string(scale));
    }
  }
  return weight;
}

}  // namespace detail

// The frozen layer a file written by save_int8 (or int8_file) holds.
inline FrozenMultiHeadAttention<float> frozen_int8_from_file(const SafetensorsFile& file,
                                                             Index num_heads,
                                                             bool add_zero_attn = false) {
  const auto kind = file.metadata.find("mha.weights");
  if (kind == file.metadata.end() || kind->second != "int8") {
    throw FileError(
        "expected the metadata entry \"mha.weights\": \"int8\" of a file written by "
        "save_int8, got " +
        (kind == file.metadata.end() ? std::string("none") : detail::quote(kind->second)));
  }
  std::map<std::string, Tensor<float>> state;
  std::map<std::string, mha::detail::Int8Weight> int8;
  for (const auto& [name, stored] : file.tensors) {
    if (detail::ends_with(name, kInt8ScalesSuffix)) continue;  // (read with its codes)
    if (!detail::ends_with(name, kInt8CodesSuffix)) {
      state.emplace(name, to_tensor<float>(stored, name));
      continue;
    }
    const std::string weight_name =
        name.substr(0, name.size() - std::string(kInt8CodesSuffix).size());
    mha::detail::Int8Weight weight = detail::int8_weight_of(file, weight_name);
    Tensor<float> dequantized(Shape{weight.outputs, weight.depth});
    for (Index n = 0; n < weight.outputs; ++n) {
      for (Index k = 0; k < weight.depth; ++k) {
        dequantized.data()[n * weight.depth + k] = weight.dequantized(n, k);
      }
    }
    state.emplace(weight_name, std::move(dequantized));
    int8.emplace(weight_name, std::move(weight));
  }
  for (const auto& [name, stored] : file.tensors) {
    static_cast<void>(stored);
    if (detail::ends_with(name, kInt8ScalesSuffix) &&
        int8.count(name.substr(0, name.size() - std::string(kInt8ScalesSuffix).size())) == 0) {
      throw FileError("tensor " + detail::quote(name) + ": scales without their values");
    }
  }
  return {MultiHeadAttention<float>::from_state_dict(state, num_heads, add_zero_attn),
          std::move(int8)};
}

inline FrozenMultiHeadAttention<float> load_int8(const std::string& path, Index num_heads,
                                                 bool add_zero_attn = false) {
  const SafetensorsFile file = read_safetensors(path);
  try {
    return frozen_int8_from_file(file, num_heads, add_zero_attn);
  } catch (const FileError& error) {
    throw FileError("safetensors file " + detail::quote(path) + ": " + error.what());
  }
}

}  // namespace mha::io
