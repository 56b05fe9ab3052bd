// The layer's parameters as PyTorch names and lays them out, and their gradients: LayerParameters
// owns the completed config and the tensors, and knows which tensors a config has, in PyTorch's
// state_dict order, with which shapes, where each projection's rows and biases are, how the
// heads sit in the projected rows, and how a state_dict is read back. (mha/parameters.hpp holds
// ParameterRef, the name-value-gradient triple that optimisers take.)
//
//   in_proj_weight [3E, E]   rows 0:E = W_q, E:2E = W_k, 2E:3E = W_v   (kdim == vdim == E)
//   q_proj_weight [H·D, E], k_proj_weight [H_kv·D, kdim], v_proj_weight [H_kv·D, vdim] (otherwise)
//   in_proj_bias [H·D + 2·H_kv·D], out_proj.weight [E, H·D], out_proj.bias [E]   (bias = true)
//   bias_k, bias_v [1, 1, H_kv·D]                                       (add_bias_kv = true)
//   talking_heads_pre, talking_heads_post [H, H]                        (talking heads)
//   sinks [H]                                                           (learnable_sinks)
//
// The projections are numbered which = 0, 1, 2 for q, k and v throughout the layer.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "mha/compiled.hpp"
#include "mha/init.hpp"
#include "mha/kernels/common.hpp"
#include "mha/layer/config.hpp"
#include "mha/parameters.hpp"
#include "mha/tensor.hpp"

namespace mha::detail {

// A layer's tensors under PyTorch's names: its parameters, or their gradients (same shapes).
// Those a config does not have stay empty.
template <class T>
struct ParameterSet {
  Tensor<T> in_proj_weight, q_proj_weight, k_proj_weight, v_proj_weight;
  Tensor<T> in_proj_bias, bias_k, bias_v;
  Tensor<T> out_proj_weight, out_proj_bias;
  Tensor<T> talking_heads_pre, talking_heads_post;
  Tensor<T> sinks;
};

template <class T>
class LayerParameters {
 public:
  using Compute = compute_t<T>;

  // The tensors of `config` (completed and checked first), zero until reset.
  explicit LayerParameters(const MultiHeadAttentionConfig& config);
  // Declared so that it is defined out of the class, compiled once with mha::compiled rather
  // than in every file that destroys a layer; copies and moves stay as the compiler makes them.
  ~LayerParameters();
  LayerParameters(const LayerParameters&) = default;
  LayerParameters(LayerParameters&&) noexcept = default;
  LayerParameters& operator=(const LayerParameters&) = default;
  LayerParameters& operator=(LayerParameters&&) noexcept = default;

  // The config a state_dict implies: which tensors are present decides bias, add_bias_kv,
  // talking heads and kdim/vdim, out_proj.weight's columns D, and k_proj_weight's rows
  // num_kv_heads; num_heads and add_zero_attn are not in a state_dict.
  static MultiHeadAttentionConfig config_of_state_dict(
      const std::map<std::string, Tensor<T>>& state, Index num_heads, bool add_zero_attn);

  // ---- sizes ----
  const MultiHeadAttentionConfig& config() const { return config_; }
  Index embed_dim() const { return config_.embed_dim; }
  Index num_heads() const { return config_.num_heads; }
  Index head_dim() const { return config_.head_dim; }
  Index inner_dim() const { return config_.num_heads * config_.head_dim; }  // H·D
  Index num_kv_heads() const { return config_.num_kv_heads; }
  Index kv_dim() const { return config_.num_kv_heads * config_.head_dim; }  // H_kv·D
  Index kdim() const { return config_.kdim; }
  Index vdim() const { return config_.vdim; }
  // PyTorch's _qkv_same_embed_dim: one packed in_proj_weight instead of three (never with
  // grouped-query attention, whose K and V projections are narrower).
  bool packed_projection() const {
    return config_.kdim == config_.embed_dim && config_.vdim == config_.embed_dim &&
           config_.num_kv_heads == config_.num_heads;
  }

  // ---- the tensors by name ----
  std::vector<std::string> names() const;
  bool has(const std::string& name) const;
  // Throws, naming the parameters this layer has, for a name it does not have.
  const Tensor<T>& find(const std::string& name) const;
  Tensor<T>& find(const std::string& name) {
    return const_cast<Tensor<T>&>(static_cast<const LayerParameters&>(*this).find(name));
  }
  void set(const std::string& name, TensorView<const T> value);
  std::map<std::string, Tensor<T>> state_dict() const;
  // Strict, as PyTorch's default: every parameter present with its shape, nothing unknown.
  // Checks everything before changing anything.
  void load_state_dict(const std::map<std::string, Tensor<T>>& state);

  // PyTorch's _reset_parameters: xavier-uniform over the whole in_proj_weight (or each of the
  // q/k/v weights), zero biases, out_proj.weight as nn.Linear, xavier-normal bias_k/bias_v; and
  // identity talking-heads mixes.
  void reset(std::uint64_t seed);

  // ---- gradients: the parameters' shapes, allocated on first use (PyTorch's grad is None
  // before), so that a layer used only for inference never holds them ----
  bool has_gradients() const { return has_grads_; }
  void ensure_gradients();
  TensorView<const T> gradient(const std::string& name) const;
  void zero_grad();
  // Each parameter with its gradient, in PyTorch's order; views into this object.
  ParameterList<T> parameter_list();

  ParameterSet<T>& values() { return values_; }
  const ParameterSet<T>& values() const { return values_; }
  ParameterSet<T>& grads() { return grads_; }

  // ---- layouts ----
  // Where projection `which` starts in in_proj_bias (and in the rows of a packed in_proj_weight,
  // and in the columns of the fused [B*L, H·D + 2·H_kv·D] projection), and its width.
  Index bias_offset(int which) const {
    return which == 0 ? 0 : inner_dim() + (which - 1) * kv_dim();
  }
  Index projection_width(int which) const { return which == 0 ? inner_dim() : kv_dim(); }

  // W_q, W_k or W_v of `set` (the parameters or the gradients) as a [width, input width] matrix.
  template <class Set>
  auto projection(Set& set, int which) const {
    using Map = Eigen::Map<std::conditional_t<std::is_const_v<Set>, const Matrix<T>, Matrix<T>>>;
    if (packed_projection()) {
      const Index embed = config_.embed_dim;
      return Map(set.in_proj_weight.data() + bias_offset(which) * embed, projection_width(which),
                 embed);
    }
    auto& weight = which == 0   ? set.q_proj_weight
                   : which == 1 ? set.k_proj_weight
                                : set.v_proj_weight;
    return Map(weight.data(), weight.dim(0), weight.dim(1));
  }
  Eigen::Map<const Matrix<T>> weight_rows(int which) const { return projection(values_, which); }

  // Head h of batch b: rows b*rows.., columns h*D.. of a buffer whose rows are `stride` apart.
  template <class Element>
  HeadLayout<Element> head_layout(Element* data, Index rows, Index stride) const {
    return {data, rows * stride, head_dim(), stride, rows, head_dim()};
  }
  // The same for keys and values, whose head h / (H / H_kv) query head h reads.
  template <class Element>
  HeadLayout<Element> kv_head_layout(Element* data, Index rows, Index stride) const {
    HeadLayout<Element> layout = head_layout(data, rows, stride);
    layout.group = config_.num_heads / config_.num_kv_heads;
    return layout;
  }

  // The sink logits [H] the kernels read (CoreOptions::sinks), or null.
  const Compute* sinks() const {
    if constexpr (is_16bit_v<T>) {
      return nullptr;  // refused by the constructor
    } else {
      return config_.learnable_sinks ? values_.sinks.data() : nullptr;
    }
  }

  TalkingHeads<Compute> talking_heads() const {
    if constexpr (is_16bit_v<T>) {
      return {};  // refused by the constructor
    } else {
      return {config_.talking_heads_pre ? values_.talking_heads_pre.data() : nullptr,
              config_.talking_heads_post ? values_.talking_heads_post.data() : nullptr};
    }
  }

 private:
  using NamedTensors = std::vector<std::pair<std::string, const Tensor<T>*>>;
  // The tensors of `set` (the parameters or their gradients) that this config has, by name, in
  // PyTorch's order.
  NamedTensors named(const ParameterSet<T>& set) const;
  std::string joined_names() const;

  MultiHeadAttentionConfig config_;
  ParameterSet<T> values_;
  ParameterSet<T> grads_;
  bool has_grads_ = false;
};

// The member functions, out of the class so that mha::compiled's extern declaration (at the end)
// keeps consumers from compiling them again.

template <class T>
LayerParameters<T>::LayerParameters(const MultiHeadAttentionConfig& config)
    : config_(completed_config(config)) {
  if (is_16bit_v<T> && (config_.talking_heads_pre || config_.talking_heads_post)) {
    throw_argument("talking_heads_pre/talking_heads_post",
                   "are not available in a 16-bit layer: use MultiHeadAttention<float>");
  }
  if (is_16bit_v<T> && config_.learnable_sinks) {
    throw_argument("learnable_sinks",
                   "are not available in a 16-bit layer yet: use MultiHeadAttention<float>");
  }
  const Index embed = config_.embed_dim, inner = inner_dim(), kv_width = kv_dim();
  if (packed_projection()) {
    values_.in_proj_weight = Tensor<T>({inner + 2 * kv_width, embed});
  } else {
    values_.q_proj_weight = Tensor<T>({inner, embed});
    values_.k_proj_weight = Tensor<T>({kv_width, config_.kdim});
    values_.v_proj_weight = Tensor<T>({kv_width, config_.vdim});
  }
  if (config_.bias) {
    values_.in_proj_bias = Tensor<T>({inner + 2 * kv_width});
    values_.out_proj_bias = Tensor<T>({embed});
  }
  values_.out_proj_weight = Tensor<T>({embed, inner});
  if (config_.add_bias_kv) {
    values_.bias_k = Tensor<T>({1, 1, kv_width});
    values_.bias_v = Tensor<T>({1, 1, kv_width});
  }
  const Index heads = config_.num_heads;
  if (config_.talking_heads_pre) values_.talking_heads_pre = Tensor<T>({heads, heads});
  if (config_.talking_heads_post) values_.talking_heads_post = Tensor<T>({heads, heads});
  if (config_.learnable_sinks) values_.sinks = Tensor<T>({heads});
}

template <class T>
MultiHeadAttentionConfig LayerParameters<T>::config_of_state_dict(
    const std::map<std::string, Tensor<T>>& state, Index num_heads, bool add_zero_attn) {
  // Every parameter of a layer has elements. An empty one would let its other dimensions be
  // anything: out_proj.weight [2^20, 0] would make the layer allocate terabytes for a file of a
  // few hundred bytes before load_state_dict could compare shapes.
  for (const auto& entry : state) {
    if (entry.second.size() == 0) {
      throw_shape(entry.first, "a tensor with at least one element", entry.second.shape());
    }
  }
  const auto out_weight = state.find("out_proj.weight");
  if (out_weight == state.end()) throw_argument("state_dict", "missing tensor 'out_proj.weight'");
  if (out_weight->second.rank() != 2) {
    throw_shape("out_proj.weight", "[E, H·D]", out_weight->second.shape());
  }
  MultiHeadAttentionConfig config(out_weight->second.dim(0), num_heads);
  // out_proj.weight's columns are H·D: another D than E / H is a layer whose heads were pruned
  // (a count that is no multiple of num_heads is left for load_state_dict to report).
  const Index inner = out_weight->second.dim(1);
  if (num_heads > 0 && inner != config.embed_dim && inner > 0 && inner % num_heads == 0) {
    config.head_dim = inner / num_heads;
  }
  config.add_zero_attn = add_zero_attn;
  config.bias = state.count("in_proj_bias") > 0 || state.count("out_proj.bias") > 0;
  config.add_bias_kv = state.count("bias_k") > 0 || state.count("bias_v") > 0;
  config.talking_heads_pre = state.count("talking_heads_pre") > 0;
  config.talking_heads_post = state.count("talking_heads_post") > 0;
  config.learnable_sinks = state.count("sinks") > 0;
  if (state.count("in_proj_weight") > 0) return config;
  const auto width = [&](const char* name) -> Index {
    const auto it = state.find(name);
    if (it == state.end()) return 0;
    if (it->second.rank() != 2) throw_shape(name, "[E, width]", it->second.shape());
    return it->second.dim(1);
  };
  config.kdim = width("k_proj_weight");
  config.vdim = width("v_proj_weight");
  if (config.kdim == 0 || config.vdim == 0) {
    throw_argument("state_dict",
                   "needs 'in_proj_weight' or all of 'q_proj_weight', 'k_proj_weight', "
                   "'v_proj_weight'");
  }
  // k_proj_weight has H_kv·D rows; a count that is no multiple of D is left for the shape checks
  // of load_state_dict to report.
  const Index kv_rows = state.at("k_proj_weight").dim(0), embed = config.embed_dim;
  const Index head_dim = config.head_dim > 0                       ? config.head_dim
                         : num_heads > 0 && embed % num_heads == 0 ? embed / num_heads
                                                                   : 0;
  if (head_dim > 0 && kv_rows % head_dim == 0 && kv_rows > 0) {
    config.num_kv_heads = kv_rows / head_dim;
  }
  return config;
}

template <class T>
std::vector<std::string> LayerParameters<T>::names() const {
  std::vector<std::string> names;
  for (const auto& entry : named(values_)) names.push_back(entry.first);
  return names;
}

template <class T>
bool LayerParameters<T>::has(const std::string& name) const {
  const NamedTensors parameters = named(values_);
  return std::any_of(parameters.begin(), parameters.end(),
                     [&](const auto& entry) { return entry.first == name; });
}

template <class T>
const Tensor<T>& LayerParameters<T>::find(const std::string& name) const {
  for (const auto& entry : named(values_)) {
    if (entry.first == name) return *entry.second;
  }
  throw_argument("parameter",
                 "no parameter named '" + name + "' in this layer (it has " + joined_names() + ")");
}

template <class T>
void LayerParameters<T>::set(const std::string& name, TensorView<const T> value) {
  Tensor<T>& target = find(name);
  check_shape(name, target.shape(), value.shape());
  if (value.size() > 0) std::copy(value.data(), value.data() + value.size(), target.data());
}

template <class T>
std::map<std::string, Tensor<T>> LayerParameters<T>::state_dict() const {
  std::map<std::string, Tensor<T>> state;
  for (const auto& entry : named(values_)) state.emplace(entry.first, *entry.second);
  return state;
}

template <class T>
void LayerParameters<T>::load_state_dict(const std::map<std::string, Tensor<T>>& state) {
  for (const auto& entry : state) {
    if (!has(entry.first)) {
      throw_argument("state_dict", "unexpected tensor '" + entry.first +
                                       "' for this layer (expected " + joined_names() + ")");
    }
  }
  for (const auto& entry : named(values_)) {
    const auto it = state.find(entry.first);
    if (it == state.end()) throw_argument("state_dict", "missing tensor '" + entry.first + "'");
    check_shape(entry.first, entry.second->shape(), it->second.shape());
  }
  for (const auto& entry : state) set(entry.first, entry.second.view());
}

template <class T>
void LayerParameters<T>::reset(std::uint64_t seed) {
  Random random(seed);
  const Index embed = config_.embed_dim;
  if (packed_projection()) {
    xavier_uniform(values_.in_proj_weight, embed, values_.in_proj_weight.dim(0), random);
  } else {
    xavier_uniform(values_.q_proj_weight, embed, inner_dim(), random);
    xavier_uniform(values_.k_proj_weight, config_.kdim, kv_dim(), random);
    xavier_uniform(values_.v_proj_weight, config_.vdim, kv_dim(), random);
  }
  linear_default_uniform(values_.out_proj_weight, inner_dim(), random);
  if (config_.bias) {
    values_.in_proj_bias.flat().setZero();
    values_.out_proj_bias.flat().setZero();
  }
  if (config_.add_bias_kv) {
    // A [1, 1, n] tensor has fan_in = fan_out = n for torch's fan computation.
    xavier_normal(values_.bias_k, kv_dim(), kv_dim(), random);
    xavier_normal(values_.bias_v, kv_dim(), kv_dim(), random);
  }
  for (Tensor<T>* mix : {&values_.talking_heads_pre, &values_.talking_heads_post}) {
    if (mix->size() > 0) mix->matrix().setIdentity();
  }
  if (config_.learnable_sinks) values_.sinks.flat().setZero();
}

template <class T>
void LayerParameters<T>::ensure_gradients() {
  if (has_grads_) return;
  const NamedTensors values = named(values_), grads = named(grads_);
  for (std::size_t i = 0; i < values.size(); ++i) {
    *const_cast<Tensor<T>*>(grads[i].second) = Tensor<T>(values[i].second->shape());
  }
  has_grads_ = true;
}

template <class T>
TensorView<const T> LayerParameters<T>::gradient(const std::string& name) const {
  if (!has_grads_) {
    throw_argument("gradient", "'" + name +
                                   "' has no gradient yet (call forward_train and backward, "
                                   "zero_grad or parameters() first)");
  }
  for (const auto& entry : named(grads_)) {
    if (entry.first == name) return entry.second->view();
  }
  find(name);  // not a parameter of this layer: throws, naming those it has
  return {};
}

template <class T>
void LayerParameters<T>::zero_grad() {
  ensure_gradients();
  for (const auto& entry : named(grads_)) const_cast<Tensor<T>*>(entry.second)->flat().setZero();
}

template <class T>
ParameterList<T> LayerParameters<T>::parameter_list() {
  ensure_gradients();
  ParameterList<T> list;
  const NamedTensors values = named(values_), grads = named(grads_);
  for (std::size_t i = 0; i < values.size(); ++i) {
    list.push_back({values[i].first, const_cast<Tensor<T>*>(values[i].second)->view(),
                    const_cast<Tensor<T>*>(grads[i].second)->view()});
  }
  return list;
}

template <class T>
typename LayerParameters<T>::NamedTensors LayerParameters<T>::named(
    const ParameterSet<T>& set) const {
  NamedTensors named;
  if (packed_projection()) {
    named.emplace_back("in_proj_weight", &set.in_proj_weight);
  } else {
    named.emplace_back("q_proj_weight", &set.q_proj_weight);
    named.emplace_back("k_proj_weight", &set.k_proj_weight);
    named.emplace_back("v_proj_weight", &set.v_proj_weight);
  }
  if (config_.bias) named.emplace_back("in_proj_bias", &set.in_proj_bias);
  if (config_.add_bias_kv) {
    named.emplace_back("bias_k", &set.bias_k);
    named.emplace_back("bias_v", &set.bias_v);
  }
  named.emplace_back("out_proj.weight", &set.out_proj_weight);
  if (config_.bias) named.emplace_back("out_proj.bias", &set.out_proj_bias);
  if (config_.talking_heads_pre) named.emplace_back("talking_heads_pre", &set.talking_heads_pre);
  if (config_.talking_heads_post) named.emplace_back("talking_heads_post", &set.talking_heads_post);
  if (config_.learnable_sinks) named.emplace_back("sinks", &set.sinks);
  return named;
}

template <class T>
std::string LayerParameters<T>::joined_names() const {
  std::string joined;
  for (const auto& name : names()) joined += (joined.empty() ? "" : ", ") + name;
  return joined;
}

template <class T>
LayerParameters<T>::~LayerParameters() = default;

// The instantiations mha::compiled holds (src/layer_parameters.cpp; see mha/compiled.hpp).
// NOLINTBEGIN(bugprone-macro-parentheses): the arguments are a type and a keyword
#define MHA_LAYER_PARAMETERS_TEMPLATES(PREFIX, T) PREFIX template class LayerParameters<T>;
// NOLINTEND(bugprone-macro-parentheses)
MHA_EXTERN_TEMPLATES(MHA_LAYER_TYPES, MHA_LAYER_PARAMETERS_TEMPLATES)

}  // namespace mha::detail
