// MultiHeadAttention<T>: torch.nn.MultiheadAttention (batch_first=True) for T = float, double.
//
// Parameters are stored under their PyTorch state_dict names and shapes, so a layer exported
// from PyTorch loads without renaming or transposing:
//   in_proj_weight [3E, E]   rows 0:E = W_q, E:2E = W_k, 2E:3E = W_v   (kdim == vdim == E)
//   q_proj_weight [E, E], k_proj_weight [E, kdim], v_proj_weight [E, vdim] (otherwise)
//   in_proj_bias [3E], out_proj.weight [E, E], out_proj.bias [E]       (bias = true)
//   bias_k, bias_v [1, 1, E]                                            (add_bias_kv = true)
// Every projection is y = x Wᵀ + b. The forward pass:
//   q, k, v = projections of query [B, L, E], key [B, S, kdim], value [B, S, vdim]
//   k, v   += bias_k, bias_v as one more key/value row        (add_bias_kv)
//   k, v   += one zero row                                     (add_zero_attn)
//   per head h (feature columns h*D .. (h+1)*D): softmax(q_h k_hᵀ / sqrt(D) + masks) v_h
//   output = concat(heads) W_oᵀ + b_o
//
// Masks follow PyTorch MHA, with polarity named (see mask.hpp): wrap a boolean PyTorch MHA mask
// with Mask<T>::blocked_where_true, an SDPA one with allowed_where_true, a float one with
// additive. Where every key of a query row is blocked in a head, that head's output row and
// weights are 0. PyTorch MHA returns NaN there (pytorch#41508); SDPA, FlashAttention and ggml
// return 0, and so does this library.
//
// A layer may be shared by threads for concurrent forward calls: forward is const and keeps no
// state between calls. Changing parameters while another thread runs forward is a data race.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "mha/attention.hpp"
#include "mha/init.hpp"
#include "mha/mask.hpp"
#include "mha/tensor.hpp"

namespace mha {

// The constructor arguments of torch.nn.MultiheadAttention (dropout aside); kdim and vdim of 0
// mean embed_dim. seed drives the default initialisation.
struct MultiHeadAttentionConfig {
  Index embed_dim = 0;
  Index num_heads = 0;
  bool bias = true;
  bool add_bias_kv = false;
  bool add_zero_attn = false;
  Index kdim = 0;
  Index vdim = 0;
  std::uint64_t seed = 0;

  MultiHeadAttentionConfig() = default;
  MultiHeadAttentionConfig(Index embed_dim_, Index num_heads_)
      : embed_dim(embed_dim_), num_heads(num_heads_) {}
};

template <class T>
struct ForwardOptions {
  // [B, S] ([S] unbatched). PyTorch MHA passes booleans with true = ignore this key:
  // Mask<T>::blocked_where_true. A float one is added to the scores (PyTorch 2.x).
  Mask<T> key_padding_mask;
  // [L, S] for every batch and head, or [B*H, L, S] indexed by b*H + h ([H, L, S] unbatched).
  Mask<T> attn_mask;
  bool need_weights = true;
  // Weights averaged over heads [B, L, S'] when true, per head [B, H, L, S'] when false.
  bool average_attn_weights = true;
  // Applies the top-left causal mask (query i sees input keys j <= i) itself, on top of
  // attn_mask. Unlike PyTorch 2.x, where is_causal is only a hint about attn_mask.
  bool is_causal = false;
  // Which kernel computes the heads; automatic picks flash unless weights are requested.
  Kernel kernel = Kernel::automatic;
};

template <class T>
struct ForwardResult {
  Tensor<T> output;        // [B, L, E] ([L, E] unbatched)
  Tensor<T> attn_weights;  // see ForwardOptions::average_attn_weights; empty unless need_weights
};

// Buffers a forward call needs besides its result. Pass the same Workspace (and result) to
// repeated forward calls with the same shapes and they allocate no tensor memory. A Workspace
// belongs to one calling thread at a time; the layer itself may be shared.
template <class T>
struct Workspace {
  Matrix<T> qkv, q, k, v;  // projections: fused [B*L, 3E], or q [B*L, E], k and v [B*S', E]
  Matrix<T> attended;      // the heads' outputs side by side, [B*L, E]
  Tensor<T> per_head_weights;
  std::vector<detail::KernelScratch<T>> kernel;  // one per thread
};

template <class T>
class MultiHeadAttention {
 public:
  using Scalar = T;

  MultiHeadAttention(Index embed_dim, Index num_heads)
      : MultiHeadAttention(MultiHeadAttentionConfig(embed_dim, num_heads)) {}

  explicit MultiHeadAttention(const MultiHeadAttentionConfig& config) : config_(config) {
    const Index embed = config_.embed_dim;
    if (embed <= 0) {
      detail::throw_argument("embed_dim", "must be positive, got " + std::to_string(embed));
    }
    if (config_.num_heads <= 0) {
      detail::throw_argument("num_heads",
                             "must be positive, got " + std::to_string(config_.num_heads));
    }
    if (embed % config_.num_heads != 0) {
      detail::throw_argument("num_heads", "embed_dim " + std::to_string(embed) +
                                              " is not divisible by num_heads " +
                                              std::to_string(config_.num_heads));
    }
    if (config_.kdim < 0 || config_.vdim < 0) {
      detail::throw_argument("kdim/vdim", "must be positive (or 0 for embed_dim), got " +
                                              std::to_string(config_.kdim) + "/" +
                                              std::to_string(config_.vdim));
    }
    if (config_.kdim == 0) config_.kdim = embed;
    if (config_.vdim == 0) config_.vdim = embed;
    if (packed_projection()) {
      in_proj_weight_ = Tensor<T>({3 * embed, embed});
    } else {
      q_proj_weight_ = Tensor<T>({embed, embed});
      k_proj_weight_ = Tensor<T>({embed, config_.kdim});
      v_proj_weight_ = Tensor<T>({embed, config_.vdim});
    }
    if (config_.bias) {
      in_proj_bias_ = Tensor<T>({3 * embed});
      out_proj_bias_ = Tensor<T>({embed});
    }
    out_proj_weight_ = Tensor<T>({embed, embed});
    if (config_.add_bias_kv) {
      bias_k_ = Tensor<T>({1, 1, embed});
      bias_v_ = Tensor<T>({1, 1, embed});
    }
    reset_parameters(config_.seed);
  }

  // Builds a layer from PyTorch state_dict tensors. Which tensors are present decides bias,
  // add_bias_kv and kdim/vdim; num_heads and add_zero_attn are not in a state_dict.
  static MultiHeadAttention from_state_dict(const std::map<std::string, Tensor<T>>& state,
                                            Index num_heads, bool add_zero_attn = false) {
    const auto out_weight = state.find("out_proj.weight");
    if (out_weight == state.end()) {
      detail::throw_argument("state_dict", "missing tensor 'out_proj.weight'");
    }
    if (out_weight->second.rank() != 2) {
      detail::throw_shape("out_proj.weight", "[E, E]", out_weight->second.shape());
    }
    MultiHeadAttentionConfig config(out_weight->second.dim(0), num_heads);
    config.add_zero_attn = add_zero_attn;
    config.bias = state.count("in_proj_bias") > 0 || state.count("out_proj.bias") > 0;
    config.add_bias_kv = state.count("bias_k") > 0 || state.count("bias_v") > 0;
    const auto width = [&](const char* name) -> Index {
      const auto it = state.find(name);
      if (it == state.end()) return 0;
      if (it->second.rank() != 2) {
        detail::throw_shape(name, "[E, width]", it->second.shape());
      }
      return it->second.dim(1);
    };
    if (state.count("in_proj_weight") == 0) {
      config.kdim = width("k_proj_weight");
      config.vdim = width("v_proj_weight");
      if (config.kdim == 0 || config.vdim == 0) {
        detail::throw_argument("state_dict",
                               "needs 'in_proj_weight' or all of 'q_proj_weight', "
                               "'k_proj_weight', 'v_proj_weight'");
      }
    }
    MultiHeadAttention layer(config);
    layer.load_state_dict(state);
    return layer;
  }

  // PyTorch's _reset_parameters: xavier-uniform over the whole in_proj_weight (or each of the
  // q/k/v weights), zero biases, out_proj.weight as nn.Linear, xavier-normal bias_k/bias_v.
  void reset_parameters(std::uint64_t seed) {
    Random random(seed);
    const Index embed = config_.embed_dim;
    if (packed_projection()) {
      xavier_uniform(in_proj_weight_, embed, 3 * embed, random);
    } else {
      xavier_uniform(q_proj_weight_, embed, embed, random);
      xavier_uniform(k_proj_weight_, config_.kdim, embed, random);
      xavier_uniform(v_proj_weight_, config_.vdim, embed, random);
    }
    linear_default_uniform(out_proj_weight_, embed, random);
    if (config_.bias) {
      in_proj_bias_.flat().setZero();
      out_proj_bias_.flat().setZero();
    }
    if (config_.add_bias_kv) {
      // A [1, 1, E] tensor has fan_in = fan_out = E for torch's fan computation.
      xavier_normal(bias_k_, embed, embed, random);
      xavier_normal(bias_v_, embed, embed, random);
    }
  }

  const MultiHeadAttentionConfig& config() const { return config_; }
  Index embed_dim() const { return config_.embed_dim; }
  Index num_heads() const { return config_.num_heads; }
  Index head_dim() const { return config_.embed_dim / config_.num_heads; }
  Index kdim() const { return config_.kdim; }
  Index vdim() const { return config_.vdim; }
  // PyTorch's _qkv_same_embed_dim: one packed in_proj_weight instead of three.
  bool packed_projection() const {
    return config_.kdim == config_.embed_dim && config_.vdim == config_.embed_dim;
  }

  // The state_dict names of this layer's parameters, in PyTorch's order.
  std::vector<std::string> parameter_names() const {
    std::vector<std::string> names;
    for (const auto& entry : named_parameters()) names.push_back(entry.first);
    return names;
  }
  bool has_parameter(const std::string& name) const {
    for (const auto& entry : named_parameters()) {
      if (entry.first == name) return true;
    }
    return false;
  }
  // A view of one parameter with its PyTorch shape; writing through it changes the layer.
  TensorView<T> parameter(const std::string& name) { return find_parameter(name).view(); }
  TensorView<const T> parameter(const std::string& name) const {
    return const_cast<MultiHeadAttention*>(this)->find_parameter(name).view();
  }
  void set_parameter(const std::string& name, TensorView<const T> value) {
    Tensor<T>& target = find_parameter(name);
    detail::check_shape(name, target.shape(), value.shape());
    if (value.size() > 0) std::copy(value.data(), value.data() + value.size(), target.data());
  }

  std::map<std::string, Tensor<T>> state_dict() const {
    std::map<std::string, Tensor<T>> state;
    for (const auto& entry : named_parameters()) state.emplace(entry.first, *entry.second);
    return state;
  }
  // Strict, as PyTorch's default: every parameter present with its shape, nothing unknown.
  // Checks everything before changing anything.
  void load_state_dict(const std::map<std::string, Tensor<T>>& state) {
    for (const auto& entry : state) {
      if (!has_parameter(entry.first)) {
        detail::throw_argument("state_dict", "unexpected tensor '" + entry.first +
                                                 "' for this layer (expected " +
                                                 joined_parameter_names() + ")");
      }
    }
    for (const auto& entry : named_parameters()) {
      const auto it = state.find(entry.first);
      if (it == state.end()) {
        detail::throw_argument("state_dict", "missing tensor '" + entry.first + "'");
      }
      detail::check_shape(entry.first, entry.second->shape(), it->second.shape());
    }
    for (const auto& entry : state) set_parameter(entry.first, entry.second.view());
  }

  // query [B, L, E], key [B, S, kdim], value [B, S, vdim]; or unbatched [L, E], [S, kdim],
  // [S, vdim]. See ForwardOptions for the masks and what is returned.
  ForwardResult<T> forward(TensorView<const T> query, TensorView<const T> key,
                           TensorView<const T> value, const ForwardOptions<T>& options = {}) const {
    Workspace<T> workspace;
    ForwardResult<T> result;
    forward(query, key, value, options, workspace, result);
    return result;
  }

  // The same, writing into `result` and using `workspace` for its buffers: with the same shapes
  // as the previous call, neither allocates.
  void forward(TensorView<const T> query, TensorView<const T> key, TensorView<const T> value,
               const ForwardOptions<T>& options, Workspace<T>& workspace,
               ForwardResult<T>& result) const {
    const Index embed = config_.embed_dim, heads = config_.num_heads;
    const bool batched = query.rank() == 3;
    if (!batched && query.rank() != 2) {
      detail::throw_shape(
          "query", "[B, L, " + std::to_string(embed) + "] or [L, " + std::to_string(embed) + "]",
          query.shape());
    }
    const Index batch = batched ? query.dim(0) : 1;
    const Index query_len = query.dim(query.rank() - 2);
    const Index key_len = key.rank() == query.rank() ? key.dim(key.rank() - 2) : 0;
    const Shape query_shape = batched ? Shape{batch, query_len, embed} : Shape{query_len, embed};
    detail::check_shape("query", query_shape, query.shape());
    const auto input_shape = [&](Index width) {
      return batched ? Shape{batch, detail::kAnyDim, width} : Shape{detail::kAnyDim, width};
    };
    detail::check_shape("key", input_shape(config_.kdim), key.shape());
    const Shape value_shape =
        batched ? Shape{batch, key_len, config_.vdim} : Shape{key_len, config_.vdim};
    detail::check_shape("value", value_shape, value.shape());

    // S' keys: the inputs', then bias_k, then the zero key.
    const Index total_keys =
        key_len + (config_.add_bias_kv ? 1 : 0) + (config_.add_zero_attn ? 1 : 0);
    const Index head_dim = embed / heads;

    // Refused combinations fail before any projection is computed.
    const Kernel kernel = detail::resolve_kernel(options.kernel, options.need_weights);
    detail::CoreOptions<T> core;
    core.scale = T(1) / std::sqrt(static_cast<T>(head_dim));
    core.attn_mask = attn_mask_layout(options.attn_mask, batched, batch, query_len, key_len);
    core.key_padding_mask = key_padding_layout(options.key_padding_mask, batched, batch, key_len);
    core.causal = options.is_causal ? Causal::top_left : Causal::none;
    core.causal_cols = key_len;

    // Self-attention without extra key rows projects q, k and v in one [B*L, E] x [E, 3E] GEMM
    // into [B*L, 3E]; heads then read q, k and v at column offsets 0, E and 2E.
    const bool fused = packed_projection() && !config_.add_bias_kv && !config_.add_zero_attn &&
                       query.data() == key.data() && key.data() == value.data() &&
                       query.shape() == key.shape() && key.shape() == value.shape();
    const T* q_data;
    const T* k_data;
    const T* v_data;
    Index q_stride = embed, kv_stride = embed;
    if (fused) {
      Matrix<T>& qkv = workspace.qkv;
      qkv.resize(batch * query_len, 3 * embed);
      qkv.noalias() = query.matrix() * in_proj_weight_.matrix().transpose();
      if (config_.bias) qkv.rowwise() += in_proj_bias_.flat().transpose();
      q_data = qkv.data();
      k_data = q_data + embed;
      v_data = q_data + 2 * embed;
      q_stride = kv_stride = 3 * embed;
    } else {
      // q [B*L, E]; k, v [B*S', E] with the extra rows after each batch's S projected rows.
      workspace.q.resize(batch * query_len, embed);
      workspace.q.noalias() = query.matrix() * weight_rows(0).transpose();
      add_bias(workspace.q, 0);
      project_keys(key, 1, batch, key_len, total_keys, bias_k_, workspace.k);
      project_keys(value, 2, batch, key_len, total_keys, bias_v_, workspace.v);
      q_data = workspace.q.data();
      k_data = workspace.k.data();
      v_data = workspace.v.data();
    }

    // Per-head weights go straight into the result unless they are to be averaged.
    Tensor<T>& per_head_weights = options.need_weights && !options.average_attn_weights
                                      ? result.attn_weights
                                      : workspace.per_head_weights;
    if (options.need_weights) per_head_weights.resize({batch, heads, query_len, total_keys});
    workspace.attended.resize(batch * query_len, embed);
    // Head h of batch b: rows b*rows.., columns h*D.. of a buffer whose rows are `stride` apart.
    const auto heads_of = [&](auto* data, Index rows, Index stride) {
      using Element = std::remove_pointer_t<decltype(data)>;
      return detail::HeadLayout<Element>{data, rows * stride, head_dim, stride, rows, head_dim};
    };
    detail::attention<T>(
        kernel, batch, heads, heads_of(q_data, query_len, q_stride),
        heads_of(k_data, total_keys, kv_stride), heads_of(v_data, total_keys, kv_stride),
        heads_of(workspace.attended.data(), query_len, embed), core,
        options.need_weights ? per_head_weights.data() : nullptr, workspace.kernel);

    result.output.resize(query_shape);
    auto output = result.output.matrix();
    output.noalias() = workspace.attended * out_proj_weight_.matrix().transpose();
    if (config_.bias) output.rowwise() += out_proj_bias_.flat().transpose();

    if (!options.need_weights) {
      result.attn_weights = Tensor<T>();
      return;
    }
    if (options.average_attn_weights) {
      average_over_heads(per_head_weights, result.attn_weights);
    }
    if (!batched) {
      // Drop the batch axis of size 1: [1, ...] -> [...].
      Shape unbatched(result.attn_weights.shape().begin() + 1, result.attn_weights.shape().end());
      result.attn_weights.reshape(std::move(unbatched));
    }
  }

  // Self-attention: query, key and value are all x.
  ForwardResult<T> forward(TensorView<const T> x, const ForwardOptions<T>& options = {}) const {
    return forward(x, x, x, options);
  }

 private:
  std::vector<std::pair<std::string, const Tensor<T>*>> named_parameters() const {
    std::vector<std::pair<std::string, const Tensor<T>*>> named;
    if (packed_projection()) {
      named.emplace_back("in_proj_weight", &in_proj_weight_);
    } else {
      named.emplace_back("q_proj_weight", &q_proj_weight_);
      named.emplace_back("k_proj_weight", &k_proj_weight_);
      named.emplace_back("v_proj_weight", &v_proj_weight_);
    }
    if (config_.bias) named.emplace_back("in_proj_bias", &in_proj_bias_);
    if (config_.add_bias_kv) {
      named.emplace_back("bias_k", &bias_k_);
      named.emplace_back("bias_v", &bias_v_);
    }
    named.emplace_back("out_proj.weight", &out_proj_weight_);
    if (config_.bias) named.emplace_back("out_proj.bias", &out_proj_bias_);
    return named;
  }

  std::string joined_parameter_names() const {
    std::string joined;
    for (const auto& name : parameter_names()) joined += (joined.empty() ? "" : ", ") + name;
    return joined;
  }

  Tensor<T>& find_parameter(const std::string& name) {
    for (const auto& entry : named_parameters()) {
      if (entry.first == name) return *const_cast<Tensor<T>*>(entry.second);
    }
    detail::throw_argument("parameter", "no parameter named '" + name + "' in this layer (it has " +
                                            joined_parameter_names() + ")");
  }

  // W_q, W_k or W_v (which = 0, 1, 2) as an [E, width] matrix.
  Eigen::Map<const Matrix<T>> weight_rows(int which) const {
    const Index embed = config_.embed_dim;
    if (packed_projection()) {
      return Eigen::Map<const Matrix<T>>(in_proj_weight_.data() + which * embed * embed, embed,
                                         embed);
    }
    const Tensor<T>& weight = which == 0   ? q_proj_weight_
                              : which == 1 ? k_proj_weight_
                                           : v_proj_weight_;
    return Eigen::Map<const Matrix<T>>(weight.data(), weight.dim(0), weight.dim(1));
  }

  template <class Rows>
  void add_bias(Rows& rows, int which) const {
    if (!config_.bias) return;
    const Index embed = config_.embed_dim;
    rows.rowwise() += Eigen::Map<const RowVector<T>>(in_proj_bias_.data() + which * embed, embed);
  }

  // input [B, S, width] (or [S, width]) projected into [B*S', E]: for each batch its S rows, then
  // bias_k/bias_v (add_bias_kv), then a zero row (add_zero_attn).
  void project_keys(TensorView<const T> input, int which, Index batch, Index key_len,
                    Index total_keys, const Tensor<T>& extra_row, Matrix<T>& projected) const {
    const Index embed = config_.embed_dim;
    const Index width = input.dim(input.rank() - 1);
    projected.resize(batch * total_keys, embed);
    const auto weight = weight_rows(which);
    if (total_keys == key_len) {  // no extra rows: one GEMM over every batch
      projected.noalias() = input.matrix() * weight.transpose();
      add_bias(projected, which);
      return;
    }
    for (Index b = 0; b < batch; ++b) {
      auto rows = projected.middleRows(b * total_keys, key_len);
      rows.noalias() =
          Eigen::Map<const Matrix<T>>(input.data() + b * key_len * width, key_len, width) *
          weight.transpose();
      add_bias(rows, which);
      Index next = b * total_keys + key_len;
      if (config_.add_bias_kv) projected.row(next++) = extra_row.flat().transpose();
      if (config_.add_zero_attn) projected.row(next).setZero();
    }
  }

  // attn_mask [L, S] shared, or [B*H, L, S] ([H, L, S] unbatched) indexed by b*H + h.
  detail::MaskLayout<T> attn_mask_layout(const Mask<T>& mask, bool batched, Index batch,
                                         Index query_len, Index key_len) const {
    if (mask.empty()) return {};
    const Index heads = config_.num_heads;
    const Index stacked = batched ? batch * heads : heads;
    const Shape& shape = mask.shape();
    if (shape == Shape{query_len, key_len}) {
      return detail::make_mask_layout(mask, 0, 0, key_len, key_len);
    }
    if (shape == Shape{stacked, query_len, key_len}) {
      return detail::make_mask_layout(mask, heads * query_len * key_len, query_len * key_len,
                                      key_len, key_len);
    }
    detail::throw_shape("attn_mask",
                        detail::format_shape({query_len, key_len}) + " or " +
                            detail::format_shape({stacked, query_len, key_len}) +
                            (batched ? " ([L, S] or [B*H, L, S])" : " ([L, S] or [H, L, S])"),
                        shape);
  }

  // key_padding_mask [B, S] ([S] unbatched), the same for every head and query.
  detail::MaskLayout<T> key_padding_layout(const Mask<T>& mask, bool batched, Index batch,
                                           Index key_len) const {
    if (mask.empty()) return {};
    const Shape expected = batched ? Shape{batch, key_len} : Shape{key_len};
    detail::check_shape("key_padding_mask", expected, mask.shape());
    return detail::make_mask_layout(mask, key_len, 0, 0, key_len);
  }

  // [B, H, L, S'] -> [B, L, S'], the mean over heads.
  void average_over_heads(const Tensor<T>& per_head, Tensor<T>& averaged) const {
    const Index batch = per_head.dim(0), heads = per_head.dim(1);
    const Index rows = per_head.dim(2), cols = per_head.dim(3);
    averaged.resize({batch, rows, cols});
    for (Index b = 0; b < batch; ++b) {
      auto sum = averaged[b].matrix();
      sum.setZero();
      for (Index h = 0; h < heads; ++h) sum += per_head[b][h].matrix();
      sum /= static_cast<T>(heads);
    }
  }

  MultiHeadAttentionConfig config_;
  Tensor<T> in_proj_weight_, q_proj_weight_, k_proj_weight_, v_proj_weight_;
  Tensor<T> in_proj_bias_, bias_k_, bias_v_;
  Tensor<T> out_proj_weight_, out_proj_bias_;
};

}  // namespace mha
