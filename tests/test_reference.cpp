// Agreement with real PyTorch: every fixture written by tests/reference/generate.py (torch's own
// nn.MultiheadAttention outputs) is run through the library and compared.
// To regenerate the fixtures: /usr/bin/python3 tests/reference/generate.py (see its README).
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
