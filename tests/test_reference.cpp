// Agreement with real PyTorch: every fixture written by tests/reference/generate.py (torch's own
// nn.MultiheadAttention outputs) is run through the library and compared.
// To regenerate the fixtures: /usr/bin/python3 tests/reference/generate.py (see its README).
#include <unistd.h>

#include <algorithm>
#include <filesystem>
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

template <class T>
void compare_tensor(const mha::io::StoredTensor& actual, const mha::io::StoredTensor& expected,
                    const std::string& name) {
  const auto a = mha::io::to_tensor<T>(actual, name);
  const auto e = mha::io::to_tensor<T>(expected, name);
  CHECK_TENSORS_CLOSE(a, e);
}

}  // namespace

TEST_CASE("outputs and weights equal PyTorch's on every reference fixture", "[reference]") {
  const auto names = fixture_names();
  // The generator writes more than 30 configurations; fewer means the fixtures are missing.
  REQUIRE(names.size() >= 30);
  for (const auto& name : names) {
    INFO("fixture " << name << " (" << MHA_REFERENCE_DIR << "/" << name << ".in.safetensors)");
    const auto in =
        mha::io::read_safetensors(std::string(MHA_REFERENCE_DIR) + "/" + name + ".in.safetensors");
    const auto expected = mha::io::read_safetensors(std::string(MHA_REFERENCE_DIR) + "/" + name +
                                                    ".expected.safetensors");
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
    auto in =
        mha::io::read_safetensors(std::string(MHA_REFERENCE_DIR) + "/" + name + ".in.safetensors");
    const auto expected = mha::io::read_safetensors(std::string(MHA_REFERENCE_DIR) + "/" + name +
                                                    ".expected.safetensors");
    in.metadata["kernel"] = "flash";
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

// float fixtures compare with torch's float32 results, whose own rounding the float tolerance must
// absorb. This measures the library's float rounding alone, at a tighter tolerance: the same
// inputs computed in double (the path the float64 fixtures pin to torch at 1e-11) are the truth.
TEST_CASE("float results are within float rounding of the same inputs computed in double",
          "[reference]") {
  for (const auto& name : fixture_names()) {
    const auto in =
        mha::io::read_safetensors(std::string(MHA_REFERENCE_DIR) + "/" + name + ".in.safetensors");
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
      CHECK_TENSORS_CLOSE_TOL(mha::io::to_tensor<double>(single.at(entry.first), entry.first),
                              mha::io::to_tensor<double>(entry.second, entry.first), 1e-5, 1e-6);
    }
  }
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
