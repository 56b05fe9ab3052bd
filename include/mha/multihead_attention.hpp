// MultiHeadAttention<T>: torch.nn.MultiheadAttention (batch_first=True) for T = float, double,
// Eigen::half and Eigen::bfloat16.
//
// The 16-bit layers store their parameters, take and return tensors, and keep their KV cache in
// 16 bits, and compute in float: projections widen the weights as they multiply them (see
// product_transposed in kernels/gemm.hpp), the kernels see float queries, keys and values (a
// 16-bit cache is converted block by block as the flash kernel reads it), and the scores,
// softmax and sums are float, as the tutorial's §4.3 advises. Each result is rounded to 16 bits
// once. They serve inference (forward and decode); training runs in float or double (forward_train
// does not compile for them), and talking heads are refused.
//
// Parameters are stored under their PyTorch state_dict names and shapes, so a layer exported
// from PyTorch loads without renaming or transposing:
//   in_proj_weight [3E, E]   rows 0:E = W_q, E:2E = W_k, 2E:3E = W_v   (kdim == vdim == E)
//   q_proj_weight [E, E], k_proj_weight [E, kdim], v_proj_weight [E, vdim] (otherwise)
//   in_proj_bias [3E], out_proj.weight [E, E], out_proj.bias [E]       (bias = true)
//   bias_k, bias_v [1, 1, E]                                            (add_bias_kv = true)
//   talking_heads_pre, talking_heads_post [H, H]      (talking_heads_pre / _post = true; no
//                                                      PyTorch module has them)
// Every projection is y = x Wᵀ + b. The forward pass:
//   q, k, v = projections of query [B, L, E], key [B, S, kdim], value [B, S, vdim]
//   k, v   += bias_k, bias_v as one more key/value row        (add_bias_kv)
//   k, v   += one zero row                                     (add_zero_attn)
//   per head h (feature columns h*D .. (h+1)*D): softmax(q_h k_hᵀ / sqrt(D) + masks) v_h
//     (with talking heads, the logits are mixed across heads before the softmax and the weights
//     after it: see kernels/talking_heads.hpp)
//   output = concat(heads) W_oᵀ + b_o
//
// Masks follow PyTorch MHA, with polarity named (see mask.hpp): wrap a boolean PyTorch MHA mask
// with Mask<T>::blocked_where_true, an SDPA one with allowed_where_true, a float one with
// additive. Where every key of a query row is blocked in a head, that head's output row and
// weights are 0. PyTorch MHA returns NaN there (pytorch#41508); SDPA, FlashAttention and ggml
// return 0, and so does this library.
//
// Training (see "Training" in the class): forward_train keeps what backward needs in a
// SavedForward the caller owns, and applies dropout; backward returns the inputs' gradients and
// adds the parameters' into the layer's own gradient tensors, reachable by PyTorch name
// (gradient(name), parameters()) until zero_grad.
//
// Threads. What may be shared by threads calling at the same time:
//   - a MultiHeadAttention, for its const members: forward, decode (each with its own cache),
//     state_dict, parameter(name) const. They keep no state between calls (tests/test_threads.cpp
//     runs them concurrently under ThreadSanitizer).
//   - ForwardOptions, and the input tensors, which these calls only read.
// What belongs to one thread at a time:
//   - a Workspace, a ForwardResult written into, a KVCache, a SavedForward;
//   - the layer itself during forward_train, backward, zero_grad, set_parameter,
//     load_state_dict, prune_heads and an optimiser's step, which change it: no other call on
//     the layer may run meanwhile.
//
// Failures. Every check runs before anything changes: a forward, decode, forward_train or
// load_state_dict that throws leaves the layer, its Workspace and a KVCache as they were (a
// SavedForward is left empty). NaN and Inf inputs: see ForwardOptions::check_inputs.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "mha/attention.hpp"
#include "mha/finite.hpp"
#include "mha/init.hpp"
#include "mha/kernels/gemm.hpp"
#include "mha/kv_cache.hpp"
#include "mha/mask.hpp"
#include "mha/parameters.hpp"
#include "mha/rotary.hpp"
#include "mha/tensor.hpp"

namespace mha {

namespace detail {

// A layer's tensors under PyTorch's names: its parameters, or their gradients (same shapes).
template <class T>
struct ParameterSet {
  Tensor<T> in_proj_weight, q_proj_weight, k_proj_weight, v_proj_weight;
  Tensor<T> in_proj_bias, bias_k, bias_v;
  Tensor<T> out_proj_weight, out_proj_bias;
  Tensor<T> talking_heads_pre, talking_heads_post;
};

// The checked shapes of one forward call, and what they decide.
struct ForwardPlan {
  bool batched = true;
  bool fused = false;  // self-attention through one [E, 3E] projection
  Index batch = 1, query_len = 0, key_len = 0, total_keys = 0;
  Kernel kernel = Kernel::automatic;
  Shape query_shape;  // also the output's
};

}  // namespace detail

// The constructor arguments of torch.nn.MultiheadAttention; kdim and vdim of 0 mean embed_dim.
// dropout is the probability of dropping an attention weight in forward_train (never in
// forward, PyTorch's eval mode). seed drives the default initialisation and the dropout draws.
// num_kv_heads (H_kv, 0 = num_heads) makes it grouped-query attention (multi-query for 1), as in
// Llama: key and value are projected to H_kv·D features, and query head h reads key/value head
// h / (H / H_kv); the parameters are then q_proj_weight [E, E], k_proj_weight [H_kv·D, kdim],
// v_proj_weight [H_kv·D, vdim], in_proj_bias [E + 2·H_kv·D], bias_k/bias_v [1, 1, H_kv·D].
struct MultiHeadAttentionConfig {
  Index embed_dim = 0;
  Index num_heads = 0;
  bool bias = true;
  bool add_bias_kv = false;
  bool add_zero_attn = false;
  Index kdim = 0;
  Index vdim = 0;
  Index num_kv_heads = 0;
  // D, the width of each head; 0 means embed_dim / num_heads (PyTorch's only choice). Another D
  // decouples the heads' total width H·D from E: q_proj_weight is then [H·D, E] and
  // out_proj.weight [E, H·D], as a layer after prune_heads has them.
  Index head_dim = 0;
  // Talking-heads attention (Shazeer et al. 2020): learned [H, H] mixes of the heads' logits
  // before the softmax (talking_heads_pre) and of their weights after it (talking_heads_post),
  // each initialised to the identity, so that a new layer computes plain attention. Every head
  // then reads every other, so the reference kernel computes it (Kernel::flash is refused) and
  // prune_heads is refused.
  bool talking_heads_pre = false;
  bool talking_heads_post = false;
  double dropout = 0;
  std::uint64_t seed = 0;

  MultiHeadAttentionConfig() = default;
  MultiHeadAttentionConfig(Index embed_dim_, Index num_heads_)
      : embed_dim(embed_dim_), num_heads(num_heads_) {}
};

// Masks, slopes, the cap and gates are in the type the layer computes in: float for a 16-bit
// layer (ForwardOptions<Eigen::half> holds Mask<float>), T otherwise.
template <class T>
struct ForwardOptions {
  using Compute = detail::compute_t<T>;
  // [B, S] ([S] unbatched). PyTorch MHA passes booleans with true = ignore this key:
  // Mask<T>::blocked_where_true. A float one is added to the scores (PyTorch 2.x).
  Mask<Compute> key_padding_mask;
  // [L, S] for every batch and head, or [B*H, L, S] indexed by b*H + h ([H, L, S] unbatched).
  Mask<Compute> attn_mask;
  bool need_weights = true;
  // Weights averaged over heads [B, L, S'] when true, per head [B, H, L, S'] when false.
  bool average_attn_weights = true;
  // Applies the top-left causal mask (query i sees input keys j <= i) itself, on top of
  // attn_mask. Unlike PyTorch 2.x, where is_causal is only a hint about attn_mask.
  bool is_causal = false;
  // bottom_right aligns is_causal's diagonal with the last key (query i sees j <= i + S - L), as
  // FlashAttention and a decoding step with cached keys need.
  Alignment causal_alignment = Alignment::top_left;
  // Local (sliding-window) attention over the S input keys, see Window in mask.hpp.
  Window window;
  // Global tokens and block-sparse layouts over the S input keys, see SparsePattern in mask.hpp.
  SparsePattern pattern;
  // ALiBi (BLOOM, MPT): empty, or one slope per head (alibi_slopes<T>(H) gives the paper's);
  // adds -slope_h * |c - j| to head h's scores of the input keys, c = i or i + S - L
  // (causal_alignment). bias_k and the zero key get no position bias.
  std::vector<Compute> alibi_slopes;
  // Logit soft-capping (Gemma 2): each head's scores become c tanh(q kᵀ / sqrt(D) / c) before
  // masks and biases; 0 = none.
  Compute softcap = Compute(0);
  // Rotary embeddings (see rotary.hpp) of the projected queries and keys, after the biases: input
  // key j is at position j, query i at c (i, or i + S - L bottom-right, as for ALiBi), both plus
  // rope->position_offset. bias_k and the zero key are not rotated.
  std::optional<Rope> rope;
  // Head gating (Michel et al. 2019; Hugging Face's head_mask): empty, or one gate per head that
  // multiplies head h's weights and so its output (0 removes the head, fractions scale it). The
  // returned weights are the gated ones, averaged over all H heads. backward also returns the
  // gates' gradient, from which head importance is computed (diagnostics.hpp).
  std::vector<Compute> head_gate;
  // Which kernel computes the heads; automatic picks flash unless weights are requested.
  Kernel kernel = Kernel::automatic;
  // Refuse NaN and Inf in the inputs (query, key, value; decode's x) and NaN and +inf in additive
  // masks, with a NonFiniteError naming the tensor and the first bad element, before anything is
  // computed. It reads every input element once, which costs little beside the projections. Off,
  // as in PyTorch: a NaN or Inf then spreads only within its batch element. In query row i it
  // reaches output row i only. In key or value row j it reaches every output row of that batch
  // element that attends to key j, and may reach rows that mask it (a masked score is the score
  // plus -inf, and a weight of 0 times a NaN value is NaN); which ones depends on the kernel, as
  // the flash kernel never reads key blocks a mask hides wholly. A row that reads a NaN never
  // comes out finite. Other batch elements' outputs are unchanged, bit for bit.
  bool check_inputs = false;
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
  using Compute = detail::compute_t<T>;
  Matrix<Compute> qkv, q, k, v;  // projections: fused [B*L, 3E], or q [B*L, E], k and v [B*S', E]
  Matrix<Compute> attended;      // the heads' outputs side by side, [B*L, E]
  Matrix<Compute> gated;         // attended with head_gate applied (only with a gate)
  Tensor<Compute> per_head_weights;
  // 16-bit layers only: the inputs, the output and the averaged weights in float.
  Matrix<Compute> query, key, value, output;
  Tensor<Compute> weights;
  detail::RopeTable<Compute> rope_queries, rope_keys;
  std::vector<detail::KernelScratch<Compute>> kernel;  // one per thread
};

template <class T>
class MultiHeadAttention;

// What backward needs from a forward_train: copies of the inputs and options, the projections,
// the heads' outputs, the flash kernel's log-sum-exp and the dropout seed; and buffers for
// backward. It belongs to one layer and one thread; reusing it for the next forward_train
// reuses its buffers.
template <class T>
class SavedForward {
 public:
  // True once a forward_train has filled it.
  bool filled() const { return layer_ != nullptr; }

 private:
  friend class MultiHeadAttention<T>;
  const MultiHeadAttention<T>* layer_ = nullptr;
  detail::ForwardPlan plan_;
  ForwardOptions<T> options_;
  detail::Dropout<T> dropout_;
  Tensor<T> query_, key_, value_;  // key and value stay empty when fused (they were query)
  Workspace<T> workspace_;         // projections and the heads' outputs, from the forward
  Tensor<T> logsumexp_;            // (B, H, L), flash kernel only
  Matrix<T> grad_attended_, grad_qkv_, grad_q_, grad_k_, grad_v_;
};

// d loss / d query, key and value, with the inputs' shapes.
template <class T>
struct InputGradients {
  Tensor<T> query, key, value;
  Tensor<T> head_gate;  // [H] with ForwardOptions::head_gate, else empty
};

template <class T>
class MultiHeadAttention {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double> ||
                    std::is_same_v<T, Eigen::half> || std::is_same_v<T, Eigen::bfloat16>,
                "MultiHeadAttention<T> is for float, double, Eigen::half and Eigen::bfloat16");

 public:
  // Parameters, inputs, outputs and the KV cache are stored as T; products, scores, the softmax
  // and every sum run in Compute: float for the 16-bit types, T otherwise.
  using Scalar = T;
  using Compute = detail::compute_t<T>;
  static constexpr bool kTrainable = !detail::is_16bit_v<T>;

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
    if (config_.head_dim < 0) {
      detail::throw_argument("head_dim", "must be positive (or 0 for embed_dim / num_heads), got " +
                                             std::to_string(config_.head_dim));
    }
    if (config_.head_dim == 0 && embed % config_.num_heads != 0) {
      detail::throw_argument("num_heads", "embed_dim " + std::to_string(embed) +
                                              " is not divisible by num_heads " +
                                              std::to_string(config_.num_heads));
    }
    if (config_.head_dim == 0) config_.head_dim = embed / config_.num_heads;
    if (config_.kdim < 0 || config_.vdim < 0) {
      detail::throw_argument("kdim/vdim", "must be positive (or 0 for embed_dim), got " +
                                              std::to_string(config_.kdim) + "/" +
                                              std::to_string(config_.vdim));
    }
    detail::check_dropout(config_.dropout);
    if (config_.num_kv_heads < 0 ||
        (config_.num_kv_heads > 0 && config_.num_heads % config_.num_kv_heads != 0)) {
      detail::throw_argument("num_kv_heads", "must divide num_heads " +
                                                 std::to_string(config_.num_heads) +
                                                 " (or be 0 for num_heads), got " +
                                                 std::to_string(config_.num_kv_heads));
    }
    if (config_.num_kv_heads == 0) config_.num_kv_heads = config_.num_heads;
    if (config_.kdim == 0) config_.kdim = embed;
    if (config_.vdim == 0) config_.vdim = embed;
    const Index kv_width = kv_dim(), inner = inner_dim();
    if (packed_projection()) {
      params_.in_proj_weight = Tensor<T>({inner + 2 * kv_width, embed});
    } else {
      params_.q_proj_weight = Tensor<T>({inner, embed});
      params_.k_proj_weight = Tensor<T>({kv_width, config_.kdim});
      params_.v_proj_weight = Tensor<T>({kv_width, config_.vdim});
    }
    if (config_.bias) {
      params_.in_proj_bias = Tensor<T>({inner + 2 * kv_width});
      params_.out_proj_bias = Tensor<T>({embed});
    }
    params_.out_proj_weight = Tensor<T>({embed, inner});
    if (config_.add_bias_kv) {
      params_.bias_k = Tensor<T>({1, 1, kv_width});
      params_.bias_v = Tensor<T>({1, 1, kv_width});
    }
    const Index heads = config_.num_heads;
    if (detail::is_16bit_v<T> && (config_.talking_heads_pre || config_.talking_heads_post)) {
      detail::throw_argument("talking_heads_pre/talking_heads_post",
                             "are not available in a 16-bit layer: use MultiHeadAttention<float>");
    }
    if (config_.talking_heads_pre) params_.talking_heads_pre = Tensor<T>({heads, heads});
    if (config_.talking_heads_post) params_.talking_heads_post = Tensor<T>({heads, heads});
    reset_parameters(config_.seed);
    seed_dropout(config_.seed);
  }

  // Builds a layer from PyTorch state_dict tensors. Which tensors are present decides bias,
  // add_bias_kv and kdim/vdim, and k_proj_weight's rows num_kv_heads; num_heads and add_zero_attn
  // are not in a state_dict.
  static MultiHeadAttention from_state_dict(const std::map<std::string, Tensor<T>>& state,
                                            Index num_heads, bool add_zero_attn = false) {
    // Every parameter of a layer has elements. An empty one would let its other dimensions be
    // anything: out_proj.weight [2^20, 0] would make the layer below allocate terabytes for a
    // file of a few hundred bytes before load_state_dict could compare shapes.
    for (const auto& entry : state) {
      if (entry.second.size() == 0) {
        detail::throw_shape(entry.first, "a tensor with at least one element",
                            entry.second.shape());
      }
    }
    const auto out_weight = state.find("out_proj.weight");
    if (out_weight == state.end()) {
      detail::throw_argument("state_dict", "missing tensor 'out_proj.weight'");
    }
    if (out_weight->second.rank() != 2) {
      detail::throw_shape("out_proj.weight", "[E, H·D]", out_weight->second.shape());
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
      // k_proj_weight has H_kv·D rows; a count that is no multiple of D is left for the shape
      // checks of load_state_dict to report.
      const Index kv_rows = state.at("k_proj_weight").dim(0);
      const Index embed = config.embed_dim;
      const Index head_dim = config.head_dim > 0                       ? config.head_dim
                             : num_heads > 0 && embed % num_heads == 0 ? embed / num_heads
                                                                       : 0;
      if (head_dim > 0 && kv_rows % head_dim == 0 && kv_rows > 0) {
        config.num_kv_heads = kv_rows / head_dim;
      }
    }
    MultiHeadAttention layer(config);
    layer.load_state_dict(state);
    return layer;
  }

  // PyTorch's _reset_parameters: xavier-uniform over the whole in_proj_weight (or each of the
  // q/k/v weights), zero biases, out_proj.weight as nn.Linear, xavier-normal bias_k/bias_v; and
  // identity talking-heads mixes.
  void reset_parameters(std::uint64_t seed) {
    Random random(seed);
    const Index embed = config_.embed_dim;
    if (packed_projection()) {
      xavier_uniform(params_.in_proj_weight, embed, params_.in_proj_weight.dim(0), random);
    } else {
      xavier_uniform(params_.q_proj_weight, embed, inner_dim(), random);
      xavier_uniform(params_.k_proj_weight, config_.kdim, kv_dim(), random);
      xavier_uniform(params_.v_proj_weight, config_.vdim, kv_dim(), random);
    }
    linear_default_uniform(params_.out_proj_weight, inner_dim(), random);
    if (config_.bias) {
      params_.in_proj_bias.flat().setZero();
      params_.out_proj_bias.flat().setZero();
    }
    if (config_.add_bias_kv) {
      // A [1, 1, n] tensor has fan_in = fan_out = n for torch's fan computation.
      xavier_normal(params_.bias_k, kv_dim(), kv_dim(), random);
      xavier_normal(params_.bias_v, kv_dim(), kv_dim(), random);
    }
    for (Tensor<T>* mix : {&params_.talking_heads_pre, &params_.talking_heads_post}) {
      if (mix->size() > 0) mix->matrix().setIdentity();
    }
  }

  const MultiHeadAttentionConfig& config() const { return config_; }
  Index embed_dim() const { return config_.embed_dim; }
  Index num_heads() const { return config_.num_heads; }
  Index head_dim() const { return config_.head_dim; }
  // H·D, the heads' total width: E unless config.head_dim (or prune_heads) made it another.
  Index inner_dim() const { return config_.num_heads * config_.head_dim; }
  // H_kv, the key/value heads (num_heads unless grouped-query attention), and their width H_kv·D.
  Index num_kv_heads() const { return config_.num_kv_heads; }
  Index kv_dim() const { return config_.num_kv_heads * head_dim(); }
  Index kdim() const { return config_.kdim; }
  Index vdim() const { return config_.vdim; }
  // PyTorch's _qkv_same_embed_dim: one packed in_proj_weight instead of three (never with
  // grouped-query attention, whose K and V projections are narrower).
  bool packed_projection() const {
    return config_.kdim == config_.embed_dim && config_.vdim == config_.embed_dim &&
           config_.num_kv_heads == config_.num_heads;
  }

  // The state_dict names of this layer's parameters, in PyTorch's order.
  std::vector<std::string> parameter_names() const {
    std::vector<std::string> names;
    for (const auto& entry : named_parameters()) names.push_back(entry.first);
    return names;
  }
  bool has_parameter(const std::string& name) const {
    const auto parameters = named_parameters();
    return std::any_of(parameters.begin(), parameters.end(),
                       [&](const auto& entry) { return entry.first == name; });
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
  // [S, vdim]. See ForwardOptions for the masks and what is returned. Evaluation mode: no dropout.
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
    const Plan plan = plan_forward(query, key, value, options);
    const detail::CoreOptions<Compute> core = core_options(plan, options);
    run_forward(plan, core, query, key, value, options, workspace, result, nullptr);
  }

  // Self-attention: query, key and value are all x.
  ForwardResult<T> forward(TensorView<const T> x, const ForwardOptions<T>& options = {}) const {
    return forward(x, x, x, options);
  }

  // ---- Training -------------------------------------------------------------------------------
  //
  //   SavedForward<T> saved;                                   // owned by the caller
  //   auto result = layer.forward_train(q, k, v, options, saved);  // training mode: dropout
  //   auto grads = layer.backward(saved, grad_output);         // d loss / d (q, k, v), and
  //                                                            // d loss / d parameters added up
  //   layer.gradient("in_proj_weight"); layer.parameters(); layer.zero_grad();
  //
  // forward_train copies its inputs and options into `saved`, so they may go away; `saved` must
  // not outlive the layer, and the parameters must not change between the two calls (backward
  // uses the saved activations and the current weights). Gradients accumulate over backward
  // calls until zero_grad, as in PyTorch. One saved object serves any number of forward_train /
  // backward pairs, reusing its buffers.

  ForwardResult<T> forward_train(TensorView<const T> query, TensorView<const T> key,
                                 TensorView<const T> value, const ForwardOptions<T>& options,
                                 SavedForward<T>& saved) {
    static_assert(kTrainable,
                  "training runs in float or double: train a MultiHeadAttention<float> "
                  "and load its state_dict into the 16-bit layer");
    saved.layer_ = nullptr;  // unusable until this call succeeds
    const Plan plan = plan_forward(query, key, value, options);
    saved.options_ = options;  // the masks too: core's layouts point into this copy
    detail::CoreOptions<T> core = core_options(plan, saved.options_);
    if (config_.dropout > 0) {
      core.dropout = {config_.dropout, dropout_random_.next_u64(), config_.num_heads,
                      plan.query_len, plan.total_keys};
    }
    // Copies into the saved tensors' own storage: the same shapes as last time allocate nothing.
    const auto keep = [](Tensor<T>& kept, const TensorView<const T>& input) {
      kept.resize(input.shape());
      if (input.size() > 0) std::copy(input.data(), input.data() + input.size(), kept.data());
    };
    keep(saved.query_, query);
    if (!plan.fused) {
      keep(saved.key_, key);
      keep(saved.value_, value);
    }
    if (plan.kernel == Kernel::flash) {
      saved.logsumexp_.resize({plan.batch, config_.num_heads, plan.query_len});
    }
    ForwardResult<T> result;
    const TensorView<const T> saved_query = saved.query_.view();
    run_forward(plan, core, saved_query, plan.fused ? saved_query : saved.key_.view(),
                plan.fused ? saved_query : saved.value_.view(), saved.options_, saved.workspace_,
                result, plan.kernel == Kernel::flash ? saved.logsumexp_.data() : nullptr);
    ensure_gradients();
    saved.plan_ = plan;
    saved.dropout_ = core.dropout;
    saved.layer_ = this;
    return result;
  }

  ForwardResult<T> forward_train(TensorView<const T> x, const ForwardOptions<T>& options,
                                 SavedForward<T>& saved) {
    return forward_train(x, x, x, options, saved);
  }

  // The gradients of loss = sum(output ∘ grad_output) for the forward_train that filled `saved`:
  // returned for the inputs (reported separately for query, key and value even when they were
  // one tensor; the shared tensor's gradient is their sum), and added into gradient(name) for
  // every parameter.
  InputGradients<T> backward(SavedForward<T>& saved, TensorView<const T> grad_output) {
    static_assert(kTrainable, "training runs in float or double");
    if (saved.layer_ != this) {
      detail::throw_argument("saved", saved.layer_ == nullptr
                                          ? "holds no successful forward_train"
                                          : "was filled by another layer's forward_train");
    }
    const Plan& plan = saved.plan_;
    detail::check_shape("grad_output", plan.query_shape, grad_output.shape());
    detail::CoreOptions<T> core = core_options(plan, saved.options_);
    core.dropout = saved.dropout_;
    const Index heads = config_.num_heads;
    const Index rows = plan.batch * plan.query_len;
    const Workspace<T>& forward = saved.workspace_;

    // output = attended W_oᵀ + b_o
    const std::vector<T>& gate = saved.options_.head_gate;
    const auto grad_out = grad_output.matrix();
    detail::threaded_product(grads_.out_proj_weight.matrix(), grad_out.transpose(),
                             gate.empty() ? forward.attended : forward.gated,
                             detail::Accumulate::yes);
    // Column sums of no rows (B or L = 0) are skipped: Eigen's reduction of an empty matrix
    // offsets its null data pointer, which is undefined.
    if (config_.bias && rows > 0) {
      grads_.out_proj_bias.flat() += grad_out.colwise().sum().transpose();
    }
    Matrix<T>& grad_attended = saved.grad_attended_;
    grad_attended.resize(rows, inner_dim());
    detail::threaded_product(grad_attended, grad_out, params_.out_proj_weight.matrix(),
                             detail::Accumulate::no);
    // gated_h = gate_h attended_h: the gate's gradient is sum(grad_gated_h ∘ attended_h), and the
    // heads' own gradient is gate_h grad_gated_h.
    Tensor<T> grad_gate;
    if (!gate.empty()) {
      grad_gate.resize({heads});
      for (Index h = 0; h < heads; ++h) {
        auto grad_head = grad_attended.middleCols(h * head_dim(), head_dim());
        grad_gate.data()[h] =
            grad_head.cwiseProduct(forward.attended.middleCols(h * head_dim(), head_dim())).sum();
        grad_head *= gate[static_cast<std::size_t>(h)];
      }
    }

    // the heads: gradients of q, k and v in buffers laid out as the forward's projections
    const T* q_data;
    const T* k_data;
    const T* v_data;
    T* grad_q_data;
    T* grad_k_data;
    T* grad_v_data;
    const Index inner = inner_dim();
    Index q_stride = inner, kv_stride = kv_dim();
    if (plan.fused) {
      saved.grad_qkv_.resize(rows, inner + 2 * kv_dim());
      q_data = forward.qkv.data();
      grad_q_data = saved.grad_qkv_.data();
      k_data = detail::offset_pointer(q_data, bias_offset(1));
      v_data = detail::offset_pointer(q_data, bias_offset(2));
      grad_k_data = detail::offset_pointer(grad_q_data, bias_offset(1));
      grad_v_data = detail::offset_pointer(grad_q_data, bias_offset(2));
      q_stride = kv_stride = inner + 2 * kv_dim();
    } else {
      saved.grad_q_.resize(rows, inner);
      saved.grad_k_.resize(plan.batch * plan.total_keys, kv_dim());
      saved.grad_v_.resize(plan.batch * plan.total_keys, kv_dim());
      q_data = forward.q.data();
      k_data = forward.k.data();
      v_data = forward.v.data();
      grad_q_data = saved.grad_q_.data();
      grad_k_data = saved.grad_k_.data();
      grad_v_data = saved.grad_v_.data();
    }
    const T* attended = forward.attended.data();
    const T* grad_attended_data = grad_attended.data();
    Tensor<T> grad_pre, grad_post;  // [H, H] with talking heads, else empty (null)
    if (config_.talking_heads_pre) grad_pre.resize({heads, heads});
    if (config_.talking_heads_post) grad_post.resize({heads, heads});
    detail::attention_backward<T>(
        plan.kernel, plan.batch, heads, head_layout(q_data, plan.query_len, q_stride),
        kv_head_layout(k_data, plan.total_keys, kv_stride),
        kv_head_layout(v_data, plan.total_keys, kv_stride),
        head_layout(attended, plan.query_len, inner),
        head_layout(grad_attended_data, plan.query_len, inner), saved.logsumexp_.data(),
        head_layout(grad_q_data, plan.query_len, q_stride),
        kv_head_layout(grad_k_data, plan.total_keys, kv_stride),
        kv_head_layout(grad_v_data, plan.total_keys, kv_stride), core, saved.workspace_.kernel,
        grad_pre.data(), grad_post.data());
    // The kernel overwrites the mixes' gradients; parameters' gradients accumulate.
    if (config_.talking_heads_pre) grads_.talking_heads_pre.flat() += grad_pre.flat();
    if (config_.talking_heads_post) grads_.talking_heads_post.flat() += grad_post.flat();
    if (saved.options_.rope) {
      rotate_queries_and_keys(plan, saved.options_, saved.workspace_, grad_q_data, q_stride,
                              grad_k_data, kv_stride, true);
    }

    // the projections y = x Wᵀ + b:
    //   grad W += grad_yᵀ x,  grad b += colsum(grad_y),  grad x = grad_y W
    InputGradients<T> grads;
    grads.head_gate = std::move(grad_gate);
    grads.query = Tensor<T>(saved.query_.shape());
    grads.key = Tensor<T>(plan.fused ? saved.query_.shape() : saved.key_.shape());
    grads.value = Tensor<T>(plan.fused ? saved.query_.shape() : saved.value_.shape());
    if (plan.fused) {
      // No rows (B or L = 0): nothing to add, and the column blocks below would offset null data.
      if (rows == 0) return grads;
      const auto input = saved.query_.matrix();
      detail::threaded_product(grads_.in_proj_weight.matrix(), saved.grad_qkv_.transpose(), input,
                               detail::Accumulate::yes);
      if (config_.bias) grads_.in_proj_bias.flat() += saved.grad_qkv_.colwise().sum().transpose();
      Tensor<T>* input_grads[] = {&grads.query, &grads.key, &grads.value};
      for (int which = 0; which < 3; ++which) {
        detail::threaded_product(
            input_grads[which]->matrix(),
            saved.grad_qkv_.middleCols(bias_offset(which), projection_width(which)),
            weight_rows(which), detail::Accumulate::no);
      }
      return grads;
    }
    backward_projection(saved.grad_q_, saved.query_, 0, plan.batch, plan.query_len, plan.query_len,
                        grads.query);
    backward_projection(saved.grad_k_, saved.key_, 1, plan.batch, plan.key_len, plan.total_keys,
                        grads.key);
    backward_projection(saved.grad_v_, saved.value_, 2, plan.batch, plan.key_len, plan.total_keys,
                        grads.value);
    return grads;
  }

  // The accumulated gradient of one parameter, with its shape. Throws until a forward_train,
  // zero_grad or parameters() call has allocated the gradients (PyTorch's grad is None then).
  TensorView<const T> gradient(const std::string& name) const {
    if (!has_grads_) {
      detail::throw_argument("gradient", "'" + name +
                                             "' has no gradient yet (call forward_train and "
                                             "backward, zero_grad or parameters() first)");
    }
    for (const auto& entry : named_tensors(grads_)) {
      if (entry.first == name) return entry.second->view();
    }
    // Not a parameter of this layer: throws, naming those it has.
    const_cast<MultiHeadAttention*>(this)->find_parameter(name);
    return {};
  }

  void zero_grad() {
    ensure_gradients();
    for (const auto& entry : named_tensors(grads_)) {
      const_cast<Tensor<T>*>(entry.second)->flat().setZero();
    }
  }

  // Each parameter with its gradient, under PyTorch's names and order: what optimisers, gradient
  // clipping and diagnostics take. The views stay valid as long as the layer.
  ParameterList<T> parameters() {
    static_assert(kTrainable, "training runs in float or double");
    ensure_gradients();
    ParameterList<T> list;
    const auto values = named_tensors(params_);
    const auto grads = named_tensors(grads_);
    for (std::size_t i = 0; i < values.size(); ++i) {
      list.push_back({values[i].first, const_cast<Tensor<T>*>(values[i].second)->view(),
                      const_cast<Tensor<T>*>(grads[i].second)->view()});
    }
    return list;
  }

  // Restarts the dropout generator: the same seed gives the same dropout masks for the same
  // sequence of forward_train calls. (Construction seeds it from config.seed.)
  void seed_dropout(std::uint64_t seed) { dropout_random_ = Random(seed ^ kDropoutSeedSalt); }

  // Removes heads from the parameters ("Are Sixteen Heads Really Better than One?"): their rows
  // of W_q, W_k, W_v, of the in-projection bias and of bias_k/bias_v, and their columns of
  // out_proj.weight. `heads` are indices in [0, H), in any order, each once; at least one head
  // must stay. The layer then computes what it computed with those heads gated to 0
  // (ForwardOptions::head_gate), with H' heads of the same D: q_proj_weight becomes [H'·D, E] and
  // out_proj.weight [E, H'·D] (in_proj_weight [3·H'·D, E] if packed), under the same names, so a
  // pruned layer's state_dict loads back with from_state_dict. The kept heads' per-head weights
  // are unchanged; averaged weights now average over H' heads. Gradients are dropped (the next
  // forward_train, zero_grad or parameters() allocates them in the new shapes), and ParameterRefs
  // taken before (an optimiser's) point to the old shapes: take them again. Refused for
  // grouped-query layers, whose query heads share key/value heads, and with talking heads, where
  // a head gated to 0 still feeds the others' mixes.
  void prune_heads(const std::vector<Index>& heads) {
    const Index count = config_.num_heads, width = head_dim();
    if (config_.talking_heads_pre || config_.talking_heads_post) {
      detail::throw_argument("prune_heads",
                             "with talking heads every head reads every other head's logits or "
                             "weights, so removing a head is not gating it: gate it instead "
                             "(ForwardOptions::head_gate)");
    }
    if (num_kv_heads() != count) {
      detail::throw_argument("prune_heads",
                             "a grouped-query layer (" + std::to_string(num_kv_heads()) +
                                 " key/value heads for " + std::to_string(count) +
                                 " query heads) shares key/value heads between query heads: "
                                 "gate its heads instead (ForwardOptions::head_gate)");
    }
    std::vector<bool> removed(static_cast<std::size_t>(count), false);
    for (const Index h : heads) {
      if (h < 0 || h >= count) {
        detail::throw_argument("heads", "expected head indices in [0, " + std::to_string(count) +
                                            "), got " + std::to_string(h));
      }
      if (removed[static_cast<std::size_t>(h)]) {
        detail::throw_argument("heads", "head " + std::to_string(h) + " is listed twice");
      }
      removed[static_cast<std::size_t>(h)] = true;
    }
    std::vector<Index> kept;
    for (Index h = 0; h < count; ++h) {
      if (!removed[static_cast<std::size_t>(h)]) kept.push_back(h);
    }
    if (kept.empty()) {
      detail::throw_argument(
          "heads", "would remove all " + std::to_string(count) + " heads: at least one must stay");
    }
    if (heads.empty()) return;

    MultiHeadAttentionConfig pruned = config_;
    pruned.num_heads = pruned.num_kv_heads = static_cast<Index>(kept.size());
    pruned.head_dim = width;
    MultiHeadAttention next(pruned);  // the parameters' new shapes
    for (std::size_t i = 0; i < kept.size(); ++i) {
      const Index from = kept[i] * width, to = static_cast<Index>(i) * width;
      for (int which = 0; which < 3; ++which) {
        next.projection(next.params_, which).middleRows(to, width) =
            weight_rows(which).middleRows(from, width);
        if (config_.bias) {
          next.params_.in_proj_bias.flat().segment(next.bias_offset(which) + to, width) =
              params_.in_proj_bias.flat().segment(bias_offset(which) + from, width);
        }
      }
      if (config_.add_bias_kv) {
        next.params_.bias_k.flat().segment(to, width) = params_.bias_k.flat().segment(from, width);
        next.params_.bias_v.flat().segment(to, width) = params_.bias_v.flat().segment(from, width);
      }
      next.params_.out_proj_weight.matrix().middleCols(to, width) =
          params_.out_proj_weight.matrix().middleCols(from, width);
    }
    if (config_.bias) next.params_.out_proj_bias = params_.out_proj_bias;
    config_ = next.config_;
    params_ = std::move(next.params_);
    grads_ = ParameterSet();
    has_grads_ = false;
  }

  // ---- Decoding with a KV cache (see kv_cache.hpp) ----

  // A cache for this layer's keys and values: `batch` sequences of at most `capacity` tokens, or
  // with window >= 0 a sliding-window cache keeping each sequence's last `window` keys.
  KVCache<T> make_kv_cache(Index batch, Index capacity, Index window = -1) const {
    return KVCache<T>(batch, num_kv_heads(), head_dim(), capacity, window);
  }

  // What decode needs by default: causal, no weights.
  static ForwardOptions<T> decode_options() {
    ForwardOptions<T> options;
    options.need_weights = false;
    options.is_causal = true;
    return options;
  }

  // One decoding step of self-attention. x [B, n, E] ([n, E] for a cache of one sequence) holds
  // each sequence's next n tokens, or with new_tokens only the first new_tokens[b] of row b (the
  // rest is padding, and its output rows are 0): sequences of different lengths advance together.
  // The new tokens' keys and values are projected (and rotated) into the cache, and each new
  // token attends to its sequence's cache: the output is that of forward over the whole sequence
  // (with the same options), for those tokens.
  //
  // Token i of the step is at position cache.position(b) + i. The alignment is therefore always
  // bottom-right (the new tokens come after the cached ones): is_causal, the window, the pattern
  // and ALiBi use it whatever causal_alignment, window.alignment and pattern.alignment say, and
  // rope rotates by that position plus rope->position_offset. is_causal = false lets a step's
  // tokens see each other (a prompt with bidirectional attention). Refused, before anything
  // changes: masks (the cache decides what a token sees), need_weights, add_bias_kv and
  // add_zero_attn (their key would follow every step's keys), kdim or vdim other than E, a window
  // wider than a sliding cache keeps, a pattern with a sliding cache, and a step that overflows
  // the cache's capacity. Const: a layer serves any number of caches, one thread each.
  ForwardResult<T> decode(TensorView<const T> x, KVCache<T>& cache,
                          const ForwardOptions<T>& options = decode_options(),
                          const std::vector<Index>& new_tokens = {}) const {
    const Index heads = config_.num_heads, width = kv_dim();
    const Index inner = inner_dim();
    const Index batch = cache.batch();
    const Index steps = check_decode(x, cache, options, new_tokens);
    const Kernel kernel = resolve_kernel(options.kernel, false);
    const Index rotary_dim =
        options.rope ? detail::checked_rotary_dim(*options.rope, head_dim()) : 0;
    detail::CoreOptions<Compute> core;
    core.scale = Compute(1) / std::sqrt(static_cast<Compute>(head_dim()));
    core.causal = options.is_causal ? Causal::bottom_right : Causal::none;
    core.window = options.window;
    core.window.alignment = Alignment::bottom_right;
    core.alibi_slopes = detail::checked_alibi_slopes(options.alibi_slopes, heads);
    core.alibi_alignment = Alignment::bottom_right;
    core.softcap = detail::checked_softcap(options.softcap);
    core.talking_heads = talking_heads();

    // Every sequence's n rows projected at once; padding rows too (cheaper than gathering).
    const auto input = as_compute(x, cache.input_);  // [B*n, E]
    Matrix<Compute>* projected[] = {&cache.queries_, &cache.new_keys_, &cache.new_values_};
    for (int which = 0; which < 3; ++which) {
      projected[which]->resize(input.rows(), projection_width(which));
      detail::product_transposed(*projected[which], input, weight_rows(which),
                                 detail::Accumulate::no, cache.kernel_);
      add_bias(*projected[which], which);
    }
    cache.attended_.resize(input.rows(), inner);
    cache.attended_.setZero();

    for (Index b = 0; b < batch; ++b) {
      const Index count = new_tokens.empty() ? steps : new_tokens[static_cast<std::size_t>(b)];
      if (count == 0) continue;
      Compute* queries = cache.queries_.data() + b * steps * inner;
      Compute* keys = cache.new_keys_.data() + b * steps * width;
      Compute* values = cache.new_values_.data() + b * steps * width;
      if (options.rope) {
        cache.rope_table_.fill(*options.rope, rotary_dim, cache.position(b), count);
        detail::rotate_heads(queries, count, inner, heads, head_dim(), cache.rope_table_, false);
        detail::rotate_heads(keys, count, width, num_kv_heads(), head_dim(), cache.rope_table_,
                             false);
      }
      const Index first = cache.reserve(b, count);
      detail::narrow(keys, count * width, cache.key_row(b, first));
      detail::narrow(values, count * width, cache.value_row(b, first));
      const Index start = cache.start_[static_cast<std::size_t>(b)];
      const Index total_keys = first + count - start;
      core.causal_cols = total_keys;
      core.pattern = detail::checked_pattern(options.pattern, heads, count, total_keys,
                                             Alignment::bottom_right);
      detail::attention<Compute>(
          kernel, 1, heads, head_layout<const Compute>(queries, count, inner),
          kv_head_layout<const T>(cache.key_row(b, start), total_keys, width),
          kv_head_layout<const T>(cache.value_row(b, start), total_keys, width),
          head_layout(cache.attended_.data() + b * steps * inner, count, inner), core, nullptr,
          cache.kernel_);
      cache.advance(b, count);
    }

    scale_heads(cache.attended_, options.head_gate);
    ForwardResult<T> result;
    result.output.resize(x.shape());
    project_output(cache.attended_, result.output, cache.output_, cache.kernel_);
    auto output = result.output.matrix();
    for (Index b = 0; b < batch && !new_tokens.empty(); ++b) {
      const Index count = new_tokens[static_cast<std::size_t>(b)];
      output.middleRows(b * steps + count, steps - count).setZero();
    }
    return result;
  }

 private:
  using ParameterSet = detail::ParameterSet<T>;

  void check_head_gate(const std::vector<Compute>& gate) const {
    if (gate.empty()) return;
    if (static_cast<Index>(gate.size()) != config_.num_heads) {
      detail::throw_argument("head_gate", "expected one gate per head (" +
                                              std::to_string(config_.num_heads) + "), got " +
                                              std::to_string(gate.size()));
    }
    for (std::size_t h = 0; h < gate.size(); ++h) {
      if (!std::isfinite(gate[h])) {
        detail::throw_argument("head_gate", "gate " + std::to_string(h) + " is not finite");
      }
    }
  }

  // The heads' outputs the output projection reads: workspace.attended, or with a gate its gated
  // copy (attended itself stays ungated: backward needs it for the gates' gradient).
  const Matrix<Compute>& gate_heads(const std::vector<Compute>& gate,
                                    Workspace<T>& workspace) const {
    if (gate.empty()) return workspace.attended;
    workspace.gated = workspace.attended;
    scale_heads(workspace.gated, gate);
    return workspace.gated;
  }

  // Head h's columns of the heads' outputs [rows, H·D] times gate[h] (nothing for no gate).
  void scale_heads(Matrix<Compute>& heads_output, const std::vector<Compute>& gate) const {
    // No rows (L = 0, or a decoding step of no tokens): the data pointer is null, and Eigen's
    // middleCols would offset it, which is undefined.
    if (heads_output.rows() == 0) return;
    for (std::size_t h = 0; h < gate.size(); ++h) {
      heads_output.middleCols(static_cast<Index>(h) * head_dim(), head_dim()) *= gate[h];
    }
  }

  // ForwardOptions::check_inputs: the inputs finite, additive masks free of NaN and +inf. In
  // self-attention the three are one tensor, which is then named query.
  static void check_input_values(const TensorView<const T>& query, const TensorView<const T>& key,
                                 const TensorView<const T>& value,
                                 const ForwardOptions<T>& options) {
    check_finite(query, "query");
    check_finite(key, "key");
    check_finite(value, "value");
    if (options.attn_mask.kind() == MaskKind::additive) {
      check_additive_mask(options.attn_mask.values().view(), "attn_mask");
    }
    if (options.key_padding_mask.kind() == MaskKind::additive) {
      check_additive_mask(options.key_padding_mask.values().view(), "key_padding_mask");
    }
  }

  // decode's checks, before anything changes; returns n.
  Index check_decode(const TensorView<const T>& x, const KVCache<T>& cache,
                     const ForwardOptions<T>& options, const std::vector<Index>& new_tokens) const {
    const Index embed = config_.embed_dim, batch = cache.batch();
    if (config_.add_bias_kv || config_.add_zero_attn) {
      detail::throw_argument("decode",
                             "a layer with add_bias_kv or add_zero_attn cannot decode with a KV "
                             "cache: its extra key would follow every step's keys");
    }
    if (config_.kdim != embed || config_.vdim != embed) {
      detail::throw_argument(
          "decode",
          "decodes self-attention only, so kdim and vdim must be E = " + std::to_string(embed) +
              ", got " + std::to_string(config_.kdim) + " and " + std::to_string(config_.vdim));
    }
    if (cache.num_kv_heads() != num_kv_heads() || cache.head_dim() != head_dim()) {
      detail::throw_argument(
          "cache", "holds " + std::to_string(cache.num_kv_heads()) +
                       " key/value heads of D = " + std::to_string(cache.head_dim()) +
                       ", the layer has " + std::to_string(num_kv_heads()) +
                       " of D = " + std::to_string(head_dim()) + " (make it with make_kv_cache)");
    }
    const std::string row_shape = "[" + std::to_string(batch) + ", n, " + std::to_string(embed) +
                                  "] (one row per cached sequence)";
    if (x.rank() == 2 && batch == 1) {
      detail::check_shape("x", {detail::kAnyDim, embed}, x.shape());
    } else if (x.rank() != 3 || x.dim(0) != batch || x.dim(2) != embed) {
      detail::throw_shape("x", row_shape + (batch == 1 ? " or [n, E]" : ""), x.shape());
    }
    const Index steps = x.dim(x.rank() - 2);
    if (!new_tokens.empty() && static_cast<Index>(new_tokens.size()) != batch) {
      detail::throw_argument("new_tokens", "expected one count per sequence (" +
                                               std::to_string(batch) + "), got " +
                                               std::to_string(new_tokens.size()));
    }
    for (Index b = 0; b < batch; ++b) {
      const Index count = new_tokens.empty() ? steps : new_tokens[static_cast<std::size_t>(b)];
      if (count < 0 || count > steps) {
        detail::throw_argument("new_tokens",
                               "sequence " + std::to_string(b) + ": expected a count in [0, n = " +
                                   std::to_string(steps) + "], got " + std::to_string(count));
      }
      if (cache.length(b) + count > cache.capacity()) {
        detail::throw_argument(
            "cache", "sequence " + std::to_string(b) + " holds " + std::to_string(cache.length(b)) +
                         " keys of its capacity " + std::to_string(cache.capacity()) + "; " +
                         std::to_string(count) + " more do not fit");
      }
    }
    check_head_gate(options.head_gate);
    detail::check_window(options.window);
    if (!options.attn_mask.empty() || !options.key_padding_mask.empty()) {
      detail::throw_argument("decode",
                             "takes no attn_mask or key_padding_mask: the cache decides which keys "
                             "a token sees (new_tokens gives each sequence's length)");
    }
    if (options.need_weights) {
      detail::throw_argument("need_weights",
                             "decode returns no attention weights: set it false "
                             "(decode_options() does), or run forward");
    }
    if (cache.sliding() && (options.window.left < 0 || options.window.left > cache.window())) {
      detail::throw_argument(
          "window.left", "a sliding-window cache keeping the last " +
                             std::to_string(cache.window()) +
                             " keys serves windows of at most that many keys to the left, got " +
                             std::to_string(options.window.left) +
                             (options.window.left < 0 ? " (unbounded)" : ""));
    }
    if (cache.sliding() && options.pattern.active()) {
      detail::throw_argument("pattern",
                             "global tokens and block layouts are over absolute positions, which "
                             "a sliding-window cache drops: use a cache that keeps every token");
    }
    // Here rather than where each sequence's keys are known: a layout too small for a later
    // sequence must throw before earlier sequences have advanced.
    for (Index b = 0; b < batch && options.pattern.active(); ++b) {
      const Index count = new_tokens.empty() ? steps : new_tokens[static_cast<std::size_t>(b)];
      if (count == 0) continue;
      detail::checked_pattern(options.pattern, config_.num_heads, count, cache.length(b) + count,
                              Alignment::bottom_right);
    }
    if (options.check_inputs) check_finite(x, "x");
    return steps;
  }

  using Plan = detail::ForwardPlan;
  static constexpr std::uint64_t kDropoutSeedSalt = 0xD409A7E5EEDull;

  // Checks the inputs and options of a forward call, before anything is computed.
  Plan plan_forward(const TensorView<const T>& query, const TensorView<const T>& key,
                    const TensorView<const T>& value, const ForwardOptions<T>& options) const {
    const Index embed = config_.embed_dim;
    Plan plan;
    plan.batched = query.rank() == 3;
    if (!plan.batched && query.rank() != 2) {
      detail::throw_shape(
          "query", "[B, L, " + std::to_string(embed) + "] or [L, " + std::to_string(embed) + "]",
          query.shape());
    }
    plan.batch = plan.batched ? query.dim(0) : 1;
    plan.query_len = query.dim(query.rank() - 2);
    plan.key_len = key.rank() == query.rank() ? key.dim(key.rank() - 2) : 0;
    plan.query_shape =
        plan.batched ? Shape{plan.batch, plan.query_len, embed} : Shape{plan.query_len, embed};
    detail::check_shape("query", plan.query_shape, query.shape());
    const auto input_shape = [&](Index length, Index width) {
      return plan.batched ? Shape{plan.batch, length, width} : Shape{length, width};
    };
    detail::check_shape("key", input_shape(detail::kAnyDim, config_.kdim), key.shape());
    detail::check_shape("value", input_shape(plan.key_len, config_.vdim), value.shape());
    if (options.check_inputs) check_input_values(query, key, value, options);
    // S' keys: the inputs', then bias_k, then the zero key.
    plan.total_keys =
        plan.key_len + (config_.add_bias_kv ? 1 : 0) + (config_.add_zero_attn ? 1 : 0);
    plan.kernel = resolve_kernel(options.kernel, options.need_weights);
    if (options.rope) detail::checked_rotary_dim(*options.rope, head_dim());
    check_head_gate(options.head_gate);
    detail::check_window(options.window);
    // Self-attention without extra key rows projects q, k and v in one [B*L, E] x [E, 3E] GEMM.
    plan.fused = packed_projection() && !config_.add_bias_kv && !config_.add_zero_attn &&
                 query.data() == key.data() && key.data() == value.data() &&
                 query.shape() == key.shape() && key.shape() == value.shape();
    return plan;
  }

  // The kernel options of a call, pointing into options' masks (which must outlive them). Checks
  // the masks' shapes.
  detail::CoreOptions<Compute> core_options(const Plan& plan,
                                            const ForwardOptions<T>& options) const {
    detail::CoreOptions<Compute> core;
    core.scale = Compute(1) / std::sqrt(static_cast<Compute>(head_dim()));
    core.attn_mask =
        attn_mask_layout(options.attn_mask, plan.batched, plan.batch, plan.query_len, plan.key_len);
    core.key_padding_mask =
        key_padding_layout(options.key_padding_mask, plan.batched, plan.batch, plan.key_len);
    core.causal = !options.is_causal                                    ? Causal::none
                  : options.causal_alignment == Alignment::bottom_right ? Causal::bottom_right
                                                                        : Causal::top_left;
    core.causal_cols = plan.key_len;
    core.window = options.window;
    core.pattern = detail::checked_pattern(options.pattern, config_.num_heads, plan.query_len,
                                           plan.key_len, options.pattern.alignment);
    core.alibi_slopes = detail::checked_alibi_slopes(options.alibi_slopes, config_.num_heads);
    core.alibi_alignment = options.causal_alignment;
    core.softcap = detail::checked_softcap(options.softcap);
    core.talking_heads = talking_heads();
    return core;
  }

  detail::TalkingHeads<Compute> talking_heads() const {
    if constexpr (detail::is_16bit_v<T>) {
      return {};  // refused by the constructor
    } else {
      return {config_.talking_heads_pre ? params_.talking_heads_pre.data() : nullptr,
              config_.talking_heads_post ? params_.talking_heads_post.data() : nullptr};
    }
  }

  // The kernel a call runs: talking heads mix heads, which only the reference kernel can.
  Kernel resolve_kernel(Kernel requested, bool need_weights) const {
    if (!talking_heads().active()) return detail::resolve_kernel(requested, need_weights);
    if (requested == Kernel::flash) {
      detail::throw_argument("kernel",
                             "flash cannot mix heads: talking heads run on Kernel::reference "
                             "(which Kernel::automatic picks)");
    }
    return Kernel::reference;
  }

  // Head h of batch b: rows b*rows.., columns h*D.. of a buffer whose rows are `stride` apart.
  template <class Element>
  detail::HeadLayout<Element> head_layout(Element* data, Index rows, Index stride) const {
    return {data, rows * stride, head_dim(), stride, rows, head_dim()};
  }
  // The same for keys and values, whose head h / (H / H_kv) query head h reads.
  template <class Element>
  detail::HeadLayout<Element> kv_head_layout(Element* data, Index rows, Index stride) const {
    detail::HeadLayout<Element> layout = head_layout(data, rows, stride);
    layout.group = config_.num_heads / config_.num_kv_heads;
    return layout;
  }
  // Where projection `which` (0, 1, 2 for q, k, v) starts in in_proj_bias, and its width.
  Index bias_offset(int which) const {
    return which == 0 ? 0 : inner_dim() + (which - 1) * kv_dim();
  }
  Index projection_width(int which) const { return which == 0 ? inner_dim() : kv_dim(); }

  // The forward pass proper; logsumexp is null or (B, H, L) for the flash kernel's backward.
  void run_forward(const Plan& plan, const detail::CoreOptions<Compute>& core,
                   const TensorView<const T>& query, const TensorView<const T>& key,
                   const TensorView<const T>& value, const ForwardOptions<T>& options,
                   Workspace<T>& workspace, ForwardResult<T>& result, Compute* logsumexp) const {
    const Index heads = config_.num_heads;
    const Index batch = plan.batch, query_len = plan.query_len, total_keys = plan.total_keys;
    Compute* q_data;
    Compute* k_data;
    Compute* v_data;
    const Index inner = inner_dim();
    Index q_stride = inner, kv_stride = kv_dim();
    if (plan.fused) {
      // [B*L, 3E]: heads read q, k and v at column offsets 0, E and 2E.
      Matrix<Compute>& qkv = workspace.qkv;
      qkv.resize(batch * query_len, inner + 2 * kv_dim());
      detail::product_transposed(qkv, as_compute(query, workspace.query),
                                 params_.in_proj_weight.matrix(), detail::Accumulate::no,
                                 workspace.kernel);
      if (config_.bias) {
        qkv.rowwise() += params_.in_proj_bias.flat().transpose().template cast<Compute>();
      }
      q_data = qkv.data();
      k_data = detail::offset_pointer(q_data, bias_offset(1));
      v_data = detail::offset_pointer(q_data, bias_offset(2));
      q_stride = kv_stride = inner + 2 * kv_dim();
    } else {
      // q [B*L, E]; k, v [B*S', E] with the extra rows after each batch's S projected rows.
      workspace.q.resize(batch * query_len, inner);
      detail::product_transposed(workspace.q, as_compute(query, workspace.query), weight_rows(0),
                                 detail::Accumulate::no, workspace.kernel);
      add_bias(workspace.q, 0);
      project_keys(as_compute(key, workspace.key), 1, batch, plan.key_len, total_keys,
                   params_.bias_k, workspace.k, workspace);
      project_keys(as_compute(value, workspace.value), 2, batch, plan.key_len, total_keys,
                   params_.bias_v, workspace.v, workspace);
      q_data = workspace.q.data();
      k_data = workspace.k.data();
      v_data = workspace.v.data();
    }

    if (options.rope) {
      rotate_queries_and_keys(plan, options, workspace, q_data, q_stride, k_data, kv_stride, false);
    }

    // Per-head weights go straight into the result unless they are to be averaged (or converted
    // to 16 bits).
    Tensor<Compute>& per_head_weights = weights_buffer(options, workspace, result);
    if (options.need_weights) per_head_weights.resize({batch, heads, query_len, total_keys});
    workspace.attended.resize(batch * query_len, inner);
    detail::attention<Compute>(
        plan.kernel, batch, heads, head_layout<const Compute>(q_data, query_len, q_stride),
        kv_head_layout<const Compute>(k_data, total_keys, kv_stride),
        kv_head_layout<const Compute>(v_data, total_keys, kv_stride),
        head_layout(workspace.attended.data(), query_len, inner), core,
        options.need_weights ? per_head_weights.data() : nullptr, workspace.kernel, logsumexp);

    result.output.resize(plan.query_shape);
    project_output(gate_heads(options.head_gate, workspace), result.output, workspace.output,
                   workspace.kernel);

    if (!options.need_weights) {
      result.attn_weights = Tensor<T>();
      return;
    }
    for (Index h = 0; h < static_cast<Index>(options.head_gate.size()); ++h) {
      for (Index b = 0; b < batch; ++b) {
        per_head_weights[b][h].matrix() *= options.head_gate[static_cast<std::size_t>(h)];
      }
    }
    if constexpr (detail::is_16bit_v<T>) {
      const Tensor<Compute>* weights = &per_head_weights;
      if (options.average_attn_weights) {
        average_over_heads(per_head_weights, workspace.weights);
        weights = &workspace.weights;
      }
      result.attn_weights.resize(weights->shape());
      detail::narrow(weights->data(), weights->size(), result.attn_weights.data());
    } else if (options.average_attn_weights) {
      average_over_heads(per_head_weights, result.attn_weights);
    }
    if (!plan.batched) {
      // Drop the batch axis of size 1: [1, ...] -> [...].
      Shape unbatched(result.attn_weights.shape().begin() + 1, result.attn_weights.shape().end());
      result.attn_weights.reshape(std::move(unbatched));
    }
  }

  // Where the kernel writes per-head weights: the result itself when they are returned as they
  // are, else the workspace (to be averaged, or converted to 16 bits).
  static Tensor<Compute>& weights_buffer(const ForwardOptions<T>& options, Workspace<T>& workspace,
                                         ForwardResult<T>& result) {
    if constexpr (detail::is_16bit_v<T>) {
      return workspace.per_head_weights;
    } else {
      return options.need_weights && !options.average_attn_weights ? result.attn_weights
                                                                   : workspace.per_head_weights;
    }
  }

  // An input [.., width] as [rows, width] in Compute: the tensor itself, or (16-bit layers) its
  // conversion into `buffer`.
  static Eigen::Map<const Matrix<Compute>> as_compute(const TensorView<const T>& input,
                                                      Matrix<Compute>& buffer) {
    if constexpr (detail::is_16bit_v<T>) {
      const auto rows = input.matrix();
      buffer.resize(rows.rows(), rows.cols());
      detail::widen(input.data(), input.size(), buffer.data());
      return {buffer.data(), buffer.rows(), buffer.cols()};
    } else {
      return input.matrix();
    }
  }

  // output (shape [.., E]) = heads_output [rows, H·D] W_oᵀ + b_o; a 16-bit layer computes it in
  // `buffer` and rounds it once into output.
  void project_output(const Matrix<Compute>& heads_output, Tensor<T>& output,
                      Matrix<Compute>& buffer,
                      std::vector<detail::KernelScratch<Compute>>& scratch) const {
    const auto project = [&](auto&& rows) {
      detail::product_transposed(rows, heads_output, params_.out_proj_weight.matrix(),
                                 detail::Accumulate::no, scratch);
      if (config_.bias) {
        rows.rowwise() += params_.out_proj_bias.flat().transpose().template cast<Compute>();
      }
    };
    if constexpr (detail::is_16bit_v<T>) {
      buffer.resize(heads_output.rows(), config_.embed_dim);
      project(buffer);
      detail::narrow(buffer.data(), buffer.size(), output.data());
    } else {
      project(output.matrix());
    }
  }

  // Applies options.rope, in place, to the projected queries (rows of `q`, query_len per batch) and
  // the input keys' rows of `k` (the first key_len of each batch's S'); inverse turns gradients
  // with respect to the rotated rows into gradients with respect to the unrotated ones.
  void rotate_queries_and_keys(const Plan& plan, const ForwardOptions<T>& options,
                               Workspace<T>& workspace, Compute* q, Index q_stride, Compute* k,
                               Index kv_stride, bool inverse) const {
    const Rope& rope = *options.rope;
    const Index rotary_dim = detail::checked_rotary_dim(rope, head_dim());
    const Index query_shift =
        options.causal_alignment == Alignment::bottom_right ? plan.key_len - plan.query_len : 0;
    // backward (inverse) runs on the saved workspace whose tables forward_train filled for the
    // same plan and options: only the forward computes the angles.
    if (!inverse) {
      workspace.rope_queries.fill(rope, rotary_dim, query_shift, plan.query_len);
      workspace.rope_keys.fill(rope, rotary_dim, 0, plan.key_len);
    }
    for (Index b = 0; b < plan.batch; ++b) {
      detail::rotate_heads(q + b * plan.query_len * q_stride, plan.query_len, q_stride,
                           config_.num_heads, head_dim(), workspace.rope_queries, inverse);
      detail::rotate_heads(k + b * plan.total_keys * kv_stride, plan.key_len, kv_stride,
                           num_kv_heads(), head_dim(), workspace.rope_keys, inverse);
    }
  }

  // The backward of one projection y = x Wᵀ + b (which = 0, 1, 2 for q, k, v), where grad_y is
  // [B*rows', E or H_kv·D] with rows' = total_rows per batch: the first `rows` of each batch came
  // from input [B, rows, width]; a bias_k/bias_v row follows (add_bias_kv), then the zero row.
  void backward_projection(const Matrix<T>& grad_y, const Tensor<T>& input, int which, Index batch,
                           Index rows, Index total_rows, Tensor<T>& grad_input) {
    auto grad_weight = projection(grads_, which);
    const auto weight = weight_rows(which);
    const Index width = weight.cols();
    const auto accumulate_bias = [&](const auto& grad_rows) {
      if (!config_.bias || grad_rows.rows() == 0) return;
      Eigen::Map<RowVector<T>>(grads_.in_proj_bias.data() + bias_offset(which),
                               projection_width(which)) += grad_rows.colwise().sum();
    };
    if (total_rows == rows) {  // no extra rows: one GEMM over every batch
      detail::threaded_product(grad_weight, grad_y.transpose(), input.matrix(),
                               detail::Accumulate::yes);
      accumulate_bias(grad_y);
      detail::threaded_product(grad_input.matrix(), grad_y, weight, detail::Accumulate::no);
      return;
    }
    Tensor<T>& grad_extra = which == 1 ? grads_.bias_k : grads_.bias_v;
    for (Index b = 0; b < batch; ++b) {
      const auto grad_rows = grad_y.middleRows(b * total_rows, rows);
      const Eigen::Map<const Matrix<T>> input_rows(input.data() + b * rows * width, rows, width);
      detail::threaded_product(grad_weight, grad_rows.transpose(), input_rows,
                               detail::Accumulate::yes);
      accumulate_bias(grad_rows);
      detail::threaded_product(
          Eigen::Map<Matrix<T>>(grad_input.data() + b * rows * width, rows, width), grad_rows,
          weight, detail::Accumulate::no);
      // The zero row is a constant: its gradient goes nowhere.
      if (config_.add_bias_kv && which > 0) {
        grad_extra.flat() += grad_y.row(b * total_rows + rows).transpose();
      }
    }
  }

  void ensure_gradients() {
    if (has_grads_) return;
    const auto values = named_tensors(params_);
    const auto grads = named_tensors(grads_);
    for (std::size_t i = 0; i < values.size(); ++i) {
      *const_cast<Tensor<T>*>(grads[i].second) = Tensor<T>(values[i].second->shape());
    }
    has_grads_ = true;
  }

  // The tensors of `set` (the parameters or their gradients) that this layer has, by name, in
  // PyTorch's order.
  std::vector<std::pair<std::string, const Tensor<T>*>> named_tensors(
      const ParameterSet& set) const {
    std::vector<std::pair<std::string, const Tensor<T>*>> named;
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
    if (config_.talking_heads_post) {
      named.emplace_back("talking_heads_post", &set.talking_heads_post);
    }
    return named;
  }
  std::vector<std::pair<std::string, const Tensor<T>*>> named_parameters() const {
    return named_tensors(params_);
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

  // W_q, W_k or W_v (which = 0, 1, 2) of `set` (the parameters or the gradients) as an
  // [E, width] matrix.
  template <class Set>
  auto projection(Set& set, int which) const {
    using Map = Eigen::Map<std::conditional_t<std::is_const_v<Set>, const Matrix<T>, Matrix<T>>>;
    const Index embed = config_.embed_dim;
    if (packed_projection()) {
      return Map(set.in_proj_weight.data() + bias_offset(which) * embed, projection_width(which),
                 embed);
    }
    auto& weight = which == 0   ? set.q_proj_weight
                   : which == 1 ? set.k_proj_weight
                                : set.v_proj_weight;
    return Map(weight.data(), weight.dim(0), weight.dim(1));
  }
  Eigen::Map<const Matrix<T>> weight_rows(int which) const { return projection(params_, which); }

  template <class Rows>
  void add_bias(Rows& rows, int which) const {
    if (!config_.bias) return;
    rows.rowwise() += Eigen::Map<const RowVector<T>>(
                          params_.in_proj_bias.data() + bias_offset(which), projection_width(which))
                          .template cast<Compute>();
  }

  // input [B*S, width] projected into [B*S', H_kv·D]: for each batch its S rows, then
  // bias_k/bias_v (add_bias_kv), then a zero row (add_zero_attn).
  void project_keys(const Eigen::Map<const Matrix<Compute>>& input, int which, Index batch,
                    Index key_len, Index total_keys, const Tensor<T>& extra_row,
                    Matrix<Compute>& projected, Workspace<T>& workspace) const {
    const Index width = input.cols();
    projected.resize(batch * total_keys, kv_dim());
    const auto weight = weight_rows(which);
    if (total_keys == key_len) {  // no extra rows: one GEMM over every batch
      detail::product_transposed(projected, input, weight, detail::Accumulate::no,
                                 workspace.kernel);
      add_bias(projected, which);
      return;
    }
    for (Index b = 0; b < batch; ++b) {
      auto rows = projected.middleRows(b * total_keys, key_len);
      detail::product_transposed(
          rows,
          Eigen::Map<const Matrix<Compute>>(input.data() + b * key_len * width, key_len, width),
          weight, detail::Accumulate::no, workspace.kernel);
      add_bias(rows, which);
      Index next = b * total_keys + key_len;
      if (config_.add_bias_kv) {
        projected.row(next++) = extra_row.flat().transpose().template cast<Compute>();
      }
      if (config_.add_zero_attn) projected.row(next).setZero();
    }
  }

  // attn_mask [L, S] shared, or [B*H, L, S] ([H, L, S] unbatched) indexed by b*H + h.
  detail::MaskLayout<Compute> attn_mask_layout(const Mask<Compute>& mask, bool batched, Index batch,
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
  detail::MaskLayout<Compute> key_padding_layout(const Mask<Compute>& mask, bool batched,
                                                 Index batch, Index key_len) const {
    if (mask.empty()) return {};
    const Shape expected = batched ? Shape{batch, key_len} : Shape{key_len};
    detail::check_shape("key_padding_mask", expected, mask.shape());
    return detail::make_mask_layout(mask, key_len, 0, 0, key_len);
  }

  // [B, H, L, S'] -> [B, L, S'], the mean over heads.
  void average_over_heads(const Tensor<Compute>& per_head, Tensor<Compute>& averaged) const {
    const Index batch = per_head.dim(0), heads = per_head.dim(1);
    const Index rows = per_head.dim(2), cols = per_head.dim(3);
    averaged.resize({batch, rows, cols});
    for (Index b = 0; b < batch; ++b) {
      auto sum = averaged[b].matrix();
      sum.setZero();
      for (Index h = 0; h < heads; ++h) sum += per_head[b][h].matrix();
      sum /= static_cast<Compute>(heads);
    }
  }

  MultiHeadAttentionConfig config_;
  ParameterSet params_;
  // Gradients with the parameters' shapes, allocated by the first forward_train, zero_grad or
  // parameters() call: a layer used only for inference never holds them.
  ParameterSet grads_;
  bool has_grads_ = false;
  Random dropout_random_{0};
};

}  // namespace mha
