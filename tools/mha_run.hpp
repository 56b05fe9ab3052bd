// What mha_run does, as a function: one safetensors file in (a PyTorch nn.MultiheadAttention's
// state_dict, its inputs, masks and options, optionally an upstream gradient), one out (its
// output and attention weights, and then the gradients).
// Kept apart from main() so the tests run the same code in-process on every fixture.
#pragma once

#include <cmath>
#include <cstdlib>
#include <limits>
#include <optional>
#include <set>
#include <string>
#include <type_traits>

#include "mha/io/safetensors.hpp"
#include "mha/mha.hpp"

namespace mha::tools {

inline const char* const kMhaRunHelp = R"(usage: mha_run IN.safetensors OUT.safetensors

Runs torch.nn.MultiheadAttention(batch_first=True) forward (and, given grad_output, backward) in
C++ with the mha library, so that an attention layer exported from PyTorch can be checked to give
the same numbers.

IN holds:
  parameters under their state_dict names: in_proj_weight [3E, E] (or q_proj_weight [E, E],
    k_proj_weight [E, kdim], v_proj_weight [E, vdim]), in_proj_bias [3E], out_proj.weight [E, E],
    out_proj.bias [E], bias_k and bias_v [1, 1, E]. Which are present decides bias, add_bias_kv,
    kdim and vdim.
  grouped-query attention (H_kv key/value heads, a divisor of H; 1 = multi-query; query head h
    reads key/value head h / (H / H_kv)): always q_proj_weight [E, E], k_proj_weight
    [H_kv*D, kdim], v_proj_weight [H_kv*D, vdim] (D = E / H), in_proj_bias [E + 2*H_kv*D] (q, k,
    then v entries), bias_k and bias_v [1, 1, H_kv*D]. H_kv is the rows of k_proj_weight / D.
  talking heads (Shazeer et al. 2020; no PyTorch module has them): talking_heads_pre [H, H], which
    mixes the heads' logits before the masks and the softmax (head g's logits become
    sum_h pre[g, h] * logits_h), and/or talking_heads_post [H, H], which mixes their weights after
    it; each present one is used (and gets a grad.* with grad_output). They need the reference
    kernel: kernel auto picks it, flash is refused.
  a layer whose heads were pruned (MultiHeadAttention::prune_heads): H*D != E, the heads' rows
    of the projections and the columns of out_proj.weight [E, H*D] shrink; D is read from
    out_proj.weight's columns / num_heads.
  query [B, L, E], key [B, S, kdim], value [B, S, vdim]  (or unbatched [L, E], [S, kdim], [S, vdim])
  key_padding_mask [B, S] ([S] unbatched), optional
  attn_mask [L, S] or [B*H, L, S] ([H, L, S] unbatched), optional
    masks are BOOL with true = blocked (PyTorch MHA's convention), or float, added to the scores.
  grad_output, the shape of output ([B, L, E] or [L, E]), optional: the upstream gradient.
  __metadata__: num_heads (required); num_kv_heads (optional, a positive integer: when present it
    must be the H_kv that k_proj_weight gives, num_heads with in_proj_weight); and each "0" or
    "1": add_zero_attn (default 0),
    need_weights (default 1), average_attn_weights (default 1), is_causal (default 0: when 1, the
    top-left causal mask, key j > query i blocked, is applied on top of any attn_mask);
    kernel: auto (default: flash without weights, reference with), reference or flash
    (flash cannot return weights, so it needs need_weights "0").
  Modern attention options in __metadata__, each optional; c below is the position key j is
  compared with: c = i (query i) with causal_alignment top_left, c = i + S - L with bottom_right.
  They apply to the S input keys only: the bias_k and zero-attention columns are never blocked by
  is_causal or the window and get no ALiBi bias.
    causal_alignment: top_left (default; is_causal blocks key j > i, as PyTorch SDPA) or
      bottom_right (blocks j > i + S - L, as FlashAttention >= 2.1 and a KV-cache step). It also
      aligns the window, the sparse pattern and ALiBi.
    window_left, window_right: integers >= -1 (default -1 = unbounded on that side): local
      attention with FlashAttention's inclusive convention, query i sees key j only where
      c - window_left <= j <= c + window_right (window_left w - 1 with window_right 0 is a causal
      sliding window of w keys). Combines with is_causal and the masks: a key is visible only
      where all of them allow it.
    window_dilation: a positive integer d (default 1): a dilated window, where only keys at a
      distance |c - j| that is a multiple of d are visible, within window_left and window_right.
    global_tokens: comma-separated positions in increasing order, e.g. "0,1,64" (default none):
      global tokens (Longformer, BigBird), which see every key and which every query sees, over
      the window and the block layout; is_causal and the masks still apply to them. The query at
      c is global when c is listed, key j when j is.
    block_size: a positive integer b, with the block_layout tensor (and only with it).
    block_layout [R, C] or [H, R, C] (tensor, BOOL, true = computed), optional: block-sparse
      attention; the query at c sees key j only where block_layout[(h,) c / b, j / b] is true
      (and the window allows). R * b must exceed the last query's c and C * b be at least S.
    alibi: "0" (default) or "1": ALiBi with the paper's slopes for H heads (2^(-8 (h + 1) / H)
      for H a power of two, else BLOOM's rule), adding -slope_h * |c - j| to head h's scores.
    alibi_slopes [H] (tensor, query's dtype), optional: ALiBi with these slopes instead. With it
      the alibi key must be absent: "1" (the paper's slopes) or "0" (none) would contradict it.
    softcap: a finite number >= 0 (default 0 = none), e.g. "50": logit soft-capping (Gemma 2),
      each scaled score s = q k / sqrt(D) becomes softcap * tanh(s / softcap) before the masks,
      is_causal, the window and ALiBi apply, on every column including bias_k and zero attention.
    rope_base: a finite number > 0, e.g. "10000": rotary position embeddings of the projected
      queries and keys (after the in-projection biases; bias_k and the zero key are not rotated),
      input key j at position j and query i at c. Absent (the default) means none.
    rope_interleaved: "0" (default: rotate-half pairs (k, k + R/2), as Hugging Face's Llama and
      GPT-NeoX) or "1" (pairs (2k, 2k + 1), as GPT-J and Meta's Llama). Needs rope_base.
    rope_dim: an even positive integer R <= D (default D): only the first R features of each head
      rotate (partial rotary, GPT-NeoX's rotary_pct). Needs rope_base.
  head_mask [H] (tensor, query's dtype), optional: per-head gates, as Hugging Face's head_mask:
    head h's weights, so its output, are multiplied by head_mask[h] (0 removes the head); the
    weights written are the gated ones. With grad_output, OUT also holds grad.head_mask, the
    gradient from which head importance is scored (Michel et al. 2019).
The dtype of query decides the arithmetic: F32 computes in float, F64 in double. key, value and
float masks and grad_output must have that dtype too; parameters may be F32, F64, F16 or BF16
(converted).

OUT holds output (the rank of query) and, when need_weights is 1, attn_weights: [B, L, S'] averaged
over heads or [B, H, L, S'] per head (no B axis when unbatched), S' = S + add_bias_kv + add_zero_attn.
Where every key of a query row is blocked in a head, its weights and output are 0 (PyTorch: NaN).
With grad_output, OUT also holds the gradients of loss = sum(output * grad_output), as PyTorch's
autograd gives them with dropout 0: grad.query, grad.key and grad.value (the shapes of query, key
and value; reported apart even when the three hold the same values, their sum is then the gradient
of the shared tensor), and grad.<name> for every parameter in IN (in_proj_weight, in_proj_bias,
out_proj.weight, ...), in the parameter's shape and in query's dtype. Masks get no gradient.

Exit status 0 on success; 1 with one line on stderr for any bad input or file.
)";

namespace detail {

inline const std::set<std::string>& input_names() {
  static const std::set<std::string> names = {
      "query",       "key",          "value",     "key_padding_mask", "attn_mask",
      "grad_output", "alibi_slopes", "head_mask", "block_layout"};
  return names;
}

inline bool flag(const io::SafetensorsFile& file, const std::string& key, bool default_value) {
  const auto it = file.metadata.find(key);
  if (it == file.metadata.end()) return default_value;
  if (it->second == "0") return false;
  if (it->second == "1") return true;
  throw ShapeError("metadata '" + key + "': expected \"0\" or \"1\", got \"" + it->second + "\"");
}

inline Kernel kernel(const io::SafetensorsFile& file) {
  const auto it = file.metadata.find("kernel");
  if (it == file.metadata.end() || it->second == "auto") return Kernel::automatic;
  if (it->second == "reference") return Kernel::reference;
  if (it->second == "flash") return Kernel::flash;
  throw ShapeError("metadata 'kernel': expected \"auto\", \"reference\" or \"flash\", got \"" +
                   it->second + "\"");
}

// A positive integer under `key`, or 0 when the key is absent and not required.
inline Index positive_integer(const io::SafetensorsFile& file, const std::string& key,
                              bool required) {
  const auto it = file.metadata.find(key);
  if (it == file.metadata.end()) {
    if (required) throw ShapeError("metadata '" + key + "': missing (required)");
    return 0;
  }
  const std::string& text = it->second;
  const bool digits = !text.empty() && text.size() <= 9 &&
                      text.find_first_not_of("0123456789") == std::string::npos;
  const long value = digits ? std::stol(text) : 0;  // at most 9 digits: no overflow
  if (value == 0) {
    throw ShapeError("metadata '" + key + "': expected a positive integer, got \"" + text + "\"");
  }
  return static_cast<Index>(value);
}

// causal_alignment: top_left (default) or bottom_right.
inline Alignment causal_alignment(const io::SafetensorsFile& file) {
  const auto it = file.metadata.find("causal_alignment");
  if (it == file.metadata.end() || it->second == "top_left") return Alignment::top_left;
  if (it->second == "bottom_right") return Alignment::bottom_right;
  throw ShapeError(
      "metadata 'causal_alignment': expected \"top_left\" or \"bottom_right\", got \"" +
      it->second + "\"");
}

// One side of the window: an integer >= -1 (-1, the default, is unbounded).
inline Index window_side(const io::SafetensorsFile& file, const std::string& key) {
  const auto it = file.metadata.find(key);
  if (it == file.metadata.end()) return -1;
  const std::string& text = it->second;
  if (text == "-1") return -1;
  const bool digits = !text.empty() && text.size() <= 9 &&
                      text.find_first_not_of("0123456789") == std::string::npos;
  if (!digits) {
    throw ShapeError("metadata '" + key + "': expected an integer >= -1 (-1 = unbounded), got \"" +
                     text + "\"");
  }
  return static_cast<Index>(std::stol(text));  // at most 9 digits: no overflow
}

// A decimal number under `key`, finite in T, at least `minimum` (above it unless inclusive).
template <class T>
T decimal_number(const std::string& key, const std::string& text, double minimum, bool inclusive,
                 const std::string& expected) {
  // Decimal notation only: strtod would also take "inf", "nan", hex and leading blanks.
  const bool decimal = !text.empty() && text.size() <= 64 &&
                       text.find_first_not_of("0123456789.eE+-") == std::string::npos;
  char* end = nullptr;
  const double value = decimal ? std::strtod(text.c_str(), &end) : minimum - 1.0;
  // Compared before the cast: a double beyond float's range (1e300) would not convert.
  if (!decimal || end != text.c_str() + text.size() ||
      !(inclusive ? value >= minimum : value > minimum) ||
      value > static_cast<double>(std::numeric_limits<T>::max())) {
    throw ShapeError("metadata '" + key + "': expected " + expected + ", got \"" + text + "\"");
  }
  return static_cast<T>(value);
}

// softcap: a decimal number >= 0, finite in T, "0" (the default) for none.
template <class T>
T softcap(const io::SafetensorsFile& file) {
  const auto it = file.metadata.find("softcap");
  if (it == file.metadata.end()) return T(0);
  return decimal_number<T>("softcap", it->second, 0.0, true, "a finite number >= 0 (0 = none)");
}

// Rotary embeddings: rope_base switches them on; rope_interleaved and rope_dim need it.
inline std::optional<Rope> rope(const io::SafetensorsFile& file) {
  const auto base = file.metadata.find("rope_base");
  if (base == file.metadata.end()) {
    for (const char* key : {"rope_interleaved", "rope_dim"}) {
      if (file.metadata.count(key) != 0) {
        throw ShapeError(std::string("metadata '") + key +
                         "': expected absent without rope_base (which switches rotary "
                         "embeddings on), got \"" +
                         file.metadata.at(key) + "\"");
      }
    }
    return std::nullopt;
  }
  Rope rope;
  rope.base = decimal_number<double>("rope_base", base->second, 0.0, false, "a finite number > 0");
  rope.layout =
      flag(file, "rope_interleaved", false) ? RopeLayout::interleaved : RopeLayout::rotate_half;
  rope.rotary_dim = positive_integer(file, "rope_dim", false);
  return rope;
}

inline Index num_heads(const io::SafetensorsFile& file) {
  return positive_integer(file, "num_heads", true);
}

// num_kv_heads is redundant with k_proj_weight's rows (H_kv·D) and only checked: a mismatch means
// the file was written for another layer than its parameters describe.
template <class T>
void check_num_kv_heads(const io::SafetensorsFile& file, const MultiHeadAttention<T>& layer) {
  const Index declared = positive_integer(file, "num_kv_heads", false);
  if (declared == 0 || declared == layer.num_kv_heads()) return;
  const std::string source =
      layer.packed_projection()
          ? "num_heads, as in_proj_weight is packed"
          : "k_proj_weight " + mha::detail::format_shape(layer.parameter("k_proj_weight").shape()) +
                " with D = " + std::to_string(layer.head_dim());
  throw ShapeError("metadata 'num_kv_heads': expected " + std::to_string(layer.num_kv_heads()) +
                   " (" + source + "), got " + std::to_string(declared));
}

// Inputs and float masks must have query's dtype: a mismatch is more likely an export mistake
// than an intent. (Parameters are converted: F16/BF16 checkpoints are common.)
template <class T>
Tensor<T> read_input(const io::SafetensorsFile& file, const std::string& name) {
  const io::StoredTensor& stored = file.at(name);
  const io::Dtype dtype = std::is_same_v<T, float> ? io::Dtype::F32 : io::Dtype::F64;
  if (stored.dtype != dtype) {
    throw ShapeError(name + ": expected dtype " + io::dtype_name(dtype) + " (that of query), got " +
                     io::dtype_name(stored.dtype));
  }
  return io::to_tensor<T>(stored, name);
}

template <class T>
Mask<T> read_mask(const io::SafetensorsFile& file, const std::string& name) {
  const auto it = file.tensors.find(name);
  if (it == file.tensors.end()) return Mask<T>();
  if (it->second.dtype == io::Dtype::BOOL) {
    return Mask<T>::blocked_where_true(io::to_bool_tensor(it->second, name));
  }
  return Mask<T>::additive(read_input<T>(file, name));
}

// ALiBi slopes: the alibi_slopes tensor [H], or the paper's with metadata alibi "1", or none.
template <class T>
std::vector<T> alibi(const io::SafetensorsFile& file, Index heads) {
  const auto key = file.metadata.find("alibi");
  if (file.tensors.count("alibi_slopes") == 0) {
    return flag(file, "alibi", false) ? alibi_slopes<T>(heads) : std::vector<T>();
  }
  if (key != file.metadata.end()) {
    throw ShapeError(
        "metadata 'alibi': expected absent with an alibi_slopes tensor (which gives the slopes), "
        "got \"" +
        key->second + "\"");
  }
  const Tensor<T> slopes = read_input<T>(file, "alibi_slopes");
  if (slopes.shape() != Shape{heads}) {
    mha::detail::throw_shape("alibi_slopes", "[" + std::to_string(heads) + "] (one per head)",
                             slopes.shape());
  }
  return std::vector<T>(slopes.data(), slopes.data() + slopes.size());
}

// Global tokens and a block layout; the library checks their order and coverage.
inline SparsePattern sparse_pattern(const io::SafetensorsFile& file, Alignment alignment) {
  SparsePattern pattern;
  pattern.alignment = alignment;
  const auto global = file.metadata.find("global_tokens");
  if (global != file.metadata.end()) {
    const std::string& text = global->second;
    std::size_t begin = 0;
    while (begin <= text.size()) {
      const std::size_t end = std::min(text.find(',', begin), text.size());
      const std::string item = text.substr(begin, end - begin);
      if (item.empty() || item.size() > 9 ||
          item.find_first_not_of("0123456789") != std::string::npos) {
        throw ShapeError(
            "metadata 'global_tokens': expected comma-separated positions >= 0, e.g. \"0,1,64\", "
            "got \"" +
            text + "\"");
      }
      pattern.global_tokens.push_back(static_cast<Index>(std::stol(item)));  // <= 9 digits
      begin = end + 1;
    }
  }
  const bool has_layout = file.tensors.count("block_layout") != 0;
  if (has_layout != (file.metadata.count("block_size") != 0)) {
    throw ShapeError(has_layout ? "metadata 'block_size': missing (required with block_layout)"
                                : "metadata 'block_size': expected absent without a block_layout "
                                  "tensor, got \"" +
                                      file.metadata.at("block_size") + "\"");
  }
  if (has_layout) {
    pattern.block_size = positive_integer(file, "block_size", true);
    pattern.block_layout = io::to_bool_tensor(file.at("block_layout"), "block_layout");
  }
  return pattern;
}

// head_mask [H]: per-head gates, or none.
template <class T>
std::vector<T> head_mask(const io::SafetensorsFile& file, Index heads) {
  if (file.tensors.count("head_mask") == 0) return {};
  const Tensor<T> gates = read_input<T>(file, "head_mask");
  if (gates.shape() != Shape{heads}) {
    mha::detail::throw_shape("head_mask", "[" + std::to_string(heads) + "] (one gate per head)",
                             gates.shape());
  }
  for (Index h = 0; h < heads; ++h) {
    if (!std::isfinite(gates.data()[h])) {
      throw ShapeError("head_mask: gate " + std::to_string(h) + " is not finite");
    }
  }
  return std::vector<T>(gates.data(), gates.data() + gates.size());
}

template <class T>
io::SafetensorsFile run_as(const io::SafetensorsFile& in) {
  std::vector<std::string> parameter_names;
  for (const auto& entry : in.tensors) {
    if (input_names().count(entry.first) == 0) parameter_names.push_back(entry.first);
  }
  const auto state = io::read_state_dict<T>(in, parameter_names);
  auto layer = MultiHeadAttention<T>::from_state_dict(state, num_heads(in),
                                                      flag(in, "add_zero_attn", false));
  check_num_kv_heads(in, layer);
  ForwardOptions<T> options;
  options.need_weights = flag(in, "need_weights", true);
  options.average_attn_weights = flag(in, "average_attn_weights", true);
  options.is_causal = flag(in, "is_causal", false);
  options.causal_alignment = causal_alignment(in);
  options.window.left = window_side(in, "window_left");
  options.window.right = window_side(in, "window_right");
  options.window.alignment = options.causal_alignment;
  const Index dilation = positive_integer(in, "window_dilation", false);
  options.window.dilation = dilation == 0 ? 1 : dilation;
  options.pattern = sparse_pattern(in, options.causal_alignment);
  options.alibi_slopes = alibi<T>(in, layer.num_heads());
  options.softcap = softcap<T>(in);
  options.rope = rope(in);
  options.head_gate = head_mask<T>(in, layer.num_heads());
  options.kernel = kernel(in);
  options.key_padding_mask = read_mask<T>(in, "key_padding_mask");
  options.attn_mask = read_mask<T>(in, "attn_mask");
  const Tensor<T> query = read_input<T>(in, "query");
  const Tensor<T> key = read_input<T>(in, "key");
  const Tensor<T> value = read_input<T>(in, "value");
  io::SafetensorsFile out;
  const auto write_forward = [&](const ForwardResult<T>& result) {
    out.tensors["output"] = io::from_tensor(result.output);
    if (options.need_weights) out.tensors["attn_weights"] = io::from_tensor(result.attn_weights);
  };
  if (in.tensors.count("grad_output") == 0) {
    write_forward(layer.forward(query, key, value, options));
    return out;
  }

  const Tensor<T> grad_output = read_input<T>(in, "grad_output");
  SavedForward<T> saved;
  const auto result = layer.forward_train(query, key, value, options, saved);
  // Checked here, after the forward has checked everything else, so that a wrong query is
  // reported as such rather than as a grad_output of the wrong shape.
  if (grad_output.shape() != result.output.shape()) {
    mha::detail::throw_shape(
        "grad_output", mha::detail::format_shape(result.output.shape()) + " (the shape of output)",
        grad_output.shape());
  }
  write_forward(result);
  const InputGradients<T> grads = layer.backward(saved, grad_output);
  out.tensors["grad.query"] = io::from_tensor(grads.query);
  out.tensors["grad.key"] = io::from_tensor(grads.key);
  out.tensors["grad.value"] = io::from_tensor(grads.value);
  if (!options.head_gate.empty()) out.tensors["grad.head_mask"] = io::from_tensor(grads.head_gate);
  for (const std::string& name : layer.parameter_names()) {
    out.tensors["grad." + name] = io::from_tensor(layer.gradient(name));
  }
  return out;
}

}  // namespace detail

// Throws mha::ShapeError or mha::io::FileError for bad input.
inline io::SafetensorsFile run_multihead_attention(const io::SafetensorsFile& in) {
  const io::StoredTensor& query = in.at("query");
  if (query.dtype == io::Dtype::F32) return detail::run_as<float>(in);
  if (query.dtype == io::Dtype::F64) return detail::run_as<double>(in);
  throw ShapeError(std::string("query: expected dtype F32 or F64, got ") +
                   io::dtype_name(query.dtype));
}

}  // namespace mha::tools
