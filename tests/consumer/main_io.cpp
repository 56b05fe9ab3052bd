// Uses an installed mha's file I/O through find_package(mha CONFIG REQUIRED) and mha::io.
#include <mha/io/safetensors.hpp>

#include <cstdio>

int main() {
  const auto bytes = mha::io::serialize_safetensors(mha::io::SafetensorsFile{});
  if (bytes.empty()) {
    std::fprintf(stderr, "consumer_io: FAILED: an empty safetensors file serialised to nothing\n");
    return 1;
  }
  std::printf("consumer_io: OK\n");
  return 0;
}
