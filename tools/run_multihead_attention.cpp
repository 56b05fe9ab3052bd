// mha_run's logic (see mha_run.hpp): the metadata read into ForwardOptions, the layer run forward
// (and backward), the results written. Compiled once into mha_run_logic.
#include "mha_run.hpp"

#include <cmath>
#include <cstdlib>
#include <limits>
#include <optional>
#include <set>
#include <string>
#include <type_traits>

#include "mha/mha.hpp"

namespace mha::tools {

const std::set<std::string>& detail::input_names() {
  static const std::set<std::string> names = {
      "query",       "key",          "value",     "key_padding_mask", "attn_mask",
      "grad_output", "alibi_slopes", "head_mask", "block_layout"};
  return names;
}

namespace {

bool flag(const io::SafetensorsFile& file, const std::string& key, bool default_value) {
  const auto it = file.metadata.find(key);
  if (it == file.metadata.end()) return default_value;
  if (it->second == "0") return false;
  if (it->second == "1") return true;
  throw ShapeError("metadata '" + key + "': expected \"0\" or \"1\", got \"" + it->second + "\"");
}

Kernel kernel(const io::SafetensorsFile& file) {
  const auto it = file.metadata.find("kernel");
  if (it == file.metadata.end() || it->second == "auto") return Kernel::automatic;
  if (it->second == "reference") return Kernel::reference;
  if (it->second == "flash") return Kernel::flash;
  throw ShapeError("metadata 'kernel': expected \"auto\", \"reference\" or \"flash\", got \"" +
                   it->second + "\"");
}

Precision precision(const io::SafetensorsFile& file) {
  const auto it = file.metadata.find("precision");
  if (it == file.metadata.end() || it->second == "fp32") return Precision::fp32;
  if (it->second == "bf16") return Precision::bf16;
  if (it->second == "int8") return Precision::int8;
  if (it->second == "fp16") return Precision::fp16;
  throw ShapeError(
      "metadata 'precision': expected \"fp32\", \"bf16\", \"int8\" or \"fp16\", got \"" +
      it->second + "\"");
}

// weights: as_given (default) or int8 (a FrozenMultiHeadAttention with FrozenWeights::int8).
FrozenWeights frozen_weights(const io::SafetensorsFile& file) {
  const auto it = file.metadata.find("weights");
  if (it == file.metadata.end() || it->second == "as_given") return FrozenWeights::as_given;
  if (it->second == "int8") return FrozenWeights::int8;
  throw ShapeError("metadata 'weights': expected \"as_given\" or \"int8\", got \"" + it->second +
                   "\"");
}

// A positive integer under `key`, or 0 when the key is absent and not required.
Index positive_integer(const io::SafetensorsFile& file, const std::string& key, bool required) {
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
Alignment causal_alignment(const io::SafetensorsFile& file) {
  const auto it = file.metadata.find("causal_alignment");
  if (it == file.metadata.end() || it->second == "top_left") return Alignment::top_left;
  if (it->second == "bottom_right") return Alignment::bottom_right;
  throw ShapeError(
      "metadata 'causal_alignment': expected \"top_left\" or \"bottom_right\", got \"" +
      it->second + "\"");
}

// One side of the window: an integer >= -1 (-1, the default, is unbounded).
Index window_side(const io::SafetensorsFile& file, const std::string& key) {
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
std::optional<Rope> rope(const io::SafetensorsFile& file) {
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

Index num_heads(const io::SafetensorsFile& file) {
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
SparsePattern sparse_pattern(const io::SafetensorsFile& file, Alignment alignment) {
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
    if (detail::input_names().count(entry.first) == 0) parameter_names.push_back(entry.first);
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
  options.precision = precision(in);
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
  const FrozenWeights weights = frozen_weights(in);
  if (in.tensors.count("grad_output") == 0) {
    if (weights == FrozenWeights::int8) {
      write_forward(
          FrozenMultiHeadAttention<T>(layer, weights).forward(query, key, value, options));
    } else {
      write_forward(layer.forward(query, key, value, options));
    }
    return out;
  }
  if (weights != FrozenWeights::as_given) {
    throw ShapeError(
        "metadata 'weights': int8 weights are for inference; a file with grad_output "
        "trains, so they are refused");
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

}  // namespace

io::SafetensorsFile run_multihead_attention(const io::SafetensorsFile& in) {
  const io::StoredTensor& query = in.at("query");
  if (query.dtype == io::Dtype::F32) return run_as<float>(in);
  if (query.dtype == io::Dtype::F64) return run_as<double>(in);
  throw ShapeError(std::string("query: expected dtype F32 or F64, got ") +
                   io::dtype_name(query.dtype));
}

}  // namespace mha::tools
