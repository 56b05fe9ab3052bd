// Training diagnostics for multi-head attention: what to monitor (attention entropy, redundancy
// between heads, gradient norms per head, heads that attend uniformly, NaN and Inf).
//
// Shapes (letters as in mha/tensor.hpp):
//   weights         per-head attention weights [B, H, L, S] or unbatched [H, L, S], as
//                   MultiHeadAttention::forward returns them with need_weights = true and
//                   average_attn_weights = false. The head-averaged [B, L, S] cannot be told apart
//                   from [H, L, S] by its shape and would be read as B heads: pass per-head
//                   weights.
//   head_entropy, head_entropy_normalised, head_gradient_norms   -> [H]
//   head_similarity                                               -> [H, H]
//   head_reports, uniform_heads                                   -> one entry per head / indices
//   all_finite, check_finite (finite.hpp)                         any tensor
//   head_gradient_norms and non_finite_parameters read a ParameterList (parameters.hpp).
//   HeadImportance accumulates the head gates' gradients (InputGradients::head_gate) -> [H].
//
// Rows whose weights are all 0 are rows where every key was masked: the library returns 0 there
// (PyTorch returns NaN). They carry no attention pattern, so entropy means leave them out.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "mha/compiled.hpp"
#include "mha/errors.hpp"
#include "mha/finite.hpp"
#include "mha/heads.hpp"
#include "mha/parameters.hpp"
#include "mha/tensor.hpp"

namespace mha {

// The normalised entropy from which a head counts as uniform. For softmax rows whose scores vary
// little, KL(p || uniform) ≈ Var(scores) / 2, so the normalised entropy is about
// 1 - Var(scores) / (2 log n): 0.99 means the scores of a row have a standard deviation below
// about 0.24 over 16 keys, 0.35 over 512. A head that has learnt anything is far below that;
// flat heads are the "weights all equal" failure, typical of saturated or zero-initialised
// q/k projections (or identical token embeddings).
inline constexpr double kUniformAttentionThreshold = 0.99;

template <class T>
struct HeadReport {
  Index head = 0;
  T entropy = 0;             // mean row entropy in nats, as head_entropy
  T normalised_entropy = 0;  // as head_entropy_normalised: 1 is uniform over the visible keys
  bool uniform = false;      // normalised_entropy >= the threshold
};

namespace detail {

struct HeadWeightsShape {
  Index batch, heads, rows, keys;
};

inline HeadWeightsShape check_head_weights(const Shape& shape) {
  if (shape.size() == 4) return {shape[0], shape[1], shape[2], shape[3]};
  if (shape.size() == 3) return {1, shape[0], shape[1], shape[2]};
  throw_shape("weights", "per-head attention weights [B, H, L, S] or [H, L, S]", shape);
}

// Per head, the means over (batch, query rows) of the row entropy and of the normalised row
// entropy, both over the rows with at least one nonzero weight.
template <class T>
void head_entropy_means(TensorView<const T> weights, Vector<T>& entropy, Vector<T>& normalised) {
  const HeadWeightsShape s = check_head_weights(weights.shape());
  using Column = Eigen::Array<T, Eigen::Dynamic, 1>;
  Column entropy_sum = Column::Zero(s.heads), normalised_sum = Column::Zero(s.heads);
  // Counts of Index, spelt through T so that the expressions on them stay dependent: Eigen's
  // classes for them are then instantiated only where the function is, not in every file that
  // includes this header.
  using Counts = Eigen::Array<std::conditional_t<std::is_void_v<T>, T, Index>, Eigen::Dynamic, 1>;
  Counts counted = Counts::Zero(s.heads);
  // Scratch for one [L, S] block, sized once.
  Column row_entropy(s.rows);
  Counts visible(s.rows);
  for (Index b = 0; b < s.batch; ++b) {
    for (Index h = 0; h < s.heads; ++h) {
      const Eigen::Map<const Matrix<T>> block(
          offset_pointer(weights.data(), (b * s.heads + h) * s.rows * s.keys), s.rows, s.keys);
      const auto p = block.array();
      // 0 log 0 = 0 by continuity. Testing p == 0 rather than p > 0 lets a NaN weight reach the
      // result instead of being skipped.
      row_entropy = -(p == T(0)).select(T(0), p * p.log()).rowwise().sum();
      visible = (p != T(0)).rowwise().count();
      // A fully masked row has entropy exactly 0, so only the row count needs the exclusion.
      entropy_sum[h] += row_entropy.sum();
      counted[h] += (visible > 0).count();
      // log n with n the visible keys makes 1 mean "uniform over what the row could see"; n = 1
      // (log n = 0) is a row that had no choice, perfectly focused.
      normalised_sum[h] +=
          (visible > 1).select(row_entropy / visible.template cast<T>().log(), T(0)).sum();
    }
  }
  // A head without a single visible row (L = 0, or every row masked) reports 0, not 0/0.
  const Column rows = counted.max(Index(1)).template cast<T>();
  entropy = (entropy_sum / rows).matrix();
  normalised = (normalised_sum / rows).matrix();
}

template <class T>
Tensor<T> to_head_tensor(const Vector<T>& values) {
  Tensor<T> out({values.size()});
  out.flat() = values;
  return out;
}

MHA_FUNCTION void check_threshold(double threshold);
#if MHA_FUNCTION_DEFINITIONS
MHA_FUNCTION void check_threshold(double threshold) {
  if (!(threshold > 0.0 && threshold <= 1.0)) {
    std::ostringstream value;
    value << threshold;
    throw_argument("threshold", "must be in (0, 1], got " + value.str());
  }
}
#endif

// The parameters of a MultiHeadAttention layer that are split by head, under their PyTorch names.
enum class HeadParameter {
  in_proj_weight,
  q_proj_weight,
  k_proj_weight,
  v_proj_weight,
  in_proj_bias,
  out_proj_weight,
  bias_k,
  bias_v,
  count
};

inline const char* head_parameter_name(HeadParameter kind) {
  static const char* const names[] = {"in_proj_weight", "q_proj_weight", "k_proj_weight",
                                      "v_proj_weight",  "in_proj_bias",  "out_proj.weight",
                                      "bias_k",         "bias_v"};
  return names[static_cast<int>(kind)];
}

inline HeadParameter head_parameter_kind(const std::string& name) {
  for (int k = 0; k < static_cast<int>(HeadParameter::count); ++k) {
    if (name == head_parameter_name(static_cast<HeadParameter>(k))) {
      return static_cast<HeadParameter>(k);
    }
  }
  return HeadParameter::count;
}

// The shape a parameter of this kind has in a layer of width E, written with letters, and the E
// its shape implies (-1 when its rank is wrong or [3E] is not a multiple of 3).
inline const char* head_parameter_layout(HeadParameter kind) {
  switch (kind) {
    case HeadParameter::in_proj_weight:
      return "[3E, E]";
    case HeadParameter::q_proj_weight:
    case HeadParameter::out_proj_weight:
      return "[E, E]";
    case HeadParameter::k_proj_weight:
      return "[E, kdim]";
    case HeadParameter::v_proj_weight:
      return "[E, vdim]";
    case HeadParameter::in_proj_bias:
      return "[3E]";
    default:
      return "[1, 1, E]";
  }
}

inline Index embed_dim_of(HeadParameter kind, const Shape& shape) {
  switch (kind) {
    case HeadParameter::in_proj_weight:
      return shape.size() == 2 ? shape[1] : -1;
    case HeadParameter::in_proj_bias:
      return shape.size() == 1 && shape[0] % 3 == 0 ? shape[0] / 3 : -1;
    case HeadParameter::bias_k:
    case HeadParameter::bias_v:
      return shape.size() == 3 ? shape[2] : -1;
    default:
      return shape.size() == 2 ? shape[0] : -1;
  }
}

inline Shape head_parameter_shape(HeadParameter kind, Index embed) {
  switch (kind) {
    case HeadParameter::in_proj_weight:
      return {3 * embed, embed};
    case HeadParameter::q_proj_weight:
    case HeadParameter::out_proj_weight:
      return {embed, embed};
    case HeadParameter::k_proj_weight:
    case HeadParameter::v_proj_weight:
      return {embed, kAnyDim};
    case HeadParameter::in_proj_bias:
      return {3 * embed};
    default:
      return {1, 1, embed};
  }
}

}  // namespace detail

// weights [B, H, L, S] or [H, L, S] -> [H]: per head, the mean over batches and query rows of
// the row entropy -sum_s p log p in nats (0 log 0 = 0). It lies in [0, log S']: 0 when every row
// puts all its weight on one key, log n for a row uniform over n keys. Fully masked rows (all
// weights 0) are left out of the mean; a head with no other row reports 0. A NaN weight makes
// its head's result NaN rather than being skipped.
template <class T>
Tensor<T> head_entropy(TensorView<const T> weights) {
  Vector<T> entropy, normalised;
  detail::head_entropy_means(weights, entropy, normalised);
  return detail::to_head_tensor(entropy);
}

// The same with each row's entropy divided by log n, n = the keys with nonzero weight in that
// row, so rows of different lengths (causal, padded) compare: 1 is uniform over the keys the row
// could see, 0 perfectly focused (rows with n = 1 count as 0). Fully masked rows (n = 0) are left
// out. A key whose weight underflowed to exactly 0 counts as masked; such rows are sharply peaked
// and near 0 either way.
template <class T>
Tensor<T> head_entropy_normalised(TensorView<const T> weights) {
  Vector<T> entropy, normalised;
  detail::head_entropy_means(weights, entropy, normalised);
  return detail::to_head_tensor(normalised);
}

// weights [B, H, L, S] or [H, L, S] -> [H, H]: the cosine similarity between heads' attention
// patterns, each head's weights flattened over (B, L, S). Weights are non-negative, so it lies in
// [0, 1]: near 1 off the diagonal flags heads that attend alike (redundant), 0 heads that never
// attend to the same (query, key) pairs. The diagonal is 1. A head whose weights are all 0 (every
// row masked) has no direction: its similarity with the other heads is 0.
template <class T>
Tensor<T> head_similarity(TensorView<const T> weights) {
  const detail::HeadWeightsShape s = detail::check_head_weights(weights.shape());
  const Index block = s.rows * s.keys;
  // Gram matrix of the flattened patterns: a head's weights are one [L*S] row per batch, so
  // sum over batches the [H, L*S] x [L*S, H] products. Only the lower triangle is computed and
  // read, which also makes the result exactly symmetric.
  Matrix<T> gram = Matrix<T>::Zero(s.heads, s.heads);
  for (Index b = 0; b < s.batch; ++b) {
    const Eigen::Map<const Matrix<T>> patterns(
        detail::offset_pointer(weights.data(), b * s.heads * block), s.heads, block);
    gram.template selfadjointView<Eigen::Lower>().rankUpdate(patterns);
  }
  const Vector<T> norms = gram.diagonal().cwiseSqrt();
  Tensor<T> out({s.heads, s.heads});
  auto similarity = out.matrix();
  for (Index h = 0; h < s.heads; ++h) {
    similarity(h, h) = T(1);
    for (Index g = 0; g < h; ++g) {
      // norm == 0 rather than !(norm > 0): a NaN norm must stay visible in the result.
      const bool empty = norms[h] == T(0) || norms[g] == T(0);
      similarity(h, g) = similarity(g, h) = empty ? T(0) : gram(h, g) / (norms[h] * norms[g]);
    }
  }
  return out;
}

// Each head's entropy, normalised entropy and whether it attends (nearly) uniformly:
// normalised entropy >= threshold, in (0, 1]; see kUniformAttentionThreshold.
template <class T>
std::vector<HeadReport<T>> head_reports(TensorView<const T> weights,
                                        double threshold = kUniformAttentionThreshold) {
  detail::check_threshold(threshold);
  Vector<T> entropy, normalised;
  detail::head_entropy_means(weights, entropy, normalised);
  std::vector<HeadReport<T>> reports(static_cast<std::size_t>(entropy.size()));
  for (Index h = 0; h < entropy.size(); ++h) {
    HeadReport<T>& report = reports[static_cast<std::size_t>(h)];
    report.head = h;
    report.entropy = entropy[h];
    report.normalised_entropy = normalised[h];
    report.uniform = static_cast<double>(normalised[h]) >= threshold;
  }
  return reports;
}

// The indices of the heads head_reports flags as uniform, in increasing order.
template <class T>
std::vector<Index> uniform_heads(TensorView<const T> weights,
                                 double threshold = kUniformAttentionThreshold) {
  std::vector<Index> heads;
  for (const auto& report : head_reports(weights, threshold)) {
    if (report.uniform) heads.push_back(report.head);
  }
  return heads;
}

// Head importance as "Are Sixteen Heads Really Better than One?" (Michel et al. 2019) scores it:
// run forward_train with a head_gate of ones (ForwardOptions::head_gate), backward, and add each
// batch's gate gradient: I_h = sum over batches of |d loss / d gate_h|, the first-order estimate
// of what removing head h would change in the loss. scores() divides by the scores' L2 norm, as
// the paper normalises each layer, so that layers compare; least_important picks heads to prune
// (MultiHeadAttention::prune_heads, or gates of 0).
class HeadImportance {
 public:
  explicit HeadImportance(Index num_heads);

  // gate_gradient: [H], InputGradients::head_gate of one backward.
  template <class T>
  void add(const Tensor<T>& gate_gradient) {
    detail::check_shape("gate_gradient", {num_heads()}, gate_gradient.shape());
    check_finite(gate_gradient.view(), "gate_gradient");
    for (Index h = 0; h < num_heads(); ++h) {
      sums_[static_cast<std::size_t>(h)] += std::abs(static_cast<double>(gate_gradient.data()[h]));
    }
    ++batches_;
  }

  Index num_heads() const { return static_cast<Index>(sums_.size()); }
  Index batches() const { return batches_; }
  // [H]: I_h, divided by the L2 norm of all H when normalise (all 0 stays 0).
  std::vector<double> scores(bool normalise = true) const;
  // The `count` heads of lowest importance, lowest first (ties by index).
  std::vector<Index> least_important(Index count) const;

 private:
  std::vector<double> sums_;
  Index batches_ = 0;
};

#if MHA_FUNCTION_DEFINITIONS
MHA_FUNCTION HeadImportance::HeadImportance(Index num_heads)
    : sums_(static_cast<std::size_t>(num_heads), 0.0) {
  if (num_heads < 1) {
    detail::throw_argument("num_heads", "expected at least 1, got " + std::to_string(num_heads));
  }
}

MHA_FUNCTION std::vector<double> HeadImportance::scores(bool normalise) const {
  std::vector<double> result = sums_;
  double norm = 0;
  for (const double s : result) norm += s * s;
  norm = std::sqrt(norm);
  if (normalise && norm > 0) {
    for (double& s : result) s /= norm;
  }
  return result;
}

MHA_FUNCTION std::vector<Index> HeadImportance::least_important(Index count) const {
  if (count < 0 || count > num_heads()) {
    detail::throw_argument(
        "count", "expected 0 .. " + std::to_string(num_heads()) + ", got " + std::to_string(count));
  }
  std::vector<Index> order(sums_.size());
  for (std::size_t h = 0; h < order.size(); ++h) order[h] = static_cast<Index>(h);
  std::stable_sort(order.begin(), order.end(), [&](Index a, Index b) {
    return sums_[static_cast<std::size_t>(a)] < sums_[static_cast<std::size_t>(b)];
  });
  order.resize(static_cast<std::size_t>(count));
  return order;
}
#endif

// parameters: one MultiHeadAttention layer's parameters (MultiHeadAttention::parameters(), or a
// model's list that contains them) -> [H]: the L2 norm of each head's share of the gradients.
// Head h owns rows h*D .. (h+1)*D of W_q, W_k and W_v (inside in_proj_weight, or the separate
// q/k/v_proj_weight), the same entries of each third of in_proj_bias and of bias_k, bias_v,
// and columns h*D .. (h+1)*D of out_proj.weight (the weights that read its output). out_proj.bias
// is shared by all heads and other names (embeddings, a readout) are not attention: both are
// ignored. Names must be exactly PyTorch's, one layer at a time.
template <class T>
Tensor<T> head_gradient_norms(const ParameterList<T>& parameters, Index num_heads) {
  using detail::HeadParameter;
  detail::check_parameter_list(parameters);
  constexpr int kinds = static_cast<int>(HeadParameter::count);
  const ParameterRef<T>* found[kinds] = {};
  const ParameterRef<T>* first = nullptr;
  for (const auto& parameter : parameters) {
    const HeadParameter kind = detail::head_parameter_kind(parameter.name);
    if (kind == HeadParameter::count) continue;
    const ParameterRef<T>*& slot = found[static_cast<int>(kind)];
    if (slot != nullptr) {
      detail::throw_argument("parameters",
                             "'" + parameter.name + "' appears twice: pass one layer's parameters");
    }
    slot = &parameter;
    if (first == nullptr) first = &parameter;
  }
  if (first == nullptr) {
    detail::throw_argument("parameters",
                           "no attention parameter among " + std::to_string(parameters.size()) +
                               " (expected in_proj_weight or q/k/v_proj_weight, in_proj_bias, "
                               "out_proj.weight, bias_k, bias_v)");
  }
  const bool packed = found[static_cast<int>(HeadParameter::in_proj_weight)] != nullptr;
  if (packed && (found[static_cast<int>(HeadParameter::q_proj_weight)] != nullptr ||
                 found[static_cast<int>(HeadParameter::k_proj_weight)] != nullptr ||
                 found[static_cast<int>(HeadParameter::v_proj_weight)] != nullptr)) {
    detail::throw_argument("parameters",
                           "both in_proj_weight and q/k/v_proj_weight: a layer has one or the "
                           "other; pass one layer's parameters");
  }

  // Every parameter must agree with the E the first one implies.
  const HeadParameter first_kind = detail::head_parameter_kind(first->name);
  const Index embed = detail::embed_dim_of(first_kind, first->value.shape());
  if (embed < 0) {
    detail::throw_shape(first->name, detail::head_parameter_layout(first_kind),
                        first->value.shape());
  }
  const Index head_dim = detail::checked_head_dim(embed, num_heads, "num_heads");
  for (int k = 0; k < kinds; ++k) {
    if (found[k] == nullptr) continue;
    const Shape expected = detail::head_parameter_shape(static_cast<HeadParameter>(k), embed);
    if (!detail::shape_matches(expected, found[k]->value.shape())) {
      detail::throw_shape(
          found[k]->name,
          std::string(detail::head_parameter_layout(static_cast<HeadParameter>(k))) + " = " +
              detail::format_shape(expected) + " (E = " + std::to_string(embed) + " from " +
              first->name + ")",
          found[k]->value.shape());
    }
  }

  Vector<T> squares = Vector<T>::Zero(num_heads);
  for (int k = 0; k < kinds; ++k) {
    if (found[k] == nullptr) continue;
    const TensorView<const T> grad = found[k]->grad;
    const auto kind = static_cast<HeadParameter>(k);
    if (kind == HeadParameter::in_proj_bias || kind == HeadParameter::bias_k ||
        kind == HeadParameter::bias_v) {
      const Eigen::Map<const Vector<T>> g(grad.data(), grad.size());
      const Index thirds = kind == HeadParameter::in_proj_bias ? 3 : 1;
      for (Index which = 0; which < thirds; ++which) {
        for (Index h = 0; h < num_heads; ++h) {
          squares[h] += g.segment(which * embed + h * head_dim, head_dim).squaredNorm();
        }
      }
    } else if (kind == HeadParameter::out_proj_weight) {
      const auto g = grad.matrix();
      for (Index h = 0; h < num_heads; ++h) {
        squares[h] += g.middleCols(h * head_dim, head_dim).squaredNorm();
      }
    } else {
      const auto g = grad.matrix();
      const Index thirds = kind == HeadParameter::in_proj_weight ? 3 : 1;
      for (Index which = 0; which < thirds; ++which) {
        for (Index h = 0; h < num_heads; ++h) {
          squares[h] += g.middleRows(which * embed + h * head_dim, head_dim).squaredNorm();
        }
      }
    }
  }
  return detail::to_head_tensor<T>(squares.cwiseSqrt());
}

// The parameters whose value or gradient holds a NaN or Inf, in list order: "name" for the
// value, "name.grad" for the gradient.
template <class T>
std::vector<std::string> non_finite_parameters(const ParameterList<T>& parameters) {
  detail::check_parameter_list(parameters);
  std::vector<std::string> names;
  for (const auto& parameter : parameters) {
    if (!all_finite(TensorView<const T>(parameter.value))) names.push_back(parameter.name);
    if (!all_finite(TensorView<const T>(parameter.grad))) names.push_back(parameter.name + ".grad");
  }
  return names;
}

// Overloads for owning tensors and mutable views: T is not deduced through their conversion to
// TensorView<const T>. (For a TensorView<const T> argument the overloads above are the more
// specialised and win.)
template <class T>
Tensor<T> head_entropy(TensorView<T> weights) {
  return head_entropy(TensorView<const T>(weights));
}
template <class T>
Tensor<T> head_entropy(const Tensor<T>& weights) {
  return head_entropy(weights.view());
}
template <class T>
Tensor<T> head_entropy_normalised(TensorView<T> weights) {
  return head_entropy_normalised(TensorView<const T>(weights));
}
template <class T>
Tensor<T> head_entropy_normalised(const Tensor<T>& weights) {
  return head_entropy_normalised(weights.view());
}
template <class T>
Tensor<T> head_similarity(TensorView<T> weights) {
  return head_similarity(TensorView<const T>(weights));
}
template <class T>
Tensor<T> head_similarity(const Tensor<T>& weights) {
  return head_similarity(weights.view());
}
template <class T>
std::vector<HeadReport<T>> head_reports(TensorView<T> weights,
                                        double threshold = kUniformAttentionThreshold) {
  return head_reports(TensorView<const T>(weights), threshold);
}
template <class T>
std::vector<HeadReport<T>> head_reports(const Tensor<T>& weights,
                                        double threshold = kUniformAttentionThreshold) {
  return head_reports(weights.view(), threshold);
}
template <class T>
std::vector<Index> uniform_heads(TensorView<T> weights,
                                 double threshold = kUniformAttentionThreshold) {
  return uniform_heads(TensorView<const T>(weights), threshold);
}
template <class T>
std::vector<Index> uniform_heads(const Tensor<T>& weights,
                                 double threshold = kUniformAttentionThreshold) {
  return uniform_heads(weights.view(), threshold);
}

}  // namespace mha
