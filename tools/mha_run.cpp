// mha_run IN.safetensors OUT.safetensors: see kMhaRunHelp in mha_run.hpp, or mha_run --help.
#include <cstring>
#include <exception>
#include <iostream>
#include <new>
#include <string>

#include "mha_run.hpp"

namespace {

// One line on stderr, whatever the message holds, so scripts can rely on it.
int fail(const std::string& message) {
  std::string line = message;
  for (char& c : line) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  std::cerr << "mha_run: " << line << '\n';
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && (std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0)) {
    std::cout << mha::tools::kMhaRunHelp;
    return 0;
  }
  if (argc != 3) return fail("usage: mha_run IN.safetensors OUT.safetensors (see mha_run --help)");
  try {
    const auto in = mha::io::read_safetensors(argv[1]);
    mha::io::write_safetensors(argv[2], mha::tools::run_multihead_attention(in));
    return 0;
  } catch (const std::bad_alloc&) {
    return fail(std::string(argv[1]) + ": out of memory");
  } catch (const std::exception& error) {
    return fail(error.what());
  } catch (...) {
    return fail("unknown error");
  }
}
