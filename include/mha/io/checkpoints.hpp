// Loading one attention layer of a Hugging Face safetensors checkpoint into MultiHeadAttention<T>,
// by the tensor names and layouts of its model family, with the ForwardOptions that family's
// attention needs. (A torch.nn.MultiheadAttention state_dict needs no conversion: see
// load_parameters in safetensors.hpp and MultiHeadAttention::from_state_dict.)
//
// The layouts converted, for layer i (E = hidden size, H heads of width D, H_kv key/value heads):
//   BERT (and RoBERTa etc.)  PREFIX encoder.layer.{i}.attention.
//     self.query/key/value.weight [E, E], .bias [E]  nn.Linear, y = x Wᵀ + b
//       -> in_proj_weight [3E, E] = rows of W_q, W_k, W_v; in_proj_bias [3E] = b_q, b_k, b_v
//     output.dense.weight [E, E], .bias [E]          -> out_proj.weight, out_proj.bias
//     (output.LayerNorm and the residual belong to BertSelfOutput, not to the attention: ignored)
//     options: bidirectional (no mask; pass the padding mask as key_padding_mask).
//   GPT-2                    PREFIX h.{i}.attn.
//     c_attn.weight [E, 3E], .bias [3E]  Conv1D, y = x W + b: the transpose of nn.Linear; output
//                                        columns 0:E are q, E:2E k, 2E:3E v
//       -> in_proj_weight [3E, E] = c_attn.weightᵀ, in_proj_bias = c_attn.bias
//     c_proj.weight [E, E], .bias [E]    -> out_proj.weight = c_proj.weightᵀ, out_proj.bias
//     options: is_causal. (scale_attn_by_inverse_layer_idx, off in GPT-2's configs, is not
//     applied; the attn.bias / attn.masked_bias buffers of older checkpoints are ignored.)
//   Llama, Mistral, Qwen2    PREFIX layers.{i}.self_attn.
//     q_proj.weight [H·D, E] -> q_proj_weight; k_proj.weight, v_proj.weight [H_kv·D, E] ->
//       k_proj_weight, v_proj_weight (in_proj_weight [3E, E] when H_kv = H); o_proj.weight
//       [E, H·D] -> out_proj.weight. No biases (bias = false), or q/k/v_proj.bias together
//       (attention_bias; Qwen2) -> in_proj_bias [H·D + 2·H_kv·D], with o_proj.bias or zeros
//       -> out_proj.bias.
//     options: is_causal, rope = rotate_half (Hugging Face's layout) with base rope_theta over all
//     D features, positions 0 .. L-1. (rope_scaling and sliding windows are not applied.)
// PREFIX is found in the file: whatever precedes the family's layer names, empty or ending in '.'
// ("bert.", "roberta.", "transformer.", "model.", ...). A file holding layers under two prefixes
// is refused as ambiguous.
//
// What the tensors do not say is an argument: num_heads (all families), and for Llama
// num_kv_heads and head_dim (both inferred when 0: D = q_proj rows / H, H_kv = k_proj rows / D;
// checked against the tensors when given) and rope_theta. E comes from the tensors. Problems in
// the file (missing tensor, wrong shape or dtype, no layer of the family) throw FileError naming
// the layer and the tensor; bad arguments (layer out of range, num_heads not dividing) throw
// mha::ShapeError (std::invalid_argument).
//
// Tensors convert from F32, F64, F16 or BF16 to T = float, double, Eigen::half or
// Eigen::bfloat16 (see to_tensor: an F16 checkpoint loads into a half layer bit for bit).
#pragma once

#include <algorithm>
#include <cctype>
#include <cmath>
#include <map>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "mha/errors.hpp"
#include "mha/io/safetensors.hpp"
#include "mha/multihead_attention.hpp"
#include "mha/rotary.hpp"
#include "mha/tensor.hpp"

namespace mha::io {

// A loaded attention layer and how to call it: layer.forward(x, options) computes the family's
// attention output for hidden states x [B, L, E]. options.need_weights is false (as Hugging Face
// without output_attentions), which lets the flash kernel run; set it to get the weights.
template <class T>
struct LoadedAttention {
  MultiHeadAttention<T> layer;
  ForwardOptions<T> options;
  // The names' common part for this layer, e.g. "model.layers.1.self_attn.".
  std::string prefix;
  // The attention layers in the file (one more than the largest layer index found).
  Index num_layers = 0;
};

// The hyperparameters of a Llama-family attention layer that its tensors do not carry
// (config.json's names in the comments).
struct LlamaAttentionConfig {
  Index num_heads = 0;        // num_attention_heads
  Index num_kv_heads = 0;     // num_key_value_heads; 0 = k_proj.weight rows / head_dim
  Index head_dim = 0;         // head_dim; 0 = q_proj.weight rows / num_heads
  double rope_theta = 10000;  // rope_theta

  LlamaAttentionConfig() = default;
  explicit LlamaAttentionConfig(Index num_heads_, Index num_kv_heads_ = 0,
                                double rope_theta_ = 10000)
      : num_heads(num_heads_), num_kv_heads(num_kv_heads_), rope_theta(rope_theta_) {}
};

namespace detail {

// How one family names its layers: PREFIX + stem + {i} + probe names a tensor that every layer
// has, e.g. "bert." + "encoder.layer." + "1" + ".attention.self.query.weight".
struct LayerNaming {
  const char* family;  // for messages: "BERT"
  const char* stem;    // "encoder.layer."
  const char* probe;   // ".attention.self.query.weight"
  const char* block;   // the layer's attention tensors after PREFIX + stem + {i}: ".attention."
};

// The layer indices found under each prefix. Indices are decimal without leading zeros, and short
// enough not to overflow: "layers.01." or a 30-digit index is not a layer of this family.
inline std::map<std::string, std::set<Index>> find_layers(const SafetensorsFile& file,
                                                          const LayerNaming& naming) {
  std::map<std::string, std::set<Index>> found;
  const std::string stem = naming.stem, probe = naming.probe;
  for (const auto& entry : file.tensors) {
    const std::string& name = entry.first;
    if (!ends_with(name, probe)) continue;
    const std::string head = name.substr(0, name.size() - probe.size());  // PREFIX stem {i}
    std::size_t digits = 0;
    while (digits < head.size() &&
           std::isdigit(static_cast<unsigned char>(head[head.size() - 1 - digits])) != 0) {
      ++digits;
    }
    if (digits == 0 || digits > 9) continue;
    const std::string number = head.substr(head.size() - digits);
    if (number.size() > 1 && number[0] == '0') continue;
    const std::string before = head.substr(0, head.size() - digits);  // PREFIX stem
    if (!ends_with(before, stem)) continue;
    const std::string prefix = before.substr(0, before.size() - stem.size());
    if (!prefix.empty() && prefix.back() != '.') continue;
    found[prefix].insert(static_cast<Index>(std::stol(number)));
  }
  return found;
}

// Reads one family's layer `layer` by name, checking every shape before converting anything.
class LayerReader {
 public:
  LayerReader(const SafetensorsFile& file, const LayerNaming& naming, Index layer) : file_(file) {
    const auto found = find_layers(file, naming);
    what_ = std::string(naming.family) + " attention layer " + std::to_string(layer);
    if (found.empty()) {
      throw FileError(std::string("no ") + naming.family +
                      " attention layer in the file: no tensor named [PREFIX]" + naming.stem +
                      "{i}" + naming.probe);
    }
    if (found.size() > 1) {
      std::string prefixes;
      for (const auto& entry : found) {
        prefixes += (prefixes.empty() ? "" : ", ") + quote(entry.first);
      }
      throw FileError(std::string(naming.family) +
                      " attention layers under more than one prefix: " + prefixes);
    }
    num_layers_ = *found.begin()->second.rbegin() + 1;
    if (layer < 0 || layer >= num_layers_) {
      mha::detail::throw_argument(
          "layer", "must be in [0, " + std::to_string(num_layers_) + ") for the " +
                       std::to_string(num_layers_) + " " + naming.family +
                       " attention layers of this file, got " + std::to_string(layer));
    }
    prefix_ = found.begin()->first + naming.stem + std::to_string(layer) + naming.block;
  }

  const std::string& prefix() const { return prefix_; }
  Index num_layers() const { return num_layers_; }
  std::string name(const std::string& suffix) const { return prefix_ + suffix; }

  bool has(const std::string& suffix) const { return file_.has(name(suffix)); }

  const StoredTensor& get(const std::string& suffix) const {
    const std::string full = name(suffix);
    const auto it = file_.tensors.find(full);
    if (it == file_.tensors.end()) fail("missing tensor " + quote(full));
    return it->second;
  }

  // The tensor, whose shape must be `expected` (`symbolic` says what it means, e.g. "[E, E]").
  const StoredTensor& get(const std::string& suffix, const Shape& expected,
                          const std::string& symbolic) const {
    const StoredTensor& tensor = get(suffix);
    if (tensor.shape != expected) {
      fail("tensor " + quote(name(suffix)) + ": expected shape " + format_dims(expected) + " (" +
           symbolic + "), got " + format_dims(tensor.shape));
    }
    return tensor;
  }

  // A 2-D tensor of any positive size: the one whose shape defines E (and H·D, H_kv·D).
  const StoredTensor& get_matrix(const std::string& suffix, const std::string& symbolic) const {
    const StoredTensor& tensor = get(suffix);
    if (tensor.shape.size() != 2 || tensor.shape[0] <= 0 || tensor.shape[1] <= 0) {
      fail("tensor " + quote(name(suffix)) + ": expected shape " + symbolic +
           " with positive sizes, got " + format_dims(tensor.shape));
    }
    return tensor;
  }

  template <class T>
  Tensor<T> convert(const std::string& suffix) const {
    try {
      return to_tensor<T>(get(suffix), name(suffix));
    } catch (const FileError& error) {
      fail(error.what());
    }
  }

  [[noreturn]] void fail(const std::string& message) const {
    throw FileError(what_ + ": " + message);
  }

 private:
  const SafetensorsFile& file_;
  std::string what_;
  std::string prefix_;
  Index num_layers_ = 0;
};

// Rows of the 2-D tensors (or entries of the 1-D ones) one after the other: C order makes that
// their buffers one after the other.
template <class T>
Tensor<T> concat_rows(const std::vector<const Tensor<T>*>& parts) {
  Shape shape = parts.front()->shape();
  shape[0] = 0;
  for (const Tensor<T>* part : parts) shape[0] += part->dim(0);
  Tensor<T> out(shape);
  T* dst = out.data();
  for (const Tensor<T>* part : parts)
    dst = std::copy(part->data(), part->data() + part->size(), dst);
  return out;
}

template <class T>
Tensor<T> transposed(const Tensor<T>& matrix) {
  Tensor<T> out({matrix.dim(1), matrix.dim(0)});
  out.matrix() = matrix.matrix().transpose();
  return out;
}

inline void check_num_heads(Index num_heads) {
  if (num_heads <= 0) {
    mha::detail::throw_argument("num_heads", "must be positive, got " + std::to_string(num_heads));
  }
}

inline void check_divides(Index embed_dim, Index num_heads, const std::string& source) {
  if (embed_dim % num_heads != 0) {
    mha::detail::throw_argument(
        "num_heads", "embed_dim " + std::to_string(embed_dim) + " (from " + quote(source) +
                         ") is not divisible by num_heads " + std::to_string(num_heads));
  }
}

template <class T>
LoadedAttention<T> finish(const MultiHeadAttentionConfig& config,
                          const std::map<std::string, Tensor<T>>& state, ForwardOptions<T> options,
                          const LayerReader& reader) {
  MultiHeadAttention<T> layer(config);
  // Every shape was checked against the config above, so this only copies.
  layer.load_state_dict(state);
  options.need_weights = false;
  return LoadedAttention<T>{std::move(layer), std::move(options), reader.prefix(),
                            reader.num_layers()};
}

// Re-throws a FileError with the path in front, as the reader's own messages have it.
template <class F>
auto with_path(const std::string& path, F&& load) {
  const SafetensorsFile file = read_safetensors(path);
  try {
    return load(file);
  } catch (const FileError& error) {
    throw FileError("safetensors file " + quote(path) + ": " + error.what());
  }
}

}  // namespace detail

// BERT's attention layer `layer` (BertSelfAttention + BertSelfOutput.dense): E from the query
// weight, H = num_heads (config.json's num_attention_heads).
template <class T>
LoadedAttention<T> load_bert_attention(const SafetensorsFile& file, Index layer, Index num_heads) {
  detail::check_num_heads(num_heads);
  const detail::LayerReader reader(
      file, {"BERT", "encoder.layer.", ".attention.self.query.weight", ".attention."}, layer);
  const Index embed = reader.get_matrix("self.query.weight", "[E, E]").shape[0];
  const Shape square{embed, embed}, vector{embed};
  const std::string e = "E = " + std::to_string(embed);
  for (const char* part : {"self.query.", "self.key.", "self.value.", "output.dense."}) {
    reader.get(std::string(part) + "weight", square, "[E, E], " + e);
    reader.get(std::string(part) + "bias", vector, "[E], " + e);
  }
  detail::check_divides(embed, num_heads, reader.name("self.query.weight"));

  const auto q = reader.convert<T>("self.query.weight"), k = reader.convert<T>("self.key.weight"),
             v = reader.convert<T>("self.value.weight");
  const auto q_bias = reader.convert<T>("self.query.bias"),
             k_bias = reader.convert<T>("self.key.bias"),
             v_bias = reader.convert<T>("self.value.bias");
  std::map<std::string, Tensor<T>> state;
  state.emplace("in_proj_weight", detail::concat_rows<T>({&q, &k, &v}));
  state.emplace("in_proj_bias", detail::concat_rows<T>({&q_bias, &k_bias, &v_bias}));
  state.emplace("out_proj.weight", reader.convert<T>("output.dense.weight"));
  state.emplace("out_proj.bias", reader.convert<T>("output.dense.bias"));
  return detail::finish<T>(MultiHeadAttentionConfig(embed, num_heads), state, {}, reader);
}

// GPT-2's attention layer `layer` (GPT2Attention): E from c_attn.weight, H = num_heads (n_head).
template <class T>
LoadedAttention<T> load_gpt2_attention(const SafetensorsFile& file, Index layer, Index num_heads) {
  detail::check_num_heads(num_heads);
  const detail::LayerReader reader(file, {"GPT-2", "h.", ".attn.c_attn.weight", ".attn."}, layer);
  const Shape c_attn = reader.get_matrix("c_attn.weight", "[E, 3E]").shape;
  // A converter that wrote nn.Linear's layout would leave [3E, E]: say so rather than read the
  // first dimension as E.
  if (c_attn[0] == 3 * c_attn[1]) {
    reader.fail("tensor " + detail::quote(reader.name("c_attn.weight")) + " has shape " +
                detail::format_dims(c_attn) +
                ", nn.Linear's [3E, E]; GPT-2's Conv1D stores [E, 3E] (transposed)");
  }
  const Index embed = c_attn[0];
  const std::string e = "E = " + std::to_string(embed);
  // Conv1D stores [in, out]: c_attn maps E features to q, k and v. (Divided rather than 3 * E,
  // which could overflow for a shape built in memory that no buffer backs yet.)
  if (c_attn[1] % 3 != 0 || c_attn[1] / 3 != embed) {
    reader.fail("tensor " + detail::quote(reader.name("c_attn.weight")) +
                ": expected shape [E, 3E] (Conv1D: [in, out]), got " + detail::format_dims(c_attn));
  }
  reader.get("c_attn.bias", {c_attn[1]}, "[3E], " + e);
  reader.get("c_proj.weight", {embed, embed}, "[E, E], " + e);
  reader.get("c_proj.bias", {embed}, "[E], " + e);
  detail::check_divides(embed, num_heads, reader.name("c_attn.weight"));

  std::map<std::string, Tensor<T>> state;
  state.emplace("in_proj_weight", detail::transposed(reader.convert<T>("c_attn.weight")));
  state.emplace("in_proj_bias", reader.convert<T>("c_attn.bias"));
  state.emplace("out_proj.weight", detail::transposed(reader.convert<T>("c_proj.weight")));
  state.emplace("out_proj.bias", reader.convert<T>("c_proj.bias"));
  ForwardOptions<T> options;
  options.is_causal = true;
  return detail::finish<T>(MultiHeadAttentionConfig(embed, num_heads), state, std::move(options),
                           reader);
}

// A Llama-family attention layer `layer` (LlamaAttention, MistralAttention, Qwen2Attention):
// E from q_proj.weight's columns; see LlamaAttentionConfig for the rest.
template <class T>
LoadedAttention<T> load_llama_attention(const SafetensorsFile& file, Index layer,
                                        const LlamaAttentionConfig& config) {
  const Index heads = config.num_heads;
  detail::check_num_heads(heads);
  if (config.num_kv_heads < 0) {
    mha::detail::throw_argument("num_kv_heads", "must be positive (or 0 to infer it), got " +
                                                    std::to_string(config.num_kv_heads));
  }
  if (config.head_dim < 0) {
    mha::detail::throw_argument(
        "head_dim", "must be positive (or 0 to infer it), got " + std::to_string(config.head_dim));
  }
  if (!(config.rope_theta > 0) || !std::isfinite(config.rope_theta)) {
    mha::detail::throw_argument(
        "rope_theta", "must be finite and positive, got " + std::to_string(config.rope_theta));
  }
  const detail::LayerReader reader(
      file, {"Llama", "layers.", ".self_attn.q_proj.weight", ".self_attn."}, layer);
  const std::string q_name = reader.name("q_proj.weight"), k_name = reader.name("k_proj.weight");
  const StoredTensor& q = reader.get_matrix("q_proj.weight", "[H·D, E]");
  const Index inner = q.shape[0], embed = q.shape[1];
  if (inner % heads != 0) {
    mha::detail::throw_argument(
        "num_heads", "the " + std::to_string(inner) + " rows (H·D) of " + detail::quote(q_name) +
                         " are not divisible by num_heads " + std::to_string(heads));
  }
  const Index head_dim = inner / heads;
  if (config.head_dim != 0 && config.head_dim != head_dim) {
    mha::detail::throw_argument("head_dim", "got " + std::to_string(config.head_dim) +
                                                ", but the " + std::to_string(inner) +
                                                " rows (H·D) of " + detail::quote(q_name) +
                                                " with num_heads " + std::to_string(heads) +
                                                " make it " + std::to_string(head_dim));
  }
  if (head_dim % 2 != 0) {
    mha::detail::throw_argument(
        "head_dim", "rotary embeddings rotate pairs: it must be even, got " +
                        std::to_string(head_dim) + " (" + std::to_string(inner) + " rows of " +
                        detail::quote(q_name) + " / num_heads " + std::to_string(heads) + ")");
  }
  const StoredTensor& k = reader.get_matrix("k_proj.weight", "[H_kv·D, E]");
  const Index kv_rows = k.shape[0];
  const std::string sizes = "E = " + std::to_string(embed) + ", D = " + std::to_string(head_dim);
  if (config.num_kv_heads != 0 &&
      (kv_rows % head_dim != 0 || kv_rows / head_dim != config.num_kv_heads)) {
    mha::detail::throw_argument("num_kv_heads",
                                "got " + std::to_string(config.num_kv_heads) + ", but " +
                                    detail::quote(k_name) + " has " + std::to_string(kv_rows) +
                                    " rows (H_kv·D) for heads of D = " + std::to_string(head_dim));
  }
  if (kv_rows % head_dim != 0 || heads % (kv_rows / head_dim) != 0) {
    mha::detail::throw_argument(
        "num_heads", std::to_string(heads) + " heads of D = " + std::to_string(head_dim) +
                         " do not fit " + detail::quote(k_name) + "'s " + std::to_string(kv_rows) +
                         " rows: they must hold H_kv·D for a divisor H_kv of num_heads");
  }
  const Index kv_heads = kv_rows / head_dim;
  reader.get("k_proj.weight", {kv_rows, embed}, "[H_kv·D, E], " + sizes);
  reader.get("v_proj.weight", {kv_rows, embed}, "[H_kv·D, E], " + sizes);
  reader.get("o_proj.weight", {embed, inner}, "[E, H·D], " + sizes);
  // attention_bias (Llama) puts biases on all four projections; Qwen2 on q, k and v only.
  const bool in_bias =
      reader.has("q_proj.bias") || reader.has("k_proj.bias") || reader.has("v_proj.bias");
  const bool out_bias = reader.has("o_proj.bias");
  if (in_bias) {
    reader.get("q_proj.bias", {inner}, "[H·D], " + sizes);
    reader.get("k_proj.bias", {kv_rows}, "[H_kv·D], " + sizes);
    reader.get("v_proj.bias", {kv_rows}, "[H_kv·D], " + sizes);
  }
  if (out_bias) reader.get("o_proj.bias", {embed}, "[E], " + sizes);

  MultiHeadAttentionConfig layer_config(embed, heads);
  layer_config.head_dim = head_dim;
  layer_config.num_kv_heads = kv_heads;
  layer_config.bias = in_bias || out_bias;
  std::map<std::string, Tensor<T>> state;
  const auto q_weight = reader.convert<T>("q_proj.weight"),
             k_weight = reader.convert<T>("k_proj.weight"),
             v_weight = reader.convert<T>("v_proj.weight");
  // Without GQA the layer packs the three projections, as PyTorch's module does.
  if (kv_heads == heads) {
    state.emplace("in_proj_weight", detail::concat_rows<T>({&q_weight, &k_weight, &v_weight}));
  } else {
    state.emplace("q_proj_weight", q_weight);
    state.emplace("k_proj_weight", k_weight);
    state.emplace("v_proj_weight", v_weight);
  }
  state.emplace("out_proj.weight", reader.convert<T>("o_proj.weight"));
  if (in_bias) {
    const auto q_bias = reader.convert<T>("q_proj.bias"), k_bias = reader.convert<T>("k_proj.bias"),
               v_bias = reader.convert<T>("v_proj.bias");
    state.emplace("in_proj_bias", detail::concat_rows<T>({&q_bias, &k_bias, &v_bias}));
  } else if (out_bias) {
    state.emplace("in_proj_bias", Tensor<T>({inner + 2 * kv_rows}, T(0)));
  }
  if (out_bias) {
    state.emplace("out_proj.bias", reader.convert<T>("o_proj.bias"));
  } else if (in_bias) {
    state.emplace("out_proj.bias", Tensor<T>({embed}, T(0)));
  }
  ForwardOptions<T> options;
  options.is_causal = true;
  Rope rope;
  rope.base = config.rope_theta;
  rope.layout = RopeLayout::rotate_half;
  options.rope = rope;
  return detail::finish<T>(layer_config, state, std::move(options), reader);
}

// The same, reading the file at `path` first (all of it: to load several layers, read it once
// with read_safetensors and pass the file).
template <class T>
LoadedAttention<T> load_bert_attention(const std::string& path, Index layer, Index num_heads) {
  return detail::with_path(path, [&](const SafetensorsFile& file) {
    return load_bert_attention<T>(file, layer, num_heads);
  });
}

template <class T>
LoadedAttention<T> load_gpt2_attention(const std::string& path, Index layer, Index num_heads) {
  return detail::with_path(path, [&](const SafetensorsFile& file) {
    return load_gpt2_attention<T>(file, layer, num_heads);
  });
}

template <class T>
LoadedAttention<T> load_llama_attention(const std::string& path, Index layer,
                                        const LlamaAttentionConfig& config) {
  return detail::with_path(path, [&](const SafetensorsFile& file) {
    return load_llama_attention<T>(file, layer, config);
  });
}

}  // namespace mha::io
