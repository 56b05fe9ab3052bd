// The header-only program of the subproject consumers (consumer_add_subdirectory,
// consumer_fetchcontent): mha::mha from mha's source tree, added with add_subdirectory or
// FetchContent. It checks what taking the source tree changes: that the target gives the include
// directory and no MHA_COMPILED, and that the layer's headers compile, link and run in the
// parent's build. A forward call compiled header-only (tests/consumer/main.cpp: 18 s of g++ at
// -O0, the largest unit of the consumer tests) is built by consumer_find_package from the same
// headers, installed; the same program against mha::compiled (consumer_compiled) runs here.
#include <mha/mha.hpp>

#include <cstdio>
#include <map>
#include <string>

#ifndef MHA_VERSION_STRING
#error "MHA_VERSION_STRING is not defined by <mha/mha.hpp>"
#endif
#ifdef MHA_COMPILED
#error "linked to mha::mha (header-only), but MHA_COMPILED is defined"
#endif

int main() {
  int failures = 0;
  const mha::MultiHeadAttention<float> layer(8, 2);
  // PyTorch's state_dict of nn.MultiheadAttention(8, 2): names and shapes.
  const std::map<std::string, mha::Shape> expected = {{"in_proj_weight", {24, 8}},
                                                      {"in_proj_bias", {24}},
                                                      {"out_proj.weight", {8, 8}},
                                                      {"out_proj.bias", {8}}};
  const auto state = layer.state_dict();
  if (state.size() != expected.size()) {
    std::fprintf(stderr, "consumer: FAILED: state_dict has %zu tensors, expected %zu\n",
                 state.size(), expected.size());
    ++failures;
  }
  for (const auto& [name, shape] : expected) {
    const auto found = state.find(name);
    if (found == state.end() || found->second.shape() != shape) {
      std::fprintf(stderr, "consumer: FAILED: state_dict entry %s is missing or misshapen\n",
                   name.c_str());
      ++failures;
    }
  }
  if (failures != 0) return 1;
  std::printf("consumer: OK (mha %s, header-only)\n", MHA_VERSION_STRING);
  return 0;
}
