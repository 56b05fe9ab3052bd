// mha_run end to end: the real binary on a PyTorch fixture (forward, and backward given
// grad_output), its help, and malformed input (exit code 1 with one line on stderr, never a crash).
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "helpers.hpp"
#include "mha/io/safetensors.hpp"

namespace fs = std::filesystem;

namespace {

struct Run {
  int exit_code = -1;
  std::string out, err;
};

std::string slurp(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

fs::path scratch_dir() {
  const fs::path dir = fs::temp_directory_path() / ("mha_run_test_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  return dir;
}

Run run_tool(const std::string& arguments) {
  const fs::path dir = scratch_dir();
  const std::string command = std::string("'") + MHA_RUN_PATH + "' " + arguments + " >'" +
                              (dir / "stdout").string() + "' 2>'" + (dir / "stderr").string() + "'";
  const int status = std::system(command.c_str());
  Run run;
  // A signal (a crash) is never an acceptable way to end.
  REQUIRE(WIFEXITED(status));
  run.exit_code = WEXITSTATUS(status);
  run.out = slurp(dir / "stdout");
  run.err = slurp(dir / "stderr");
  return run;
}

std::string fixture(const std::string& name) {
  return std::string(MHA_REFERENCE_DIR) + "/" + name;
}

void write_bytes(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out << bytes;
}

void check_refused(const std::string& arguments, const std::string& expected_fragment) {
  const Run run = run_tool(arguments);
  INFO("mha_run " << arguments << "\nstderr: " << run.err);
  CHECK(run.exit_code == 1);
  CHECK(std::count(run.err.begin(), run.err.end(), '\n') == 1);
  CHECK(run.err.find(expected_fragment) != std::string::npos);
}

}  // namespace

TEST_CASE("mha_run reproduces PyTorch on a fixture, end to end", "[mha_run]") {
  const fs::path out = scratch_dir() / "out.safetensors";
  for (const std::string name :
       {"f32_everything", "f64_unbatched_masks", "gqa_f32_kv2_kdim_vdim_bias_kv_zero_attn_per_head",
        "window_f64_top_left_L_gt_S_bias_kv_zero_attn",
        "alibi_f64_slopes_cross_bottom_right_per_head", "softcap_f32_unbatched_alibi_window",
        "rope_f64_unbatched_interleaved_partial_alibi_zero_attn"}) {
    INFO(name);
    const Run run = run_tool("'" + fixture(name + ".in.safetensors") + "' '" + out.string() + "'");
    REQUIRE(run.exit_code == 0);
    CHECK(run.err.empty());
    const auto actual = mha::io::read_safetensors(out.string());
    const auto expected = mha::io::read_safetensors(fixture(name + ".expected.safetensors"));
    REQUIRE(actual.tensors.size() == expected.tensors.size());
    for (const auto& entry : expected.tensors) {
      INFO(entry.first);
      if (entry.second.dtype == mha::io::Dtype::F32) {
        CHECK_TENSORS_CLOSE(mha::io::to_tensor<float>(actual.at(entry.first), entry.first),
                            mha::io::to_tensor<float>(entry.second, entry.first));
      } else {
        CHECK_TENSORS_CLOSE(mha::io::to_tensor<double>(actual.at(entry.first), entry.first),
                            mha::io::to_tensor<double>(entry.second, entry.first));
      }
    }
  }
}

namespace {

// A fixture of torch's run by mha_run with `metadata` added to its own: the largest difference
// of `result` (the output, or a gradient) from torch's, over torch's largest magnitude.
double error_with_metadata(
    const std::map<std::string, std::string>& metadata,
    const std::string& name = "gqa_f32_kv2_kdim_vdim_bias_kv_zero_attn_per_head",
    const std::string& result = "output") {
  const fs::path dir = scratch_dir();
  auto in = mha::io::read_safetensors(fixture(name + ".in.safetensors"));
  for (const auto& [key, value] : metadata) in.metadata[key] = value;
  mha::io::write_safetensors((dir / "reduced.safetensors").string(), in);
  const Run run = run_tool("'" + (dir / "reduced.safetensors").string() + "' '" +
                           (dir / "out.safetensors").string() + "'");
  REQUIRE(run.exit_code == 0);
  const auto actual = mha::io::read_safetensors((dir / "out.safetensors").string());
  const auto expected = mha::io::read_safetensors(fixture(name + ".expected.safetensors"));
  const auto output = mha::io::to_tensor<float>(actual.at(result), result);
  const auto torch = mha::io::to_tensor<float>(expected.at(result), result);
  REQUIRE(output.shape() == torch.shape());
  return (output.flat() - torch.flat()).cwiseAbs().maxCoeff() / torch.flat().cwiseAbs().maxCoeff();
}

}  // namespace

TEST_CASE("mha_run computes in reduced precision as its metadata asks", "[mha_run]") {
  // The bounds test_precision.cpp checks against float64 (1e-2 for bf16, 2e-2 for int8), and not
  // torch's fp32 bits where the CPU computes that way.
  const double bf16 = error_with_metadata({{"precision", "bf16"}});
  INFO("bf16: " << bf16 << " of the largest output");
  CHECK(bf16 <= 1e-2);
  if (mha::bf16_arithmetic_available()) CHECK(bf16 > 1e-4);
  const double int8_weights = error_with_metadata({{"weights", "int8"}});
  INFO("int8 weights: " << int8_weights);
  CHECK(int8_weights <= 2e-2);
  CHECK(int8_weights > 1e-4);
  const double int8 = error_with_metadata({{"weights", "int8"}, {"precision", "int8"}});
  INFO("int8 x int8: " << int8);
  CHECK(int8 <= 2e-2);
  CHECK(int8 > 1e-4);
}

TEST_CASE("mha_run trains in mixed precision as its metadata asks", "[mha_run]") {
  // A fixture with grad_output: the output and the gradients within test_mixed_precision.cpp's
  // bound of torch's fp32 ones (1e-2 of their largest magnitude), and not torch's bits. fp16's
  // operands keep 11 significant bits (bf16's 8), its errors about 8 times smaller.
  const std::string name = "gqa_grad_f32_kv2_kdim_vdim_bias_kv_zero_attn_flash";
  for (const std::string precision : {"bf16", "fp16"}) {
    for (const std::string result : {"output", "grad.query", "grad.key", "grad.value",
                                     "grad.in_proj_bias", "grad.out_proj.weight"}) {
      const double error = error_with_metadata({{"precision", precision}}, name, result);
      INFO(precision << " " << result << ": " << error << " of the largest");
      CHECK(error <= 1e-2);
      if (precision == "fp16" || mha::bf16_arithmetic_available()) CHECK(error > 1e-5);
    }
  }
}

namespace {

// Gradients are compared as in test_reference.cpp: |a - e| <= rtol * (max|e| + |e|), rtol 1e-5 in
// float and 1e-10 in double.
template <class T>
void check_output_close(const mha::io::StoredTensor& actual, const mha::io::StoredTensor& expected,
                        const std::string& name) {
  const auto a = mha::io::to_tensor<T>(actual, name);
  const auto e = mha::io::to_tensor<T>(expected, name);
  if (name.rfind("grad.", 0) != 0) {
    CHECK_TENSORS_CLOSE(a, e);
    return;
  }
  const double rtol = std::is_same_v<T, float> ? 1e-5 : 1e-10;
  double scale = 0.0;
  for (mha::Index i = 0; i < e.size(); ++i)
    scale = std::max(scale, std::abs(static_cast<double>(e.data()[i])));
  CHECK_TENSORS_CLOSE_TOL(a, e, rtol, rtol * scale);
}

}  // namespace

TEST_CASE("mha_run with grad_output writes PyTorch autograd's gradients, end to end",
          "[mha_run][gradients]") {
  const fs::path out = scratch_dir() / "out.safetensors";
  for (const std::string name :
       {"grad_f32_everything_flash", "grad_f64_everything_no_bias", "grad_f32_self_basic",
        "gqa_grad_f64_kv3_bias_kv_float_mask_per_head", "softcap_grad_f32_everything_per_head",
        "window_grad_f64_bottom_right_L_gt_S_zero_attn", "rope_grad_f32_everything_per_head",
        "head_mask_grad_f64_everything_per_head"}) {
    INFO(name);
    const Run run = run_tool("'" + fixture(name + ".in.safetensors") + "' '" + out.string() + "'");
    REQUIRE(run.exit_code == 0);
    CHECK(run.err.empty());
    const auto actual = mha::io::read_safetensors(out.string());
    const auto expected = mha::io::read_safetensors(fixture(name + ".expected.safetensors"));
    // output, attn_weights when asked, grad.query/key/value and grad.<name> of every parameter.
    CHECK(actual.tensors.count("grad.query") == 1);
    CHECK(actual.tensors.count("grad.out_proj.weight") == 1);
    REQUIRE(actual.tensors.size() == expected.tensors.size());
    for (const auto& entry : expected.tensors) {
      INFO(entry.first);
      REQUIRE(actual.tensors.count(entry.first) == 1);
      REQUIRE(actual.at(entry.first).dtype == entry.second.dtype);
      if (entry.second.dtype == mha::io::Dtype::F32) {
        check_output_close<float>(actual.at(entry.first), entry.second, entry.first);
      } else {
        check_output_close<double>(actual.at(entry.first), entry.second, entry.first);
      }
    }
  }
}

TEST_CASE("mha_run refuses a grad_output that is not the shape or dtype of output",
          "[mha_run][gradients][errors]") {
  const fs::path dir = scratch_dir();
  const std::string out = "'" + (dir / "out.safetensors").string() + "'";
  // B = 2, L = 5, E = 12: output [2, 5, 12].
  const auto original =
      mha::io::read_safetensors(fixture("grad_f32_everything_flash.in.safetensors"));
  REQUIRE(original.at("grad_output").shape == mha::Shape{2, 5, 12});
  const auto refused_with = [&](mha::io::SafetensorsFile file, const std::string& fragment) {
    mha::io::write_safetensors((dir / "bad.safetensors").string(), file);
    check_refused("'" + (dir / "bad.safetensors").string() + "' " + out, fragment);
  };
  auto file = original;
  file.tensors["grad_output"] = mha::io::from_tensor(mha::Tensor<float>({2, 5, 11}));
  refused_with(file, "grad_output: expected [2, 5, 12] (the shape of output), got [2, 5, 11]");
  file.tensors["grad_output"] = mha::io::from_tensor(mha::Tensor<float>({5, 12}));
  refused_with(file, "grad_output: expected [2, 5, 12] (the shape of output), got [5, 12]");
  file.tensors["grad_output"] = mha::io::from_tensor(mha::Tensor<double>({2, 5, 12}));
  refused_with(file, "grad_output: expected dtype F32 (that of query), got F64");
}

TEST_CASE("mha_run --help documents the contract", "[mha_run]") {
  const Run run = run_tool("--help");
  CHECK(run.exit_code == 0);
  for (
      const char* word :
      {"num_heads",      "key_padding_mask", "attn_mask",    "need_weights", "average_attn_weights",
       "is_causal",      "add_zero_attn",    "attn_weights", "grad_output",  "grad.query",
       "grad.key",       "grad.value",       "grad.<name>",  "num_kv_heads", "[H_kv*D, kdim]",
       "[E + 2*H_kv*D]", "causal_alignment", "top_left",     "bottom_right", "window_left",
       "window_right",   "window_dilation",  "alibi",        "alibi_slopes", "softcap",
       "rope_base",      "rope_interleaved", "rope_dim",     "head_mask",    "grad.head_mask",
       "i + S - L"}) {
    CHECK(run.out.find(word) != std::string::npos);
  }
}

TEST_CASE("mha_run checks metadata num_kv_heads against k_proj_weight", "[mha_run][errors]") {
  const fs::path dir = scratch_dir();
  const std::string out = "'" + (dir / "out.safetensors").string() + "'";
  const auto run_with = [&](mha::io::SafetensorsFile file) {
    mha::io::write_safetensors((dir / "kv.safetensors").string(), file);
    return "'" + (dir / "kv.safetensors").string() + "' " + out;
  };
  // Multi-query: H = 4, E = 16 (D = 4), k_proj_weight [4, 16] gives H_kv = 1.
  const auto mqa = mha::io::read_safetensors(fixture("gqa_f32_mqa_self.in.safetensors"));
  REQUIRE(mqa.metadata.at("num_kv_heads") == "1");
  REQUIRE(mqa.at("k_proj_weight").shape == mha::Shape{4, 16});
  auto file = mqa;
  file.metadata["num_kv_heads"] = "2";
  check_refused(run_with(file),
                "metadata 'num_kv_heads': expected 1 (k_proj_weight [4, 16] with D = 4), got 2");
  file.metadata["num_kv_heads"] = "4";  // num_heads, but the parameters are multi-query
  check_refused(run_with(file), "metadata 'num_kv_heads': expected 1");
  file.metadata["num_kv_heads"] = "0";
  check_refused(run_with(file), "metadata 'num_kv_heads': expected a positive integer, got \"0\"");
  file.metadata["num_kv_heads"] = "one";
  check_refused(run_with(file), "metadata 'num_kv_heads': expected a positive integer");
  // Optional: without it, k_proj_weight decides.
  file.metadata.erase("num_kv_heads");
  CHECK(run_tool(run_with(file)).exit_code == 0);

  // A packed in_proj_weight means H_kv = num_heads (here 2).
  auto packed = mha::io::read_safetensors(fixture("f32_self_basic.in.safetensors"));
  REQUIRE(packed.tensors.count("in_proj_weight") == 1);
  packed.metadata["num_kv_heads"] = "1";
  check_refused(run_with(packed),
                "metadata 'num_kv_heads': expected 2 (num_heads, as in_proj_weight is packed), "
                "got 1");
  packed.metadata["num_kv_heads"] = "2";
  CHECK(run_tool(run_with(packed)).exit_code == 0);
}

TEST_CASE("mha_run refuses bad window, alignment, ALiBi, softcap and rotary metadata",
          "[mha_run][errors]") {
  const fs::path dir = scratch_dir();
  const std::string out = "'" + (dir / "out.safetensors").string() + "'";
  const auto run_with = [&](const mha::io::SafetensorsFile& file) {
    mha::io::write_safetensors((dir / "modern.safetensors").string(), file);
    return "'" + (dir / "modern.safetensors").string() + "' " + out;
  };
  // H = 2, float32 (so softcap 1e300 is out of range), no ALiBi: the options below are the only
  // change.
  const auto original = mha::io::read_safetensors(fixture("softcap_f32_basic.in.safetensors"));
  REQUIRE(original.metadata.at("num_heads") == "2");
  REQUIRE(run_tool(run_with(original)).exit_code == 0);
  const auto refused_with = [&](const std::string& key, const std::string& value,
                                const std::string& fragment) {
    auto file = original;
    file.metadata[key] = value;
    INFO(key << " = \"" << value << "\"");
    check_refused(run_with(file), fragment);
  };
  refused_with("causal_alignment", "bottom-right",
               "metadata 'causal_alignment': expected \"top_left\" or \"bottom_right\", got "
               "\"bottom-right\"");
  refused_with("causal_alignment", "", "metadata 'causal_alignment'");
  for (const std::string key : {"window_left", "window_right"}) {
    for (const std::string value : {"-2", "1.5", "x", "", "+3", " 2", "1234567890"}) {
      refused_with(key, value,
                   "metadata '" + key + "': expected an integer >= -1 (-1 = unbounded), got \"" +
                       value + "\"");
    }
  }
  refused_with("alibi", "2", "metadata 'alibi': expected \"0\" or \"1\", got \"2\"");
  refused_with("window_dilation", "0",
               "metadata 'window_dilation': expected a positive integer, got \"0\"");
  for (const std::string value : {"0", "-10", "nan", "inf", "1e999", "ten", ""}) {
    refused_with("rope_base", value,
                 "metadata 'rope_base': expected a finite number > 0, got \"" + value + "\"");
  }
  // rope_interleaved and rope_dim mean nothing without rope_base.
  refused_with("rope_interleaved", "1",
               "metadata 'rope_interleaved': expected absent without rope_base (which switches "
               "rotary embeddings on), got \"1\"");
  refused_with("rope_dim", "2", "metadata 'rope_dim': expected absent without rope_base");
  {
    auto file = original;  // D = 4
    file.metadata["rope_base"] = "10000";
    for (const auto& [value, fragment] : std::vector<std::pair<std::string, std::string>>{
             {"3", "rope.rotary_dim: must be even and in [0, D = 4] (0 = D), got 3"},
             {"6", "got 6"},
             {"0", "metadata 'rope_dim': expected a positive integer, got \"0\""}}) {
      file.metadata["rope_dim"] = value;
      INFO("rope_dim = \"" << value << "\"");
      check_refused(run_with(file), fragment);
    }
    file.metadata["rope_dim"] = "2";
    file.metadata["rope_interleaved"] = "yes";
    check_refused(run_with(file), "metadata 'rope_interleaved': expected \"0\" or \"1\"");
  }
  for (const std::string value :
       {"-1", "nan", "inf", "1e999", "1e300", "abc", "", "0x10", " 1", "1.5.2"}) {
    refused_with(
        "softcap", value,
        "metadata 'softcap': expected a finite number >= 0 (0 = none), got \"" + value + "\"");
  }
  // Accepted spellings.
  for (const auto& [key, value] :
       std::vector<std::pair<std::string, std::string>>{{"causal_alignment", "bottom_right"},
                                                        {"window_left", "0"},
                                                        {"window_right", "-1"},
                                                        {"softcap", "0"},
                                                        {"softcap", "2.5e1"},
                                                        {"rope_base", "1e4"},
                                                        {"window_dilation", "3"},
                                                        {"alibi", "1"}}) {
    auto file = original;
    file.metadata[key] = value;
    INFO(key << " = \"" << value << "\"");
    CHECK(run_tool(run_with(file)).exit_code == 0);
  }

  // A head_mask tensor: one finite gate per head, in query's dtype.
  {
    auto gated = original;
    gated.tensors["head_mask"] = mha::io::from_tensor(mha::Tensor<float>({2}, {1.0f, 0.0f}));
    CHECK(run_tool(run_with(gated)).exit_code == 0);
    gated.tensors["head_mask"] = mha::io::from_tensor(mha::Tensor<float>({3}, {1, 1, 1}));
    check_refused(run_with(gated), "head_mask: expected [2] (one gate per head), got [3]");
    gated.tensors["head_mask"] = mha::io::from_tensor(
        mha::Tensor<float>({2}, {1.0f, std::numeric_limits<float>::infinity()}));
    check_refused(run_with(gated), "head_mask: gate 1 is not finite");
    gated.tensors["head_mask"] = mha::io::from_tensor(mha::Tensor<double>({2}, {1.0, 1.0}));
    check_refused(run_with(gated), "head_mask: expected dtype F32 (that of query), got F64");
  }

  // An alibi_slopes tensor: one slope per head, query's dtype, and no alibi key beside it.
  auto file = original;
  file.tensors["alibi_slopes"] = mha::io::from_tensor(mha::Tensor<float>({2}, {0.5f, 0.25f}));
  CHECK(run_tool(run_with(file)).exit_code == 0);
  file.metadata["alibi"] = "1";
  check_refused(run_with(file),
                "metadata 'alibi': expected absent with an alibi_slopes tensor (which gives the "
                "slopes), got \"1\"");
  file.metadata["alibi"] = "0";
  check_refused(run_with(file), "metadata 'alibi': expected absent with an alibi_slopes tensor");
  file.metadata.erase("alibi");
  file.tensors["alibi_slopes"] = mha::io::from_tensor(mha::Tensor<float>({3}));
  check_refused(run_with(file), "alibi_slopes: expected [2] (one per head), got [3]");
  file.tensors["alibi_slopes"] = mha::io::from_tensor(mha::Tensor<float>({1, 2}));
  check_refused(run_with(file), "alibi_slopes: expected [2] (one per head), got [1, 2]");
  file.tensors["alibi_slopes"] = mha::io::from_tensor(mha::Tensor<double>({2}));
  check_refused(run_with(file), "alibi_slopes: expected dtype F32 (that of query), got F64");
  file.tensors["alibi_slopes"] =
      mha::io::from_tensor(mha::Tensor<float>({2}, {0.5f, std::numeric_limits<float>::infinity()}));
  check_refused(run_with(file), "alibi_slopes");
}

TEST_CASE("mha_run refuses bad input with exit code 1 and one line", "[mha_run][errors]") {
  const fs::path dir = scratch_dir();
  const std::string good = fixture("f32_everything.in.safetensors");
  const std::string out = "'" + (dir / "out.safetensors").string() + "'";
  check_refused("", "usage");
  check_refused("'" + (dir / "does-not-exist").string() + "' " + out, "cannot open");

  const std::string bytes = slurp(good);
  for (const std::size_t length : {std::size_t(0), std::size_t(5), std::size_t(8), std::size_t(40),
                                   bytes.size() / 2, bytes.size() - 1}) {
    INFO("truncated to " << length);
    write_bytes(dir / "truncated.safetensors", bytes.substr(0, length));
    check_refused("'" + (dir / "truncated.safetensors").string() + "' " + out,
                  "truncated.safetensors");
  }

  // Valid files with bad content, written through the library.
  const auto original = mha::io::read_safetensors(good);
  const auto refused_with = [&](mha::io::SafetensorsFile file, const std::string& fragment) {
    mha::io::write_safetensors((dir / "bad.safetensors").string(), file);
    check_refused("'" + (dir / "bad.safetensors").string() + "' " + out, fragment);
  };
  auto file = original;
  file.tensors.erase("query");
  refused_with(file, "missing tensor 'query'");
  file = original;
  file.metadata.erase("num_heads");
  refused_with(file, "num_heads");
  file = original;
  file.metadata["num_heads"] = "5";  // E = 12
  refused_with(file, "not divisible");
  file = original;
  file.metadata["need_weights"] = "2";
  refused_with(file, "need_weights");
  file = original;
  file.tensors["key_padding_mask"] = mha::io::from_tensor(mha::Tensor<bool>({1, 1}));
  refused_with(file, "key_padding_mask: expected");
  file = original;
  file.tensors["attn_mask"] = mha::io::from_tensor(mha::Tensor<float>({2, 2, 2}));
  refused_with(file, "attn_mask: expected");
  file = original;
  file.metadata["kernel"] = "fast";
  refused_with(file, "kernel");
  file = original;
  file.metadata["kernel"] = "flash";  // with need_weights = 1
  refused_with(file, "flash does not return attention weights");
  file = original;
  file.metadata["weights"] = "int4";
  refused_with(file, "metadata 'weights': expected \"as_given\" or \"int8\", got \"int4\"");
  file = original;
  file.metadata["weights"] = "int8";
  file.tensors["grad_output"] = file.tensors.at("query");
  refused_with(file, "metadata 'weights': int8 weights are for inference");
  file = original;
  file.metadata["precision"] = "fp8";
  refused_with(
      file, "metadata 'precision': expected \"fp32\", \"bf16\", \"int8\" or \"fp16\", got \"fp8\"");
  file = original;
  file.metadata["precision"] = "fp16";  // without grad_output: inference
  refused_with(file, "fp16 products are for mixed-precision training");
  file = original;
  file.metadata["precision"] = "int8";
  file.tensors["grad_output"] = file.tensors.at("query");
  refused_with(file, "precision");
  file = original;
  file.tensors["surprise"] = mha::io::from_tensor(mha::Tensor<float>({2}));
  refused_with(file, "unexpected tensor 'surprise'");
  file = original;
  file.tensors["query"] = mha::io::from_tensor(mha::Tensor<bool>({2, 2}));
  refused_with(file, "query: expected dtype F32 or F64, got BOOL");
}

TEST_CASE("mha_run runs a pruned layer, reading D from out_proj.weight", "[mha_run][prune]") {
  mha::MultiHeadAttentionConfig config(16, 4);
  config.seed = 5;
  mha::MultiHeadAttention<double> layer(config);
  layer.prune_heads({1});  // 3 heads of D = 4: H·D = 12, E = 16
  mha::io::SafetensorsFile in;
  for (const auto& name : layer.parameter_names()) {
    in.tensors[name] = mha::io::from_tensor(mha::Tensor<double>(layer.parameter(name)));
  }
  const auto x = mha_test::random_tensor<double>({2, 3, 16}, 6);
  for (const char* name : {"query", "key", "value"}) in.tensors[name] = mha::io::from_tensor(x);
  in.metadata["num_heads"] = "3";
  const fs::path dir = scratch_dir();
  mha::io::write_safetensors((dir / "pruned.safetensors").string(), in);
  const Run run = run_tool("'" + (dir / "pruned.safetensors").string() + "' '" +
                           (dir / "out.safetensors").string() + "'");
  REQUIRE(run.exit_code == 0);
  const auto out = mha::io::read_safetensors((dir / "out.safetensors").string());
  CHECK_TENSORS_CLOSE(mha::io::to_tensor<double>(out.at("output"), "output"),
                      layer.forward(x, x, x).output);
}
