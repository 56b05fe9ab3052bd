// Uses an installed mha's file I/O through find_package(mha CONFIG REQUIRED): as consumer_io with
// mha::io (header-only, nlohmann/json parsed here), and as consumer_io_compiled, with
// MHA_CONSUMER_COMPILED_IO defined, with mha::compiled alone, whose library holds the file
// functions when mha was built with nlohmann/json (MHA_COMPILED_IO).
#include <mha/io/safetensors.hpp>

#include <cstdio>

#if defined(MHA_CONSUMER_COMPILED_IO) && !defined(MHA_COMPILED_IO)
#error "linked to mha::compiled built with nlohmann/json, but MHA_COMPILED_IO is not defined"
#endif
// The point of the compiled file functions: nothing of nlohmann/json reaches this file.
#if defined(MHA_COMPILED_IO) && defined(NLOHMANN_JSON_VERSION_MAJOR)
#error "<mha/io/safetensors.hpp> included nlohmann/json although mha::compiled holds the file I/O"
#endif

int main() {
  // A tensor through the whole format: serialised, parsed back and converted.
  mha::Tensor<float> tensor({2, 3});
  for (mha::Index i = 0; i < tensor.size(); ++i) tensor.data()[i] = static_cast<float>(i) - 2.5f;
  mha::io::SafetensorsFile file;
  file.metadata["format"] = "pt";
  file.tensors["x"] = mha::io::from_tensor(tensor);
  const auto bytes = mha::io::serialize_safetensors(file);
  const auto parsed = mha::io::parse_safetensors(bytes.data(), bytes.size());
  const auto back = mha::io::to_tensor<float>(parsed.at("x"), "x");
  bool same = back.shape() == tensor.shape() && parsed.metadata.at("format") == "pt";
  for (mha::Index i = 0; same && i < tensor.size(); ++i) same = back.data()[i] == tensor.data()[i];
  if (!same) {
    std::fprintf(stderr, "consumer_io: FAILED: a [2, 3] tensor did not come back from its bytes\n");
    return 1;
  }
#ifdef MHA_COMPILED_IO
  std::printf("consumer_io: OK (file functions from mha::compiled)\n");
#else
  std::printf("consumer_io: OK (header-only)\n");
#endif
  return 0;
}
