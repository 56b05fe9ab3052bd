// Runs a libFuzzer target's LLVMFuzzerTestOneInput on files, without libFuzzer: the committed
// corpus and crash regressions become ordinary tests in every build, with any compiler.
//   fuzz_<name>_replay PATH...   each PATH a file or a directory (its files, in name order)
// A target reports a violation by aborting; an input that was merely refused returns normally.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);

namespace {

namespace fs = std::filesystem;

std::vector<fs::path> inputs_under(const fs::path& path) {
  if (!fs::is_directory(path)) return {path};
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(path)) {
    if (entry.is_regular_file()) files.push_back(entry.path());
  }
  // Name order, so that a failure is reproducible and the log reads the same on every run.
  std::sort(files.begin(), files.end());
  return files;
}

bool run_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "replay: cannot read %s\n", path.string().c_str());
    return false;
  }
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)),
                                std::istreambuf_iterator<char>());
  // Copied into a buffer of exactly its size, so AddressSanitizer sees a read past the end.
  std::vector<std::uint8_t> data(bytes.begin(), bytes.end());
  LLVMFuzzerTestOneInput(data.empty() ? nullptr : data.data(), data.size());
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s FILE_OR_DIRECTORY...\n", argv[0]);
    return 2;
  }
  std::size_t count = 0;
  for (int i = 1; i < argc; ++i) {
    if (!fs::exists(argv[i])) {
      std::fprintf(stderr, "replay: %s does not exist\n", argv[i]);
      return 1;
    }
    for (const fs::path& file : inputs_under(argv[i])) {
      if (!run_file(file)) return 1;
      ++count;
    }
  }
  // An empty corpus would make the test pass without testing anything.
  if (count == 0) {
    std::fprintf(stderr, "replay: no input files under the given paths\n");
    return 1;
  }
  std::printf("replay: %zu inputs ran without a failure\n", count);
  return 0;
}
