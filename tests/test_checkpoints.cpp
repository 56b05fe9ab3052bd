// Tests of mha/io/checkpoints.hpp: the attention layers of synthetic BERT, GPT-2, Llama (BF16,
// GQA), Mistral (head_dim != E / H, multi-query) and Qwen2 (q/k/v biases) checkpoints, written
// with the families' real names, shapes and layouts by tests/reference/generate_checkpoints.py,
// run through the library and compared with torch's float64 output of the same layer; the
// names' prefixes; every refusal; and checks that the comparison catches a wrong conversion.
// To regenerate the fixtures: /usr/bin/python3 tests/reference/generate_checkpoints.py
#include "mha/io/checkpoints.hpp"

#include <algorithm>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "helpers.hpp"

namespace {

using mha::Index;
using mha::Shape;
using mha::Tensor;
using mha::io::FileError;
using mha::io::LlamaAttentionConfig;
using mha::io::LoadedAttention;
using mha::io::SafetensorsFile;
using mha_test::contains;

std::string checkpoint_path(const std::string& name) {
  return std::string(MHA_REFERENCE_DIR) + "/checkpoints/" + name + ".safetensors";
}

SafetensorsFile checkpoint(const std::string& name) {
  return mha::io::read_safetensors(checkpoint_path(name));
}

// x and torch's output of each layer for it.
template <class T>
struct Expected {
  Tensor<T> x;
  std::vector<Tensor<double>> outputs;
  std::map<std::string, std::string> metadata;
};

template <class T>
Expected<T> expected(const std::string& name) {
  const SafetensorsFile file = mha::io::read_safetensors(
      std::string(MHA_REFERENCE_DIR) + "/checkpoints/" + name + ".expected.safetensors");
  Expected<T> out{mha::io::to_tensor<T>(file.at("x"), "x"), {}, file.metadata};
  for (const char* output : {"output.0", "output.1"}) {
    out.outputs.push_back(mha::io::to_tensor<double>(file.at(output), output));
  }
  return out;
}

Index metadata_index(const std::map<std::string, std::string>& metadata, const std::string& key) {
  return static_cast<Index>(std::stol(metadata.at(key)));
}

// A copy of `file` with every tensor name starting with `from` renamed to start with `to`.
SafetensorsFile renamed(const SafetensorsFile& file, const std::string& from,
                        const std::string& to) {
  SafetensorsFile out;
  out.metadata = file.metadata;
  for (const auto& [name, tensor] : file.tensors) {
    const bool match = name.compare(0, from.size(), from) == 0;
    out.tensors.emplace(match ? to + name.substr(from.size()) : name, tensor);
  }
  return out;
}

// Loads both layers with `load` and checks them against torch; returns layer 1 for more checks.
template <class T, class Load>
void check_layers(const std::string& name, Load&& load) {
  const Expected<T> reference = expected<T>(name);
  for (Index layer = 0; layer < 2; ++layer) {
    INFO(name << " layer " << layer);
    const LoadedAttention<T> loaded = load(layer);
    CHECK(loaded.num_layers == 2);
    CHECK_FALSE(loaded.options.need_weights);
    const auto result = loaded.layer.forward(reference.x, loaded.options);
    CHECK_TENSORS_CLOSE(result.output, reference.outputs[static_cast<std::size_t>(layer)]);
  }
}

}  // namespace

TEMPLATE_TEST_CASE("BERT attention layers match torch", "[checkpoints]", float, double) {
  using T = TestType;
  const SafetensorsFile file = checkpoint("bert_f32");
  const Index heads = metadata_index(expected<T>("bert_f32").metadata, "num_heads");
  check_layers<T>("bert_f32",
                  [&](Index layer) { return mha::io::load_bert_attention<T>(file, layer, heads); });
  const LoadedAttention<T> loaded = mha::io::load_bert_attention<T>(file, 1, heads);
  CHECK(loaded.prefix == "bert.encoder.layer.1.attention.");
  CHECK(loaded.layer.embed_dim() == 16);
  CHECK(loaded.layer.num_heads() == 4);
  CHECK(loaded.layer.config().bias);
  CHECK_FALSE(loaded.options.is_causal);
  CHECK_FALSE(loaded.options.rope.has_value());
  // in_proj_weight rows E:2E are W_k exactly as stored (F32 into float or double is exact).
  const Tensor<T> key =
      mha::io::to_tensor<T>(file.at("bert.encoder.layer.1.attention.self.key.weight"), "key");
  const auto packed = loaded.layer.parameter("in_proj_weight");
  CHECK(std::equal(key.data(), key.data() + key.size(), packed.data() + 16 * 16));
}

TEMPLATE_TEST_CASE("GPT-2 attention layers match torch (F16 checkpoint)", "[checkpoints]", float,
                   double) {
  using T = TestType;
  const SafetensorsFile file = checkpoint("gpt2_f16");
  const Index heads = metadata_index(expected<T>("gpt2_f16").metadata, "num_heads");
  check_layers<T>("gpt2_f16",
                  [&](Index layer) { return mha::io::load_gpt2_attention<T>(file, layer, heads); });
  const LoadedAttention<T> loaded = mha::io::load_gpt2_attention<T>(file, 0, heads);
  CHECK(loaded.prefix == "h.0.attn.");
  CHECK(loaded.options.is_causal);
  CHECK_FALSE(loaded.options.rope.has_value());
  CHECK(loaded.layer.embed_dim() == 24);
}

TEMPLATE_TEST_CASE("Llama attention layers match torch (BF16 checkpoint, GQA)", "[checkpoints]",
                   float, double) {
  using T = TestType;
  const SafetensorsFile file = checkpoint("llama_bf16");
  const auto meta = expected<T>("llama_bf16").metadata;
  LlamaAttentionConfig config(metadata_index(meta, "num_heads"),
                              metadata_index(meta, "num_kv_heads"),
                              std::stod(meta.at("rope_theta")));
  check_layers<T>("llama_bf16", [&](Index layer) {
    return mha::io::load_llama_attention<T>(file, layer, config);
  });
  // H_kv and D inferred from the shapes give the same layer.
  check_layers<T>("llama_bf16", [&](Index layer) {
    return mha::io::load_llama_attention<T>(file, layer,
                                            LlamaAttentionConfig(4, 0, config.rope_theta));
  });
  const LoadedAttention<T> loaded = mha::io::load_llama_attention<T>(file, 1, config);
  CHECK(loaded.prefix == "model.layers.1.self_attn.");
  CHECK(loaded.layer.num_kv_heads() == 2);
  CHECK(loaded.layer.head_dim() == 8);
  CHECK_FALSE(loaded.layer.config().bias);
  CHECK(loaded.options.is_causal);
  REQUIRE(loaded.options.rope.has_value());
  CHECK(loaded.options.rope->base == 1000.0);
  CHECK(loaded.options.rope->layout == mha::RopeLayout::rotate_half);
}

// The 16-bit layers load the same checkpoints; their outputs are within 1e-2 of torch's float64
// at the output's scale (their own test, test_half_precision, says why that is the bound).
TEMPLATE_TEST_CASE("16-bit layers load every family's checkpoint", "[checkpoints][half]",
                   Eigen::half, Eigen::bfloat16) {
  using T16 = TestType;
  const auto check = [](const std::string& name, const auto& load) {
    const Expected<double> reference = expected<double>(name);
    const Tensor<T16> x = mha::tensor_cast<T16>(reference.x);
    for (Index layer = 0; layer < 2; ++layer) {
      INFO(name << " layer " << layer);
      const LoadedAttention<T16> loaded = load(layer);
      const Tensor<double> output =
          mha::tensor_cast<double>(loaded.layer.forward(x, loaded.options).output);
      const Tensor<double>& torch = reference.outputs[static_cast<std::size_t>(layer)];
      const double scale = torch.flat().cwiseAbs().maxCoeff();
      CHECK((output.flat() - torch.flat()).cwiseAbs().maxCoeff() <= 1e-2 * scale);
    }
  };
  const SafetensorsFile bert = checkpoint("bert_f32"), gpt2 = checkpoint("gpt2_f16");
  const SafetensorsFile llama = checkpoint("llama_bf16");
  check("bert_f32", [&](Index layer) { return mha::io::load_bert_attention<T16>(bert, layer, 4); });
  check("gpt2_f16", [&](Index layer) { return mha::io::load_gpt2_attention<T16>(gpt2, layer, 3); });
  check("llama_bf16", [&](Index layer) {
    return mha::io::load_llama_attention<T16>(llama, layer, LlamaAttentionConfig(4, 2, 1000));
  });
  // F16 into half and BF16 into bfloat16 are copied bit for bit.
  const bool half = std::is_same_v<T16, Eigen::half>;
  const SafetensorsFile& native = half ? gpt2 : llama;
  const std::string name = half ? "h.1.attn.c_proj.bias" : "model.layers.1.self_attn.o_proj.weight";
  const auto loaded =
      half ? mha::io::load_gpt2_attention<T16>(gpt2, 1, 3)
           : mha::io::load_llama_attention<T16>(llama, 1, LlamaAttentionConfig(4, 2, 1000));
  const auto& bytes = native.at(name).bytes;
  const auto parameter = loaded.layer.parameter(half ? "out_proj.bias" : "out_proj.weight");
  REQUIRE(bytes.size() == static_cast<std::size_t>(parameter.size()) * 2);
  CHECK(std::memcmp(bytes.data(), parameter.data(), bytes.size()) == 0);
}

TEMPLATE_TEST_CASE("Mistral-style layers: head_dim != E / H, multi-query", "[checkpoints]", float,
                   double) {
  using T = TestType;
  const SafetensorsFile file = checkpoint("mistral_f32");
  const auto meta = expected<T>("mistral_f32").metadata;
  LlamaAttentionConfig config(metadata_index(meta, "num_heads"), 0,
                              std::stod(meta.at("rope_theta")));
  config.head_dim = metadata_index(meta, "head_dim");
  check_layers<T>("mistral_f32", [&](Index layer) {
    return mha::io::load_llama_attention<T>(file, layer, config);
  });
  const LoadedAttention<T> loaded = mha::io::load_llama_attention<T>(file, 0, config);
  CHECK(loaded.layer.embed_dim() == 24);
  CHECK(loaded.layer.inner_dim() == 32);
  CHECK(loaded.layer.num_kv_heads() == 1);
}

TEMPLATE_TEST_CASE("Qwen2-style layers: q/k/v biases, no o_proj bias", "[checkpoints]", float,
                   double) {
  using T = TestType;
  const SafetensorsFile file = checkpoint("qwen2_f32");
  const auto meta = expected<T>("qwen2_f32").metadata;
  const LlamaAttentionConfig config(metadata_index(meta, "num_heads"),
                                    metadata_index(meta, "num_kv_heads"),
                                    std::stod(meta.at("rope_theta")));
  check_layers<T>("qwen2_f32", [&](Index layer) {
    return mha::io::load_llama_attention<T>(file, layer, config);
  });
  const LoadedAttention<T> loaded = mha::io::load_llama_attention<T>(file, 1, config);
  CHECK(loaded.layer.config().bias);
  const auto out_bias = loaded.layer.parameter("out_proj.bias");
  CHECK(std::all_of(out_bias.data(), out_bias.data() + out_bias.size(),
                    [](T value) { return value == T(0); }));
}

TEMPLATE_TEST_CASE("Llama without GQA loads into the packed projection", "[checkpoints]", float,
                   double) {
  // Repeating each key/value head's rows H / H_kv times turns the GQA layer into a plain one with
  // the same output (what repeat_kv computes), which the loader packs into in_proj_weight.
  using T = TestType;
  SafetensorsFile file = checkpoint("llama_bf16");
  const Index kv_heads = 2, heads = 4, head_dim = 8, embed = 32;
  for (Index layer = 0; layer < 2; ++layer) {
    for (const char* part : {"k_proj", "v_proj"}) {
      const std::string name =
          "model.layers." + std::to_string(layer) + ".self_attn." + part + ".weight";
      const Tensor<T> narrow = mha::io::to_tensor<T>(file.at(name), name);
      Tensor<T> wide({heads * head_dim, embed});
      for (Index h = 0; h < heads; ++h) {
        const T* from = narrow.data() + (h / (heads / kv_heads)) * head_dim * embed;
        std::copy(from, from + head_dim * embed, wide.data() + h * head_dim * embed);
      }
      file.tensors[name] = mha::io::from_tensor(wide);
    }
  }
  const LlamaAttentionConfig config(heads, 0, 1000.0);
  check_layers<T>("llama_bf16", [&](Index layer) {
    return mha::io::load_llama_attention<T>(file, layer, config);
  });
  const LoadedAttention<T> loaded = mha::io::load_llama_attention<T>(file, 0, config);
  CHECK(loaded.layer.num_kv_heads() == heads);
  CHECK(loaded.layer.has_parameter("in_proj_weight"));
}

TEMPLATE_TEST_CASE("Names are found under any prefix, or none", "[checkpoints]", float, double) {
  using T = TestType;
  const SafetensorsFile bert = checkpoint("bert_f32");
  for (const std::string prefix : {"", "roberta.", "model.bert."}) {
    INFO("prefix '" << prefix << "'");
    const SafetensorsFile file = renamed(bert, "bert.", prefix);
    check_layers<T>("bert_f32",
                    [&](Index layer) { return mha::io::load_bert_attention<T>(file, layer, 4); });
    CHECK(mha::io::load_bert_attention<T>(file, 1, 4).prefix ==
          prefix + "encoder.layer.1.attention.");
  }
  const SafetensorsFile gpt2 = renamed(checkpoint("gpt2_f16"), "", "transformer.");
  check_layers<T>("gpt2_f16",
                  [&](Index layer) { return mha::io::load_gpt2_attention<T>(gpt2, layer, 3); });
  const SafetensorsFile llama = renamed(checkpoint("llama_bf16"), "model.", "");
  check_layers<T>("llama_bf16", [&](Index layer) {
    return mha::io::load_llama_attention<T>(llama, layer, LlamaAttentionConfig(4, 2, 1000.0));
  });
  // From a path: the whole file is read first.
  check_layers<T>("gpt2_f16", [&](Index layer) {
    return mha::io::load_gpt2_attention<T>(checkpoint_path("gpt2_f16"), layer, 3);
  });
}

TEST_CASE("Missing tensors, wrong shapes and dtypes are refused with their names",
          "[checkpoints]") {
  const SafetensorsFile bert = checkpoint("bert_f32");
  const std::string layer1 = "bert.encoder.layer.1.attention.";
  {
    SafetensorsFile file = bert;
    file.tensors.erase(layer1 + "self.key.bias");
    CHECK(
        mha_test::message_of<FileError>([&] { mha::io::load_bert_attention<float>(file, 1, 4); }) ==
        "BERT attention layer 1: missing tensor "
        "'bert.encoder.layer.1.attention.self.key.bias'");
    CHECK_NOTHROW(mha::io::load_bert_attention<float>(file, 0, 4));
  }
  {
    SafetensorsFile file = bert;
    file.tensors.erase(layer1 + "output.dense.weight");
    CHECK(mha_test::message_of<FileError>(
              [&] { mha::io::load_bert_attention<double>(file, 1, 4); }) ==
          "BERT attention layer 1: missing tensor "
          "'bert.encoder.layer.1.attention.output.dense.weight'");
  }
  {
    SafetensorsFile file = bert;
    file.tensors[layer1 + "self.value.weight"] = mha::io::from_tensor(Tensor<float>({16, 8}, 0.0f));
    CHECK(
        mha_test::message_of<FileError>([&] { mha::io::load_bert_attention<float>(file, 1, 4); }) ==
        "BERT attention layer 1: tensor 'bert.encoder.layer.1.attention.self.value.weight': "
        "expected shape [16, 16] ([E, E], E = 16), got [16, 8]");
  }
  {
    SafetensorsFile file = bert;
    file.tensors[layer1 + "self.query.weight"] = mha::io::from_tensor(Tensor<float>({16}, 0.0f));
    CHECK(
        mha_test::message_of<FileError>([&] { mha::io::load_bert_attention<float>(file, 1, 4); }) ==
        "BERT attention layer 1: tensor 'bert.encoder.layer.1.attention.self.query.weight': "
        "expected shape [E, E] with positive sizes, got [16]");
  }
  {
    SafetensorsFile file = bert;
    mha::io::StoredTensor& bias = file.tensors[layer1 + "output.dense.bias"];
    bias.dtype = mha::io::Dtype::I32;
    const std::string message =
        mha_test::message_of<FileError>([&] { mha::io::load_bert_attention<float>(file, 1, 4); });
    CHECK(contains(message,
                   "BERT attention layer 1: tensor "
                   "'bert.encoder.layer.1.attention.output.dense.bias': expected dtype "
                   "F32, F64, F16 or BF16 to read as float, got I32"));
  }
  {
    // GPT-2's c_attn in nn.Linear's layout, as a careless converter would write it.
    SafetensorsFile file = checkpoint("gpt2_f16");
    file.tensors["h.1.attn.c_attn.weight"].shape = {72, 24};
    CHECK(
        mha_test::message_of<FileError>([&] { mha::io::load_gpt2_attention<float>(file, 1, 3); }) ==
        "GPT-2 attention layer 1: tensor 'h.1.attn.c_attn.weight' has shape [72, 24], "
        "nn.Linear's [3E, E]; GPT-2's Conv1D stores [E, 3E] (transposed)");
    CHECK_NOTHROW(mha::io::load_gpt2_attention<float>(file, 0, 3));
    file.tensors["h.1.attn.c_attn.weight"].shape = {24, 70};
    CHECK(
        mha_test::message_of<FileError>([&] { mha::io::load_gpt2_attention<float>(file, 1, 3); }) ==
        "GPT-2 attention layer 1: tensor 'h.1.attn.c_attn.weight': expected shape [E, 3E] "
        "(Conv1D: [in, out]), got [24, 70]");
  }
  {
    SafetensorsFile file = checkpoint("gpt2_f16");
    file.tensors["h.1.attn.c_proj.bias"].shape = {1, 24};
    CHECK(
        mha_test::message_of<FileError>([&] { mha::io::load_gpt2_attention<float>(file, 1, 3); }) ==
        "GPT-2 attention layer 1: tensor 'h.1.attn.c_proj.bias': expected shape [24] ([E], "
        "E = 24), got [1, 24]");
  }
  {
    SafetensorsFile file = checkpoint("llama_bf16");
    file.tensors.erase("model.layers.0.self_attn.o_proj.weight");
    CHECK(mha_test::message_of<FileError>([&] {
            mha::io::load_llama_attention<float>(file, 0, LlamaAttentionConfig(4, 2, 1000.0));
          }) == "Llama attention layer 0: missing tensor 'model.layers.0.self_attn.o_proj.weight'");
    file = checkpoint("llama_bf16");
    file.tensors["model.layers.1.self_attn.v_proj.weight"] =
        mha::io::from_tensor(Tensor<float>({8, 32}, 0.0f));
    CHECK(mha_test::message_of<FileError>([&] {
            mha::io::load_llama_attention<float>(file, 1, LlamaAttentionConfig(4, 2, 1000.0));
          }) ==
          "Llama attention layer 1: tensor 'model.layers.1.self_attn.v_proj.weight': "
          "expected shape [16, 32] ([H_kv·D, E], E = 32, D = 8), got [8, 32]");
  }
  {
    // A q bias without the k and v biases is a broken attention_bias checkpoint.
    SafetensorsFile file = checkpoint("llama_bf16");
    file.tensors["model.layers.1.self_attn.q_proj.bias"] =
        mha::io::from_tensor(Tensor<float>({32}, 0.0f));
    CHECK(mha_test::message_of<FileError>([&] {
            mha::io::load_llama_attention<float>(file, 1, LlamaAttentionConfig(4, 2, 1000.0));
          }) == "Llama attention layer 1: missing tensor 'model.layers.1.self_attn.k_proj.bias'");
  }
}

TEST_CASE("Files without the family's layers, or with two prefixes, are refused", "[checkpoints]") {
  const SafetensorsFile gpt2 = checkpoint("gpt2_f16");
  CHECK(mha_test::message_of<FileError>([&] { mha::io::load_bert_attention<float>(gpt2, 0, 3); }) ==
        "no BERT attention layer in the file: no tensor named "
        "[PREFIX]encoder.layer.{i}.attention.self.query.weight");
  CHECK(mha_test::message_of<FileError>(
            [&] { mha::io::load_llama_attention<float>(gpt2, 0, LlamaAttentionConfig(3)); }) ==
        "no Llama attention layer in the file: no tensor named "
        "[PREFIX]layers.{i}.self_attn.q_proj.weight");
  SafetensorsFile twice = checkpoint("bert_f32");
  for (const auto& [name, tensor] : checkpoint("bert_f32").tensors) {
    twice.tensors.emplace("roberta." + name.substr(5), tensor);
  }
  CHECK(mha_test::message_of<FileError>([&] {
          mha::io::load_bert_attention<float>(twice, 0, 4);
        }) == "BERT attention layers under more than one prefix: 'bert.', 'roberta.'");
  // Look-alike names are not layers: a leading zero, or no '.' before the stem.
  SafetensorsFile odd;
  odd.tensors["model.layers.01.self_attn.q_proj.weight"] =
      mha::io::from_tensor(Tensor<float>({8, 8}, 0.0f));
  odd.tensors["modellayers.0.self_attn.q_proj.weight"] =
      mha::io::from_tensor(Tensor<float>({8, 8}, 0.0f));
  CHECK(contains(mha_test::message_of<FileError>([&] {
                   mha::io::load_llama_attention<float>(odd, 0, LlamaAttentionConfig(2));
                 }),
                 "no Llama attention layer in the file"));
  // From a path, messages name the file.
  const std::string missing = checkpoint_path("no_such_checkpoint");
  CHECK(contains(
      mha_test::message_of<FileError>([&] { mha::io::load_gpt2_attention<float>(missing, 0, 3); }),
      "no_such_checkpoint.safetensors"));
  CHECK(mha_test::message_of<FileError>([&] {
          mha::io::load_bert_attention<float>(checkpoint_path("gpt2_f16"), 0, 3);
        }) == "safetensors file '" + checkpoint_path("gpt2_f16") +
                  "': no BERT attention layer in the file: no tensor named "
                  "[PREFIX]encoder.layer.{i}.attention.self.query.weight");
}

TEST_CASE("Bad arguments are refused: layer index, num_heads, num_kv_heads, head_dim, rope_theta",
          "[checkpoints]") {
  using mha::ShapeError;
  const SafetensorsFile bert = checkpoint("bert_f32");
  CHECK(mha_test::message_of<ShapeError>([&] {
          mha::io::load_bert_attention<float>(bert, 2, 4);
        }) == "layer: must be in [0, 2) for the 2 BERT attention layers of this file, got 2");
  CHECK(mha_test::message_of<ShapeError>([&] {
          mha::io::load_bert_attention<float>(bert, -1, 4);
        }) == "layer: must be in [0, 2) for the 2 BERT attention layers of this file, got -1");
  CHECK(
      mha_test::message_of<ShapeError>([&] { mha::io::load_bert_attention<float>(bert, 0, 3); }) ==
      "num_heads: embed_dim 16 (from 'bert.encoder.layer.0.attention.self.query.weight') is "
      "not divisible by num_heads 3");
  CHECK(mha_test::message_of<ShapeError>([&] {
          mha::io::load_bert_attention<float>(bert, 0, 0);
        }) == "num_heads: must be positive, got 0");
  const SafetensorsFile gpt2 = checkpoint("gpt2_f16");
  CHECK(mha_test::message_of<ShapeError>([&] {
          mha::io::load_gpt2_attention<double>(gpt2, 5, 3);
        }) == "layer: must be in [0, 2) for the 2 GPT-2 attention layers of this file, got 5");
  CHECK(
      mha_test::message_of<ShapeError>([&] { mha::io::load_gpt2_attention<double>(gpt2, 0, 5); }) ==
      "num_heads: embed_dim 24 (from 'h.0.attn.c_attn.weight') is not divisible by "
      "num_heads 5");

  const SafetensorsFile llama = checkpoint("llama_bf16");  // E = 32, H = 4, H_kv = 2, D = 8
  const auto llama_error = [&](const LlamaAttentionConfig& config) {
    return mha_test::message_of<ShapeError>(
        [&] { mha::io::load_llama_attention<float>(llama, 1, config); });
  };
  CHECK(llama_error(LlamaAttentionConfig(3, 0, 1000.0)) ==
        "num_heads: the 32 rows (H·D) of 'model.layers.1.self_attn.q_proj.weight' are not "
        "divisible by num_heads 3");
  // num_heads 8 would make D = 4 and H_kv = 4, a layer the shapes allow; num_kv_heads 2 says
  // otherwise.
  CHECK(llama_error(LlamaAttentionConfig(8, 2, 1000.0)) ==
        "num_kv_heads: got 2, but 'model.layers.1.self_attn.k_proj.weight' has 16 rows (H_kv·D) "
        "for heads of D = 4");
  LlamaAttentionConfig with_head_dim(4, 2, 1000.0);
  with_head_dim.head_dim = 16;
  CHECK(llama_error(with_head_dim) ==
        "head_dim: got 16, but the 32 rows (H·D) of 'model.layers.1.self_attn.q_proj.weight' "
        "with num_heads 4 make it 8");
  CHECK(llama_error(LlamaAttentionConfig(32, 0, 1000.0)) ==
        "head_dim: rotary embeddings rotate pairs: it must be even, got 1 (32 rows of "
        "'model.layers.1.self_attn.q_proj.weight' / num_heads 32)");
  CHECK(llama_error(LlamaAttentionConfig(1, 0, 1000.0)) ==
        "num_heads: 1 heads of D = 32 do not fit 'model.layers.1.self_attn.k_proj.weight''s 16 "
        "rows: they must hold H_kv·D for a divisor H_kv of num_heads");
  CHECK(llama_error(LlamaAttentionConfig(4, -1, 1000.0)) ==
        "num_kv_heads: must be positive (or 0 to infer it), got -1");
  CHECK(contains(llama_error(LlamaAttentionConfig(4, 2, 0.0)),
                 "rope_theta: must be finite and positive, got 0"));
  CHECK(llama_error(LlamaAttentionConfig(4, 2, 1000.0)) == "(nothing thrown)");
}

TEMPLATE_TEST_CASE("The comparison catches a wrong conversion or wrong options", "[checkpoints]",
                   float, double) {
  // Each of these mistakes must fail the tolerance the tests above pass with.
  using T = TestType;
  const auto misses = [](const Tensor<T>& actual, const Tensor<double>& reference) {
    return !mha_test::compare(actual, reference).ok;
  };
  {
    // Conv1D read as if it were nn.Linear: c_attn.weight's [E, 3E] bytes taken as [3E, E].
    const SafetensorsFile file = checkpoint("gpt2_f16");
    const Expected<T> reference = expected<T>("gpt2_f16");
    LoadedAttention<T> loaded = mha::io::load_gpt2_attention<T>(file, 1, 3);
    Tensor<T> not_transposed =
        mha::io::to_tensor<T>(file.at("h.1.attn.c_attn.weight"), "c_attn.weight");
    not_transposed.reshape({72, 24});
    loaded.layer.set_parameter("in_proj_weight", not_transposed);
    CHECK(misses(loaded.layer.forward(reference.x, loaded.options).output, reference.outputs[1]));
  }
  {
    const SafetensorsFile file = checkpoint("llama_bf16");
    const Expected<T> reference = expected<T>("llama_bf16");
    const LoadedAttention<T> loaded =
        mha::io::load_llama_attention<T>(file, 1, LlamaAttentionConfig(4, 2, 1000.0));
    mha::ForwardOptions<T> options = loaded.options;
    options.rope->base = 10000;  // the default theta instead of the checkpoint's
    CHECK(misses(loaded.layer.forward(reference.x, options).output, reference.outputs[1]));
    options = loaded.options;
    options.rope->layout = mha::RopeLayout::interleaved;
    CHECK(misses(loaded.layer.forward(reference.x, options).output, reference.outputs[1]));
    options = loaded.options;
    options.is_causal = false;
    CHECK(misses(loaded.layer.forward(reference.x, options).output, reference.outputs[1]));
    // The other layer's output.
    CHECK(misses(loaded.layer.forward(reference.x, loaded.options).output, reference.outputs[0]));
  }
}
