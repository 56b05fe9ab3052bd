// Agreement with real PyTorch: every fixture written by tests/reference/generate.py (torch's own
// nn.MultiheadAttention outputs, and for the grad_* and gqa_grad_* fixtures torch autograd's
// gradients; for grouped-query attention, gqa_*, and for windows, causal alignment, ALiBi and
// softcap, window_* / alibi_* / softcap_*, torch written out) is run through the library and
// compared.
// To regenerate the fixtures: /usr/bin/python3 tests/reference/generate.py (see its README).
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "../tools/mha_run.hpp"
#include "helpers.hpp"

namespace fs = std::filesystem;

namespace {

std::vector<std::string> fixture_names() {
  std::vector<std::string> names;
  const std::string suffix = ".in.safetensors";
  for (const auto& entry : fs::directory_iterator(MHA_REFERENCE_DIR)) {
    const std::string file = entry.path().filename().string();
    if (file.size() > suffix.size() &&
        file.compare(file.size() - suffix.size(), suffix.size(), suffix) == 0) {
      names.push_back(file.substr(0, file.size() - suffix.size()));
    }
  }
  std::sort(names.begin(), names.end());
  return names;
}

mha::io::SafetensorsFile read_fixture(const std::string& name, const std::string& kind);

// The fixtures with torch's gradients: grad_* and gqa_grad_*, those whose IN has a grad_output.
std::vector<std::string> gradient_fixture_names() {
  std::vector<std::string> names;
  for (const auto& name : fixture_names()) {
    if (read_fixture(name, "in").tensors.count("grad_output") == 1) names.push_back(name);
  }
  return names;
}

template <class T>
void compare_tensor(const mha::io::StoredTensor& actual, const mha::io::StoredTensor& expected,
                    const std::string& name) {
  const auto a = mha::io::to_tensor<T>(actual, name);
  const auto e = mha::io::to_tensor<T>(expected, name);
  CHECK_TENSORS_CLOSE(a, e);
}

mha::io::SafetensorsFile read_fixture(const std::string& name, const std::string& kind) {
  return mha::io::read_safetensors(std::string(MHA_REFERENCE_DIR) + "/" + name + "." + kind +
                                   ".safetensors");
}

bool is_gradient(const std::string& tensor_name) {
  return tensor_name.rfind("grad.", 0) == 0;
}

// The forward half of a fixture: without grad_output in, without the gradients expected.
mha::io::SafetensorsFile forward_only(mha::io::SafetensorsFile file) {
  file.tensors.erase("grad_output");
  for (auto it = file.tensors.begin(); it != file.tensors.end();) {
    it = is_gradient(it->first) ? file.tensors.erase(it) : std::next(it);
  }
  return file;
}

// What one forward_train + backward of the library gives: output and the grad.* tensors.
template <class T>
using Named = std::map<std::string, mha::Tensor<T>>;

bool metadata_flag(const mha::io::SafetensorsFile& in, const std::string& key, bool fallback) {
  const auto it = in.metadata.find(key);
  return it == in.metadata.end() ? fallback : it->second == "1";
}

std::string metadata_text(const mha::io::SafetensorsFile& in, const std::string& key,
                          const std::string& fallback) {
  const auto it = in.metadata.find(key);
  return it == in.metadata.end() ? fallback : it->second;
}

template <class T>
mha::Mask<T> fixture_mask(const mha::io::SafetensorsFile& in, const std::string& name) {
  const auto it = in.tensors.find(name);
  if (it == in.tensors.end()) return mha::Mask<T>();
  if (it->second.dtype == mha::io::Dtype::BOOL) {
    return mha::Mask<T>::blocked_where_true(mha::io::to_bool_tensor(it->second, name));
  }
  return mha::Mask<T>::additive(mha::io::to_tensor<T>(it->second, name));
}

// Runs the fixture `in` through the library directly (not through mha_run), in T whatever the
// file's dtype. With `shared`, query (whose values key and value then repeat) is passed as all
// three arguments, as self-attention is called. Also checks that a second backward adds the
// same parameter gradients again and that zero_grad clears them.
template <class T>
Named<T> library_gradients(const mha::io::SafetensorsFile& in, bool shared) {
  const std::set<std::string> inputs = {
      "query",       "key",          "value",     "key_padding_mask", "attn_mask",
      "grad_output", "alibi_slopes", "head_mask", "block_layout"};
  std::map<std::string, mha::Tensor<T>> state;
  for (const auto& entry : in.tensors) {
    if (inputs.count(entry.first) == 0) {
      state.emplace(entry.first, mha::io::to_tensor<T>(entry.second, entry.first));
    }
  }
  auto layer = mha::MultiHeadAttention<T>::from_state_dict(
      state, std::stol(in.metadata.at("num_heads")), metadata_flag(in, "add_zero_attn", false));
  mha::ForwardOptions<T> options;
  options.need_weights = metadata_flag(in, "need_weights", true);
  options.average_attn_weights = metadata_flag(in, "average_attn_weights", true);
  options.is_causal = metadata_flag(in, "is_causal", false);
  const auto kernel = in.metadata.find("kernel");
  if (kernel != in.metadata.end() && kernel->second == "reference") {
    options.kernel = mha::Kernel::reference;
  } else if (kernel != in.metadata.end() && kernel->second == "flash") {
    options.kernel = mha::Kernel::flash;
  }
  options.key_padding_mask = fixture_mask<T>(in, "key_padding_mask");
  options.attn_mask = fixture_mask<T>(in, "attn_mask");
  // The modern options (window_*, alibi_*, softcap_* fixtures), read here independently of mha_run.
  if (metadata_text(in, "causal_alignment", "top_left") == "bottom_right") {
    options.causal_alignment = mha::Alignment::bottom_right;
  }
  options.window.left = std::stol(metadata_text(in, "window_left", "-1"));
  options.window.right = std::stol(metadata_text(in, "window_right", "-1"));
  options.window.alignment = options.causal_alignment;
  options.window.dilation = std::stol(metadata_text(in, "window_dilation", "1"));
  options.pattern.alignment = options.causal_alignment;
  std::istringstream global_tokens(metadata_text(in, "global_tokens", ""));
  for (std::string position; std::getline(global_tokens, position, ',');) {
    options.pattern.global_tokens.push_back(std::stol(position));
  }
  if (in.tensors.count("block_layout") == 1) {
    options.pattern.block_size = std::stol(in.metadata.at("block_size"));
    options.pattern.block_layout = mha::io::to_bool_tensor(in.at("block_layout"), "block_layout");
  }
  if (in.tensors.count("alibi_slopes") == 1) {
    const auto slopes = mha::io::to_tensor<T>(in.at("alibi_slopes"), "alibi_slopes");
    options.alibi_slopes.assign(slopes.data(), slopes.data() + slopes.size());
  } else if (metadata_flag(in, "alibi", false)) {
    options.alibi_slopes = mha::alibi_slopes<T>(layer.num_heads());
  }
  options.softcap = static_cast<T>(std::stod(metadata_text(in, "softcap", "0")));
  if (in.metadata.count("rope_base") == 1) {
    mha::Rope rope;
    rope.base = std::stod(in.metadata.at("rope_base"));
    rope.layout = metadata_flag(in, "rope_interleaved", false) ? mha::RopeLayout::interleaved
                                                               : mha::RopeLayout::rotate_half;
    rope.rotary_dim = std::stol(metadata_text(in, "rope_dim", "0"));
    options.rope = rope;
  }
  if (in.tensors.count("head_mask") == 1) {
    const auto gates = mha::io::to_tensor<T>(in.at("head_mask"), "head_mask");
    options.head_gate.assign(gates.data(), gates.data() + gates.size());
  }
  const auto query = mha::io::to_tensor<T>(in.at("query"), "query");
  const auto key = mha::io::to_tensor<T>(in.at("key"), "key");
  const auto value = mha::io::to_tensor<T>(in.at("value"), "value");
  const auto grad_output = mha::io::to_tensor<T>(in.at("grad_output"), "grad_output");

  mha::SavedForward<T> saved;
  const auto result = shared ? layer.forward_train(query, query, query, options, saved)
                             : layer.forward_train(query, key, value, options, saved);
  const mha::InputGradients<T> grads = layer.backward(saved, grad_output);
  Named<T> out;
  out.emplace("output", result.output);
  out.emplace("grad.query", grads.query);
  out.emplace("grad.key", grads.key);
  out.emplace("grad.value", grads.value);
  if (!options.head_gate.empty()) out.emplace("grad.head_mask", grads.head_gate);
  for (const auto& name : layer.parameter_names()) {
    out.emplace("grad." + name, mha::Tensor<T>(layer.gradient(name)));
  }

  // PyTorch accumulates parameter gradients until zero_grad; so does the layer.
  layer.backward(saved, grad_output);
  for (const auto& name : layer.parameter_names()) {
    INFO("second backward adds again: grad." << name);
    mha::Tensor<T> twice = out.at("grad." + name);
    for (mha::Index i = 0; i < twice.size(); ++i) twice.data()[i] *= T(2);
    CHECK_GRADIENTS_CLOSE(mha::Tensor<T>(layer.gradient(name)), twice);
  }
  layer.zero_grad();
  for (const auto& name : layer.parameter_names()) {
    INFO("zero_grad: grad." << name);
    const mha::Tensor<T> cleared(layer.gradient(name));
    CHECK(cleared.flat().cwiseAbs().maxCoeff() == T(0));
  }
  return out;
}

bool same_values(const mha::io::StoredTensor& a, const mha::io::StoredTensor& b) {
  return a.dtype == b.dtype && a.shape == b.shape && a.bytes == b.bytes;
}

// E, from the output projection's gradient [E, E].
template <class T>
mha::Index embed_dim_of(const Named<T>& gradients) {
  return gradients.at("grad.out_proj.weight").dim(0);
}

template <class T>
void check_against_torch(const Named<T>& actual, const mha::io::SafetensorsFile& expected) {
  // The same tensors on both sides (attn_weights aside, which the forward tests compare).
  std::set<std::string> missing, extra;
  for (const auto& entry : actual) extra.insert(entry.first);
  for (const auto& entry : expected.tensors) {
    if (entry.first != "attn_weights" && extra.erase(entry.first) == 0) {
      missing.insert(entry.first);
    }
  }
  for (const auto& name : missing) FAIL_CHECK("the library gives no " << name);
  for (const auto& name : extra) FAIL_CHECK("the library gives " << name << ", torch does not");
  for (const auto& entry : expected.tensors) {
    if (entry.first == "attn_weights" || actual.count(entry.first) == 0) continue;
    INFO("tensor " << entry.first);
    const auto e = mha::io::to_tensor<T>(entry.second, entry.first);
    if (is_gradient(entry.first)) {
      CHECK_PARAMETER_GRADIENTS_CLOSE(entry.first.substr(5), actual.at(entry.first), e,
                                      embed_dim_of(actual), mha_test::GradientTolerance<T>::rtol);
    } else {
      CHECK_TENSORS_CLOSE(actual.at(entry.first), e);
    }
  }
}

}  // namespace

TEST_CASE("outputs and weights equal PyTorch's on every reference fixture", "[reference]") {
  const auto names = fixture_names();
  // The generator writes more than 30 configurations; fewer means the fixtures are missing.
  REQUIRE(names.size() >= 30);
  for (const auto& name : names) {
    INFO("fixture " << name << " (" << MHA_REFERENCE_DIR << "/" << name << ".in.safetensors)");
    const auto in = forward_only(read_fixture(name, "in"));
    const auto expected = forward_only(read_fixture(name, "expected"));
    const auto out = mha::tools::run_multihead_attention(in);
    REQUIRE(out.tensors.size() == expected.tensors.size());
    for (const auto& entry : expected.tensors) {
      INFO("tensor " << entry.first);
      REQUIRE(out.tensors.count(entry.first) == 1);
      const auto& actual = out.tensors.at(entry.first);
      REQUIRE(actual.dtype == entry.second.dtype);
      if (actual.dtype == mha::io::Dtype::F32) {
        compare_tensor<float>(actual, entry.second, entry.first);
      } else {
        compare_tensor<double>(actual, entry.second, entry.first);
      }
    }
  }
}

TEST_CASE("the flash kernel's outputs equal PyTorch's on every reference fixture", "[reference]") {
  for (const auto& name : fixture_names()) {
    INFO("fixture " << name);
    auto in = forward_only(read_fixture(name, "in"));
    const auto expected = read_fixture(name, "expected");
    // Talking heads mix heads, which flash cannot (refused): they stay on auto, the reference.
    const bool talking =
        in.tensors.count("talking_heads_pre") + in.tensors.count("talking_heads_post") > 0;
    in.metadata["kernel"] = talking ? "auto" : "flash";
    in.metadata["need_weights"] = "0";
    const auto out = mha::tools::run_multihead_attention(in);
    REQUIRE(out.tensors.size() == 1);
    const auto& actual = out.at("output");
    if (actual.dtype == mha::io::Dtype::F32) {
      compare_tensor<float>(actual, expected.at("output"), "output");
    } else {
      compare_tensor<double>(actual, expected.at("output"), "output");
    }
  }
}

// The path of the flash kernel (flash_path) each float fixture takes in the test above, from its
// shapes: torch's own results then cover the small-head kernel at every head size it takes and
// the tiles (the packed GEMM's micro-kernel where the machine runs it) over several query and
// key blocks, at a head size that is a whole number of micro-tiles (32) and one that is not (24,
// which leaves partial tiles): the path_* fixtures of generate.py.
TEST_CASE("the float fixtures reach every path of the flash kernel", "[reference][flash]") {
  std::set<mha::Index> small_head_dims, tiles_dims;  // the latter over several query blocks
  int tiles_over_key_blocks = 0;
  for (const auto& name : fixture_names()) {
    const auto in = read_fixture(name, "in");
    const bool talking =
        in.tensors.count("talking_heads_pre") + in.tensors.count("talking_heads_post") > 0;
    if (in.at("query").dtype != mha::io::Dtype::F32 || talking) continue;
    const mha::Shape& query = in.at("query").shape;
    const mha::Shape& key = in.at("key").shape;
    const mha::Index embed_dim = query.back(), query_len = query[query.size() - 2];
    const mha::Index key_len = key[key.size() - 2];
    const mha::Index head_dim = embed_dim / std::stol(in.metadata.at("num_heads"));
    mha::detail::CoreOptions<float> core;
    if (in.metadata.count("softcap") == 1) core.softcap = std::stof(in.metadata.at("softcap"));
    const auto path = mha::detail::flash_path<float>(head_dim, head_dim, query_len, core, {});
    if (path == mha::detail::FlashPath::small_head) {
      small_head_dims.insert(head_dim);
    } else if (query_len > 64) {
      // The tiles' products: the packed GEMM's micro-kernel where this machine runs it
      // (panels), else Eigen's (tiles).
      CHECK(path == (mha::detail::packed_gemm_available() ? mha::detail::FlashPath::panels
                                                          : mha::detail::FlashPath::tiles));
      tiles_dims.insert(head_dim);
      if (key_len > 256) ++tiles_over_key_blocks;
    }
  }
  CHECK(small_head_dims == std::set<mha::Index>{4, 8, 12, 16});
  CHECK(tiles_dims.count(24) == 1);
  CHECK(tiles_dims.count(32) == 1);
  CHECK(tiles_over_key_blocks >= 2);
}

// float fixtures compare with torch's float32 results, whose own rounding the float tolerance must
// absorb. This measures the library's float rounding alone, at a tighter tolerance: the same
// inputs computed in double (the path the float64 fixtures pin to torch at 1e-11) are the truth.
// The absolute part is 1e-6 of the tensor's scale max(1, max|exact|): an element's rounding comes
// from the terms summed into it, which grow with the scale (on rope_f32_partial_gqa_window_bias_kv,
// whose outputs reach 24, an element of 0.038 is 1.7e-6 off, 7e-8 of the scale; over the 74
// float fixtures the largest error is 4e-7 of the scale).
TEST_CASE("float results are within float rounding of the same inputs computed in double",
          "[reference]") {
  for (const auto& name : fixture_names()) {
    const auto in = forward_only(read_fixture(name, "in"));
    if (in.at("query").dtype != mha::io::Dtype::F32) continue;
    INFO("fixture " << name);
    mha::io::SafetensorsFile widened = in;
    for (auto& entry : widened.tensors) {
      if (entry.second.dtype == mha::io::Dtype::F32) {
        entry.second = mha::io::from_tensor(mha::io::to_tensor<double>(entry.second, entry.first));
      }
    }
    const auto single = mha::tools::run_multihead_attention(in);
    const auto exact = mha::tools::run_multihead_attention(widened);
    for (const auto& entry : exact.tensors) {
      INFO("tensor " << entry.first);
      const auto truth = mha::io::to_tensor<double>(entry.second, entry.first);
      const double scale =
          std::max(1.0, truth.size() > 0 ? truth.flat().cwiseAbs().maxCoeff() : 0.0);
      CHECK_TENSORS_CLOSE_TOL(mha::io::to_tensor<double>(single.at(entry.first), entry.first),
                              truth, 1e-5, 1e-6 * scale);
    }
  }
}

TEST_CASE("gradients equal PyTorch autograd's on every grad_* and gqa_grad_* reference fixture",
          "[reference][gradients]") {
  const std::vector<std::string> names = gradient_fixture_names();
  // generate.py writes 33 gradient configurations (the issue asks for at least 20), 7 more of
  // grouped-query attention, 8 with windows, causal alignment, ALiBi or softcap and 4 with
  // rotary embeddings.
  REQUIRE(names.size() >= 52);
  int shared_runs = 0;
  for (const auto& name : names) {
    INFO("fixture " << name << " (" << MHA_REFERENCE_DIR << "/" << name << ".in.safetensors)");
    const auto in = read_fixture(name, "in");
    const auto expected = read_fixture(name, "expected");
    REQUIRE(in.tensors.count("grad_output") == 1);
    // Self-attention fixtures hold equal query, key and value: then also pass one tensor three
    // times, as self-attention is called, and still get the three gradients apart.
    const bool self =
        same_values(in.at("query"), in.at("key")) && same_values(in.at("query"), in.at("value"));
    for (const bool shared : self ? std::vector<bool>{false, true} : std::vector<bool>{false}) {
      INFO((shared ? "query passed as query, key and value" : "query, key, value apart"));
      if (shared) ++shared_runs;
      if (in.at("query").dtype == mha::io::Dtype::F32) {
        check_against_torch(library_gradients<float>(in, shared), expected);
      } else {
        check_against_torch(library_gradients<double>(in, shared), expected);
      }
    }
  }
  CHECK(shared_runs >= 2);
}

// As for the outputs above: torch's float32 gradients carry torch's rounding, which the 1e-5
// tolerance must absorb (it uses up to 14% of it on these fixtures, against float64). The same
// inputs through the library in double are the truth for the library's own float rounding,
// held to 3e-6 of each tensor's scale.
TEST_CASE("float gradients are within float rounding of the same inputs computed in double",
          "[reference][gradients]") {
  for (const auto& name : gradient_fixture_names()) {
    const auto in = read_fixture(name, "in");
    if (in.at("query").dtype != mha::io::Dtype::F32) continue;
    INFO("fixture " << name);
    const auto single = library_gradients<float>(in, false);
    const auto exact = library_gradients<double>(in, false);
    for (const auto& entry : exact) {
      INFO("tensor " << entry.first);
      CHECK_PARAMETER_GRADIENTS_CLOSE(entry.first.substr(5), single.at(entry.first), entry.second,
                                      embed_dim_of(exact), 3e-6);
    }
  }
}

// The gqa_* fixtures go through every test above (their names match no filter); this checks that
// they are there and are what they claim: layers with num_kv_heads key/value heads, both dtypes,
// multi-query and grouped, some with gradients.
TEST_CASE("the grouped-query fixtures are present and load as grouped-query layers",
          "[reference][gqa]") {
  int grouped = 0, multi_query = 0, with_gradients = 0, in_float = 0, in_double = 0;
  for (const auto& name : fixture_names()) {
    if (name.rfind("gqa_", 0) != 0) continue;
    INFO("fixture " << name);
    const auto in = read_fixture(name, "in");
    std::map<std::string, mha::Tensor<double>> state;
    for (const auto& entry : in.tensors) {
      if (mha::tools::detail::input_names().count(entry.first) == 0) {
        state.emplace(entry.first, mha::io::to_tensor<double>(entry.second, entry.first));
      }
    }
    const mha::Index heads = std::stol(in.metadata.at("num_heads"));
    const auto layer = mha::MultiHeadAttention<double>::from_state_dict(state, heads);
    REQUIRE(in.metadata.count("num_kv_heads") == 1);
    CHECK(layer.num_kv_heads() == std::stol(in.metadata.at("num_kv_heads")));
    if (layer.num_kv_heads() == heads) continue;
    CHECK(layer.kv_dim() == layer.num_kv_heads() * layer.head_dim());
    ++grouped;
    multi_query += layer.num_kv_heads() == 1;
    with_gradients += in.tensors.count("grad_output") == 1;
    (in.at("query").dtype == mha::io::Dtype::F32 ? in_float : in_double) += 1;
  }
  // generate.py writes 14 grouped-query configurations (7 with gradients) and one with H_kv = H.
  CHECK(grouped >= 14);
  CHECK(multi_query >= 4);
  CHECK(grouped - multi_query >= 4);
  CHECK(with_gradients >= 7);
  CHECK(in_float >= 4);
  CHECK(in_double >= 4);
}

// The window_*, alibi_* and softcap_* fixtures also go through every test above; this checks that
// they are there and cover what they should: each option in both dtypes, bottom-right alignment
// where L != S (where it differs from top-left), both ways of giving ALiBi slopes, gradients,
// grouped-query attention, the bias_k / zero columns and unbatched input.
TEST_CASE("the window, ALiBi and softcap fixtures are present and cover each option",
          "[reference][modern]") {
  int cases = 0, with_gradients = 0, in_float = 0, in_double = 0, bottom_right = 0, windows = 0,
      paper_alibi = 0, slopes_tensor = 0, softcaps = 0, grouped = 0, extra_columns = 0,
      unbatched = 0;
  for (const auto& name : fixture_names()) {
    if (name.rfind("window_", 0) != 0 && name.rfind("alibi_", 0) != 0 &&
        name.rfind("softcap_", 0) != 0) {
      continue;
    }
    INFO("fixture " << name);
    const auto in = read_fixture(name, "in");
    ++cases;
    with_gradients += in.tensors.count("grad_output") == 1;
    (in.at("query").dtype == mha::io::Dtype::F32 ? in_float : in_double) += 1;
    const auto& query = in.at("query").shape;
    const auto& key = in.at("key").shape;
    const bool batched = query.size() == 3;
    unbatched += !batched;
    const mha::Index L = query[batched ? 1 : 0], S = key[batched ? 1 : 0];
    bottom_right += metadata_text(in, "causal_alignment", "") == "bottom_right" && L != S;
    windows += metadata_text(in, "window_left", "-1") != "-1" ||
               metadata_text(in, "window_right", "-1") != "-1";
    paper_alibi += metadata_text(in, "alibi", "0") == "1";
    slopes_tensor += in.tensors.count("alibi_slopes") == 1;
    softcaps += std::stod(metadata_text(in, "softcap", "0")) > 0;
    grouped += in.tensors.count("k_proj_weight") == 1 &&
               in.at("k_proj_weight").shape[0] != in.at("q_proj_weight").shape[0];
    extra_columns +=
        in.tensors.count("bias_k") == 1 || metadata_text(in, "add_zero_attn", "0") == "1";
  }
  // generate.py writes 21: 8 with gradients.
  CHECK(cases >= 12);
  CHECK(with_gradients >= 5);
  CHECK(in_float >= 4);
  CHECK(in_double >= 4);
  CHECK(bottom_right >= 4);
  CHECK(windows >= 6);
  CHECK(paper_alibi >= 3);
  CHECK(slopes_tensor >= 2);
  CHECK(softcaps >= 5);
  CHECK(grouped >= 3);
  CHECK(extra_columns >= 4);
  CHECK(unbatched >= 2);
}

// The window_dilated_* fixtures: dilation with and without bounds, both dtypes, gradients across
// flash blocks.
TEST_CASE("the dilated-window fixtures are present", "[reference][modern]") {
  int cases = 0, with_gradients = 0, unbounded = 0;
  for (const auto& name : fixture_names()) {
    if (name.rfind("window_dilated_", 0) != 0) continue;
    INFO("fixture " << name);
    const auto in = read_fixture(name, "in");
    REQUIRE(std::stol(metadata_text(in, "window_dilation", "1")) > 1);
    ++cases;
    with_gradients += in.tensors.count("grad_output") == 1;
    unbounded += metadata_text(in, "window_left", "-1") == "-1" &&
                 metadata_text(in, "window_right", "-1") == "-1";
  }
  CHECK(cases >= 4);
  CHECK(with_gradients >= 2);
  CHECK(unbounded >= 1);
}

// The global_* and blocks_* fixtures: global tokens with windows (attention sinks, Longformer),
// shared and per-head block layouts, bottom-right positions, gradients across flash blocks.
TEST_CASE("the sparse-pattern fixtures are present and cover each part", "[reference][pattern]") {
  int cases = 0, with_gradients = 0, global = 0, layouts = 0, per_head = 0, bottom_right = 0,
      across_blocks = 0;
  for (const auto& name : fixture_names()) {
    if (name.rfind("global_", 0) != 0 && name.rfind("blocks_", 0) != 0) continue;
    INFO("fixture " << name);
    const auto in = read_fixture(name, "in");
    ++cases;
    with_gradients += in.tensors.count("grad_output") == 1;
    global += in.metadata.count("global_tokens") == 1;
    if (in.tensors.count("block_layout") == 1) {
      ++layouts;
      per_head += in.at("block_layout").shape.size() == 3;
    }
    bottom_right += metadata_text(in, "causal_alignment", "top_left") == "bottom_right";
    const mha::Shape& query_shape = in.at("query").shape;
    across_blocks += query_shape[query_shape.size() - 2] > 256;
  }
  CHECK(cases >= 6);
  CHECK(with_gradients >= 2);
  CHECK(global >= 4);
  CHECK(layouts >= 4);
  CHECK(per_head >= 2);
  CHECK(bottom_right >= 1);
  CHECK(across_blocks >= 1);
}

// The talking_* fixtures: each mix alone and both, with GQA, softcap, RoPE and masks; gradients.
TEST_CASE("the talking-heads fixtures are present and mix each way", "[reference][talking]") {
  int cases = 0, with_gradients = 0, pre = 0, post = 0, both = 0, grouped = 0;
  for (const auto& name : fixture_names()) {
    if (name.rfind("talking_", 0) != 0) continue;
    INFO("fixture " << name);
    const auto in = read_fixture(name, "in");
    ++cases;
    with_gradients += in.tensors.count("grad_output") == 1;
    const bool has_pre = in.tensors.count("talking_heads_pre") == 1;
    const bool has_post = in.tensors.count("talking_heads_post") == 1;
    REQUIRE((has_pre || has_post));
    pre += has_pre && !has_post;
    post += has_post && !has_pre;
    both += has_pre && has_post;
    grouped += in.tensors.count("k_proj_weight") == 1 &&
               in.at("k_proj_weight").shape[0] < in.at("q_proj_weight").shape[0];
  }
  CHECK(cases >= 4);
  CHECK(with_gradients >= 2);
  CHECK(pre >= 1);
  CHECK(post >= 1);
  CHECK(both >= 2);
  CHECK(grouped >= 1);
}

// The rope_* fixtures also go through every test above; this checks that they cover both layouts,
// partial rotation, bottom-right positions with L != S, grouped-query attention, packed
// self-attention (the fused projection's buffer is rotated in place) and gradients of each.
TEST_CASE("the rotary-embedding fixtures are present and cover each layout", "[reference][rope]") {
  int cases = 0, with_gradients = 0, interleaved = 0, rotate_half = 0, partial = 0,
      bottom_right = 0, grouped = 0, packed_self = 0, in_float = 0, in_double = 0;
  for (const auto& name : fixture_names()) {
    if (name.rfind("rope_", 0) != 0) continue;
    INFO("fixture " << name);
    const auto in = read_fixture(name, "in");
    REQUIRE(in.metadata.count("rope_base") == 1);
    ++cases;
    const bool gradients = in.tensors.count("grad_output") == 1;
    with_gradients += gradients;
    (in.at("query").dtype == mha::io::Dtype::F32 ? in_float : in_double) += 1;
    (metadata_text(in, "rope_interleaved", "0") == "1" ? interleaved : rotate_half) += 1;
    partial += in.metadata.count("rope_dim") == 1;
    const auto& query = in.at("query").shape;
    const auto& key = in.at("key").shape;
    bottom_right += metadata_text(in, "causal_alignment", "") == "bottom_right" &&
                    query[query.size() - 2] != key[key.size() - 2];
    grouped += in.tensors.count("k_proj_weight") == 1 &&
               in.at("k_proj_weight").shape[0] != in.at("q_proj_weight").shape[0];
    packed_self += gradients && in.tensors.count("in_proj_weight") == 1 &&
                   same_values(in.at("query"), in.at("key")) &&
                   same_values(in.at("query"), in.at("value"));
  }
  // generate.py writes 9: 4 with gradients.
  CHECK(cases >= 9);
  CHECK(with_gradients >= 4);
  CHECK(interleaved >= 3);
  CHECK(rotate_half >= 3);
  CHECK(partial >= 3);
  CHECK(bottom_right >= 2);
  CHECK(grouped >= 3);
  CHECK(packed_self >= 1);
  CHECK(in_float >= 3);
  CHECK(in_double >= 3);
}

// The head_mask_* fixtures also go through every test above (gradients include grad.head_mask);
// this checks that their gates include removed heads (0), untouched ones (1) and fractions.
TEST_CASE("the head-mask fixtures are present and gate heads every way", "[reference][gating]") {
  int cases = 0, with_gradients = 0, zeros = 0, ones = 0, fractions = 0;
  for (const auto& name : fixture_names()) {
    if (name.rfind("head_mask_", 0) != 0) continue;
    INFO("fixture " << name);
    const auto in = read_fixture(name, "in");
    REQUIRE(in.tensors.count("head_mask") == 1);
    ++cases;
    with_gradients += in.tensors.count("grad_output") == 1;
    const auto gates = mha::io::to_tensor<double>(in.at("head_mask"), "head_mask");
    for (mha::Index h = 0; h < gates.size(); ++h) {
      const double g = gates.data()[h];
      (g == 0 ? zeros : g == 1 ? ones : fractions) += 1;
    }
    if (in.tensors.count("grad_output") == 1) {
      CHECK(read_fixture(name, "expected").tensors.count("grad.head_mask") == 1);
    }
  }
  // generate.py writes 5: 3 with gradients.
  CHECK(cases >= 5);
  CHECK(with_gradients >= 3);
  CHECK(zeros >= 3);
  CHECK(ones >= 3);
  CHECK(fractions >= 3);
}

TEST_CASE("a layer's parameters round-trip through a safetensors file by their PyTorch names",
          "[io]") {
  mha::MultiHeadAttentionConfig config(12, 3);
  config.kdim = 7;
  config.add_bias_kv = true;
  config.seed = 5;
  const mha::MultiHeadAttention<double> saved(config);
  const std::string path =
      (fs::temp_directory_path() / ("mha_params_" + std::to_string(::getpid()) + ".safetensors"))
          .string();
  mha::io::save_parameters(saved, path, {{"num_heads", "3"}});
  const auto file = mha::io::read_safetensors(path);
  CHECK(file.metadata.at("num_heads") == "3");
  CHECK(file.at("k_proj_weight").shape == mha::Shape{12, 7});
  CHECK(file.at("bias_k").dtype == mha::io::Dtype::F64);

  config.seed = 6;
  mha::MultiHeadAttention<double> loaded(config);
  mha::io::load_parameters(loaded, path);
  for (const auto& name : saved.parameter_names()) {
    INFO(name);
    CHECK(mha::Tensor<double>(loaded.parameter(name)).flat() ==
          mha::Tensor<double>(saved.parameter(name)).flat());
  }
  // A layer of another shape refuses the file, naming the parameter.
  mha::MultiHeadAttention<double> other(12, 3);
  CHECK_THROWS_AS(mha::io::load_parameters(other, path), mha::ShapeError);
  fs::remove(path);
}

TEST_CASE("parameters exported from PyTorch load into a layer of the same configuration", "[io]") {
  // f32_kdim_vdim was written by torch: q/k/v_proj_weight with kdim 5, vdim 3.
  const std::string path = std::string(MHA_REFERENCE_DIR) + "/f32_kdim_vdim.in.safetensors";
  const auto file = mha::io::read_safetensors(path);
  const auto& weight = file.at("out_proj.weight");
  mha::MultiHeadAttentionConfig config(weight.shape[0], std::stol(file.metadata.at("num_heads")));
  config.kdim = file.at("k_proj_weight").shape[1];
  config.vdim = file.at("v_proj_weight").shape[1];
  mha::MultiHeadAttention<float> layer(config);
  mha::io::load_parameters(layer, path);
  const auto expected = mha::io::to_tensor<float>(file.at("k_proj_weight"), "k_proj_weight");
  CHECK(mha::Tensor<float>(layer.parameter("k_proj_weight")).flat() == expected.flat());
}
