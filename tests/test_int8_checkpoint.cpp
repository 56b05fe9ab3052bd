// Tests of mha/io/int8_checkpoint.hpp: a frozen layer with int8 weights saved and loaded comes
// back with the same int8 values and scales and computes the same bits (forward, decode,
// Precision::int8), under the names the header documents; each way a file can fail to be one is
// refused naming the tensor.
#include "mha/io/int8_checkpoint.hpp"

#include <filesystem>
#include <map>
#include <string>

#include "helpers.hpp"

using mha::FrozenMultiHeadAttention;
using mha::FrozenWeights;
using mha::Index;
using mha::MultiHeadAttention;
using mha::MultiHeadAttentionConfig;
using mha::Tensor;
using mha::io::Dtype;
using mha::io::FileError;
using mha::io::SafetensorsFile;

namespace {

FrozenMultiHeadAttention<float> quantized(const MultiHeadAttentionConfig& config) {
  MultiHeadAttention<float> layer(config);
  mha_test::randomise(layer, 3);
  return FrozenMultiHeadAttention<float>(layer, FrozenWeights::int8);
}

void check_same_layer(const FrozenMultiHeadAttention<float>& loaded,
                      const FrozenMultiHeadAttention<float>& original) {
  REQUIRE(loaded.weights_int8());
  const auto expected = original.int8_weights(), actual = loaded.int8_weights();
  REQUIRE(actual.size() == expected.size());
  for (const auto& [name, weight] : expected) {
    INFO(name);
    const auto& other = actual.at(name);
    CHECK(other.outputs == weight.outputs);
    CHECK(other.depth == weight.depth);
    CHECK(other.values == weight.values);
    CHECK(other.scales == weight.scales);
  }
  const Index E = original.config().embed_dim;
  const auto x = mha_test::random_tensor<float>({2, 5, E}, 8);
  for (const auto precision : {mha::Precision::fp32, mha::Precision::int8}) {
    mha::ForwardOptions<float> options;
    options.need_weights = false;
    options.precision = precision;
    CHECK(loaded.forward(x, options).output.flat() == original.forward(x, options).output.flat());
  }
  auto cache = original.layer().make_kv_cache(2, 6),
       other_cache = loaded.layer().make_kv_cache(2, 6);
  original.decode(x, cache);
  loaded.decode(x, other_cache);
  const auto token = mha_test::random_tensor<float>({2, 1, E}, 9);
  CHECK(loaded.decode(token, other_cache).output.flat() ==
        original.decode(token, cache).output.flat());
}

}  // namespace

TEST_CASE("an int8 layer saved and loaded computes the same bits", "[int8][safetensors]") {
  MultiHeadAttentionConfig packed(32, 4);
  MultiHeadAttentionConfig grouped(32, 4);  // q/k/v weights apart, no bias
  grouped.num_kv_heads = 2;
  grouped.bias = false;
  for (const auto& config : {packed, grouped}) {
    const auto original = quantized(config);
    const std::string path =
        (std::filesystem::temp_directory_path() / "mha_int8_checkpoint.safetensors").string();
    mha::io::save_int8(original, path, {{"model", "test"}});
    const auto loaded = mha::io::load_int8(path, config.num_heads);
    std::filesystem::remove(path);
    check_same_layer(loaded, original);
  }
}

TEST_CASE("an int8 file holds the documented names", "[int8][safetensors]") {
  const auto original = quantized(MultiHeadAttentionConfig(32, 4));
  const SafetensorsFile file = mha::io::int8_file(original);
  CHECK(file.metadata.at("mha.weights") == "int8");
  std::map<std::string, Dtype> expected = {
      {"in_proj_weight.int8", Dtype::I8},    {"in_proj_weight.scale", Dtype::F32},
      {"in_proj_bias", Dtype::F32},          {"out_proj.weight.int8", Dtype::I8},
      {"out_proj.weight.scale", Dtype::F32}, {"out_proj.bias", Dtype::F32}};
  REQUIRE(file.tensors.size() == expected.size());
  for (const auto& [name, dtype] : expected) {
    INFO(name);
    REQUIRE(file.has(name));
    CHECK(file.at(name).dtype == dtype);
  }
  CHECK(file.at("in_proj_weight.int8").shape == mha::Shape{96, 32});
  CHECK(file.at("in_proj_weight.scale").shape == mha::Shape{96});
}

TEST_CASE("what is not an int8 file is refused, naming the tensor", "[int8][safetensors][refuse]") {
  const auto original = quantized(MultiHeadAttentionConfig(32, 4));
  const SafetensorsFile good = mha::io::int8_file(original);
  const auto message = [](const SafetensorsFile& file) {
    return mha_test::message_of<FileError>([&] { mha::io::frozen_int8_from_file(file, 4); });
  };
  SafetensorsFile file = good;
  file.metadata.erase("mha.weights");
  CHECK(mha_test::contains(message(file), "expected the metadata entry \"mha.weights\": \"int8\""));
  file = good;
  file.tensors.erase("out_proj.weight.scale");
  CHECK(message(file) ==
        "tensor 'out_proj.weight.int8' has no scales: missing tensor 'out_proj.weight.scale'");
  file = good;
  file.tensors.erase("out_proj.weight.int8");
  CHECK(message(file) == "tensor 'out_proj.weight.scale': scales without their values");
  file = good;
  file.tensors.at("out_proj.weight.int8").bytes[5] = 0x80;
  CHECK(message(file) == "tensor 'out_proj.weight.int8': expected values in [-127, 127], got -128");
  file = good;
  file.tensors.at("in_proj_weight.int8").dtype = Dtype::U8;
  CHECK(message(file) == "tensor 'in_proj_weight.int8': expected I8 [N, K], got U8 [96, 32]");
  file = good;
  file.tensors.at("in_proj_weight.scale") =
      mha::io::from_tensor(Tensor<float>(mha::Shape{95}, 1.0F));
  CHECK(message(file) ==
        "tensor 'in_proj_weight.scale': expected [96], one scale per row of "
        "'in_proj_weight.int8', got [95]");
  file = good;
  file.tensors.at("in_proj_weight.scale") =
      mha::io::from_tensor(Tensor<float>(mha::Shape{96}, -1.0F));
  CHECK(mha_test::contains(message(file), "expected finite scales >= 0"));
  // A layer without int8 weights is not saved as one.
  CHECK(mha_test::message_of<mha::ShapeError>([] {
          mha::io::int8_file(FrozenMultiHeadAttention<float>(MultiHeadAttention<float>(8, 2)));
        }) == "frozen: expected a layer with int8 weights (FrozenWeights::int8), got one without");
}
