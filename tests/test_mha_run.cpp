// mha_run end to end: the real binary on a PyTorch fixture, its help, and malformed input
// (exit code 1 with one line on stderr, never a crash).
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

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
  for (const std::string name : {"f32_everything", "f64_unbatched_masks"}) {
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

TEST_CASE("mha_run --help documents the contract", "[mha_run]") {
  const Run run = run_tool("--help");
  CHECK(run.exit_code == 0);
  for (const char* word : {"num_heads", "key_padding_mask", "attn_mask", "need_weights",
                           "average_attn_weights", "is_causal", "add_zero_attn", "attn_weights"}) {
    CHECK(run.out.find(word) != std::string::npos);
  }
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
  file.tensors["surprise"] = mha::io::from_tensor(mha::Tensor<float>({2}));
  refused_with(file, "unexpected tensor 'surprise'");
  file = original;
  file.tensors["query"] = mha::io::from_tensor(mha::Tensor<bool>({2, 2}));
  refused_with(file, "query: expected dtype F32 or F64, got BOOL");
}
