// A layer's forward and decoding with user mods (flex_forward, flex_decode, mha/flex_layer.hpp):
// forward, and decoding a prompt and then a few tokens at a time, give the outputs of one float64
// forward whose attn_mask holds the mods written out (each by its definition); a packed batch's
// sequences see their places as b; a mod-defined window decodes as the built-in window, bit for
// bit, in every cache format; a block mask, a mask_mod and a paged cache give the same bits; and
// what they refuse, decoding refuses before the cache changes.
#include <atomic>
#include <cmath>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "helpers.hpp"
#include "mha/flex_layer.hpp"
#include "mha/mods.hpp"

using mha::Index;
using mha::KVCache;
using mha::MultiHeadAttention;
using mha::MultiHeadAttentionConfig;
using mha::Tensor;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Grouped-query attention (two query heads per key/value head), two sequences.
constexpr Index kEmbed = 64, kHeads = 4, kKvHeads = 2, kBatch = 2;
// A prompt of more than one of the decoding kernel's chunks (240 keys), taken by the flash kernel
// (16 or more new tokens), then steps of 3 and of 1 token, which the decoding kernel takes.
constexpr Index kPrompt = 262;
const std::vector<Index> kSteps{kPrompt, 3, 1, 1, 2, 1, 1, 1, 1, 1};

MultiHeadAttention<float> float_layer() {
  MultiHeadAttentionConfig config(kEmbed, kHeads);
  config.num_kv_heads = kKvHeads;
  MultiHeadAttention<float> layer(config);
  mha_test::randomise(layer, 71);
  return layer;
}

Index total_length() {
  Index total = 0;
  for (const Index n : kSteps) total += n;
  return total;
}

// Rows [first, first + count) of x [B, L, E].
Tensor<float> rows(const Tensor<float>& x, Index first, Index count) {
  Tensor<float> part({x.dim(0), count, x.dim(2)});
  for (Index b = 0; b < x.dim(0); ++b) part[b].matrix() = x[b].matrix().middleRows(first, count);
  return part;
}

// Decodes x in kSteps with `step` (a call of flex_decode or decode on the cache) and returns
// the outputs [B, L, E].
Tensor<float> decode_all(const Tensor<float>& x,
                         const std::function<Tensor<float>(const Tensor<float>&)>& step) {
  Tensor<float> outputs(x.shape());
  Index first = 0;
  for (const Index count : kSteps) {
    const Tensor<float> out = step(rows(x, first, count));
    for (Index b = 0; b < x.dim(0); ++b) {
      outputs[b].matrix().middleRows(first, count) = out[b].matrix();
    }
    first += count;
  }
  return outputs;
}

// The float64 truth: the layer's forward over the whole sequence, causal, with attn_mask [B·H,
// L, L] = bias(b, h, i, j) where visible(b, h, i, j), else -inf.
Tensor<double> truth(const MultiHeadAttention<float>& layer, const Tensor<float>& x,
                     const std::function<double(Index, Index, Index, Index)>& bias,
                     const std::function<bool(Index, Index, Index, Index)>& visible,
                     bool causal = true) {
  const auto exact = mha_test::converted<double>(layer);
  const Index length = x.dim(1);
  Tensor<double> mask({kBatch * kHeads, length, length});
  for (Index b = 0; b < kBatch; ++b) {
    for (Index h = 0; h < kHeads; ++h) {
      auto m = mask[b * kHeads + h].matrix();
      for (Index i = 0; i < length; ++i) {
        for (Index j = 0; j < length; ++j) {
          m(i, j) = visible(b, h, i, j) ? bias(b, h, i, j) : -kInf;
        }
      }
    }
  }
  mha::ForwardOptions<double> options;
  options.need_weights = false;
  options.is_causal = causal;
  options.attn_mask = mha::Mask<double>::additive(std::move(mask));
  return exact.forward(mha::tensor_cast<double>(x), options).output;
}

// The first `count` rows of x [B, L, E].
Tensor<double> rows_of(const Tensor<double>& x, Index count) {
  Tensor<double> part({x.dim(0), count, x.dim(2)});
  for (Index b = 0; b < x.dim(0); ++b) part[b].matrix() = x[b].matrix().topRows(count);
  return part;
}

// ALiBi's bias of head h, query i and key j, written out.
std::function<double(Index, Index, Index, Index)> alibi_bias(std::vector<float> slopes) {
  return [slopes = std::move(slopes)](Index, Index h, Index i, Index j) {
    return -static_cast<double>(slopes[static_cast<std::size_t>(h)]) *
           static_cast<double>(std::abs(i - j));
  };
}

// The bound of decoding against the whole forward (test_kv_cache.cpp's): 1e-5 of the output's
// largest element.
void check_decoded(const Tensor<float>& decoded, const Tensor<double>& exact) {
  const double scale = exact.flat().cwiseAbs().maxCoeff();
  CHECK_TENSORS_CLOSE_TOL(decoded, exact, 0.0, 1e-5 * scale);
}

Tensor<float> input() {
  return mha_test::random_tensor<float>({kBatch, total_length(), kEmbed}, 72);
}

KVCache<float> cache_for(const MultiHeadAttention<float>& layer,
                         mha::KVCacheFormat format = mha::KVCacheFormat::as_layer) {
  return layer.make_kv_cache(kBatch, total_length(), -1, format);
}

std::vector<float> relative_table(Index reach) {
  std::vector<float> table(static_cast<std::size_t>(kHeads * (2 * reach + 1)));
  mha::Random random(73);
  for (float& value : table) value = static_cast<float>(random.normal());
  return table;
}

}  // namespace

TEST_CASE("flex_decode: mods give the whole forward's outputs with the mods written out",
          "[flex][decode]") {
  const auto layer = float_layer();
  const Tensor<float> x = input();
  const Index length = total_length();

  SECTION("a learned relative bias (call per score) and a window mask_mod reading b") {
    const Index reach = 9;
    const mha::mods::RelativeBias<float> bias{relative_table(reach), reach};
    // Sequence 0 sees 40 keys back, sequence 1 only 12: past the first chunk for both.
    const auto window = [](Index b, Index /*h*/, Index q_idx, Index kv_idx) {
      return q_idx - kv_idx < (b == 0 ? 40 : 12);
    };
    auto cache = cache_for(layer);
    const auto decoded = decode_all(x, [&](const Tensor<float>& step) {
      return mha::flex_decode(layer, step, cache, bias, window).output;
    });
    const auto exact = truth(
        layer, x,
        [&](Index, Index h, Index i, Index j) {
          const Index column = std::clamp<Index>(j - i, -reach, reach) + reach;
          return static_cast<double>(
              bias.table[static_cast<std::size_t>(h * (2 * reach + 1) + column)]);
        },
        [](Index b, Index, Index i, Index j) { return i - j < (b == 0 ? 40 : 12); });
    check_decoded(decoded, exact);
    CHECK(cache.length(0) == length);
  }

  SECTION("ALiBi (the row form) and documents, by a block mask built for the longest sequence") {
    const auto slopes = mha::alibi_slopes<float>(kHeads);
    const mha::mods::Alibi<float> alibi{slopes, 0};
    // Documents of 100 tokens, the last one still growing.
    std::vector<Index> cu_seqlens;
    for (Index start = 0; start < length; start += 100) cu_seqlens.push_back(start);
    cu_seqlens.push_back(length);
    const auto documents = mha::mods::document(cu_seqlens);
    const auto block_mask = mha::create_block_mask(documents, 1, 1, length, length);
    auto cache = cache_for(layer);
    const auto decoded = decode_all(x, [&](const Tensor<float>& step) {
      return mha::flex_decode(layer, step, cache, alibi, block_mask).output;
    });
    const auto exact = truth(layer, x, alibi_bias(slopes),
                             [](Index, Index, Index i, Index j) { return i / 100 == j / 100; });
    check_decoded(decoded, exact);
  }
}

TEST_CASE("flex_decode: a mod-defined window equals the built-in window, bit for bit",
          "[flex][decode]") {
  // The same -inf for the same pairs, the same scores elsewhere: the same bits, in the decoding
  // kernel's paths for each cache format and in the flash kernel's for the prompt.
  const auto layer = float_layer();
  const Tensor<float> x = input();
  const Index length = total_length();
  const auto window = mha::mods::SlidingWindow{20, 0};
  const auto block_mask = mha::create_block_mask(window, 1, 1, length, length);
  for (const auto format :
       {mha::KVCacheFormat::as_layer, mha::KVCacheFormat::q8, mha::KVCacheFormat::q4}) {
    INFO("cache format " << static_cast<int>(format));
    auto options = MultiHeadAttention<float>::decode_options();
    options.window = mha::Window{20, 0};
    auto built_in_cache = cache_for(layer, format);
    const auto built_in = decode_all(x, [&](const Tensor<float>& step) {
      return layer.decode(step, built_in_cache, options).output;
    });
    auto mod_cache = cache_for(layer, format), block_cache = cache_for(layer, format);
    const auto by_mod = decode_all(x, [&](const Tensor<float>& step) {
      return mha::flex_decode(layer, step, mod_cache, mha::no_score_mod, window).output;
    });
    const auto by_blocks = decode_all(x, [&](const Tensor<float>& step) {
      return mha::flex_decode(layer, step, block_cache, mha::no_score_mod, block_mask).output;
    });
    // The steps after the prompt, in the decoding kernel: the same bits.
    const auto after_prompt = [&](const Tensor<float>& outputs) {
      return rows(outputs, kPrompt, length - kPrompt);
    };
    CHECK(after_prompt(by_mod).flat() == after_prompt(built_in).flat());
    CHECK(after_prompt(by_blocks).flat() == after_prompt(built_in).flat());
    // The prompt, in the flash kernel, which visits the keys in other blocks with a mod (all of
    // them, or the block mask's runs) than with the built-in window (from the window's first):
    // each against float64 where the cache holds the layer's rows, and where it quantizes them
    // (the prompt attends to its stored rows), against the built-in window over the same rows.
    if (format == mha::KVCacheFormat::as_layer) {
      const auto exact = truth(
          layer, x, [](Index, Index, Index, Index) { return 0.0; },
          [](Index, Index, Index i, Index j) { return i - j <= 20; });
      for (const Tensor<float>* outputs : {&built_in, &by_mod, &by_blocks}) {
        check_decoded(rows(*outputs, 0, kPrompt), rows_of(exact, kPrompt));
      }
    } else {
      const auto prompt = mha::tensor_cast<double>(rows(built_in, 0, kPrompt));
      check_decoded(rows(by_mod, 0, kPrompt), prompt);
      check_decoded(rows(by_blocks, 0, kPrompt), prompt);
    }
  }
}

TEST_CASE("flex_decode: a paged cache gives a KVCache's bits, its sequences' places as b",
          "[flex][decode][paged]") {
  const auto layer = float_layer();
  const Tensor<float> x = input();
  const auto parity = [](Index b, Index h, Index q_idx, Index kv_idx) {
    return (kv_idx + b + h) % 3 != 0 || kv_idx == q_idx;
  };
  const mha::mods::Softcap<float> softcap{8.0F};
  auto contiguous = cache_for(layer);
  const auto expected = decode_all(x, [&](const Tensor<float>& step) {
    return mha::flex_decode(layer, step, contiguous, softcap, parity).output;
  });
  mha::PagedKVCache<float> paged = layer.make_paged_kv_cache(48, 16);
  // Added in the other order: the mods' b is a sequence's place in the step, not its id.
  const Index second = paged.add_sequence(), first = paged.add_sequence();
  const auto decoded = decode_all(x, [&](const Tensor<float>& step) {
    return mha::flex_decode(layer, step, paged, {first, second}, softcap, parity).output;
  });
  CHECK(decoded.flat() == expected.flat());
}

TEST_CASE("flex_decode: refusals, before the cache changes", "[flex][decode][errors]") {
  const auto layer = float_layer();
  auto cache = cache_for(layer);
  const Tensor<float> step = mha_test::random_tensor<float>({kBatch, 5, kEmbed}, 74);
  (void)mha::flex_decode(layer, step, cache, mha::no_score_mod);
  const auto unchanged = [&] { CHECK(cache.length(0) == 5); };

  // A block mask that does not reach the step's last token (10), or built for 3 sequences.
  const auto short_mask = mha::create_block_mask(mha::mods::causal(), 1, 1, 9, 9);
  CHECK(mha_test::contains(mha_test::message_of<mha::ShapeError>([&] {
                             (void)mha::flex_decode(layer, step, cache, mha::no_score_mod,
                                                    short_mask);
                           }),
                           "block_mask"));
  unchanged();
  const auto three = mha::create_block_mask(mha::mods::causal(), 3, 1, 64, 64);
  CHECK_THROWS_AS(mha::flex_decode(layer, step, cache, mha::no_score_mod, three), mha::ShapeError);
  unchanged();
  // The reference kernel takes no mods.
  auto options = MultiHeadAttention<float>::decode_options();
  options.kernel = mha::Kernel::reference;
  CHECK(mha_test::contains(mha_test::message_of<std::invalid_argument>([&] {
                             (void)mha::flex_decode(layer, step, cache, mha::no_score_mod,
                                                    mha::AllVisible{}, options);
                           }),
                           "options.kernel"));
  unchanged();
  // Nor does a layer with talking heads.
  MultiHeadAttentionConfig talking_config(kEmbed, kHeads);
  talking_config.talking_heads_pre = true;
  const MultiHeadAttention<float> talking(talking_config);
  auto talking_cache = talking.make_kv_cache(kBatch, 16);
  CHECK_THROWS_AS(mha::flex_decode(talking, step, talking_cache, mha::no_score_mod),
                  std::invalid_argument);
  CHECK(talking_cache.length(0) == 0);
}

TEST_CASE("flex_decode: a mod that throws makes the step throw; the sequences it reached keep it",
          "[flex][decode][errors]") {
  const auto layer = float_layer();
  // The decoding kernel (every sequence's keys stored before it runs), the flash kernel (one
  // sequence after another: the first throws, the second is not reached).
  for (const Index count : {Index(1), Index(20)}) {
    INFO("new tokens " << count);
    auto cache = cache_for(layer);
    const Tensor<float> step = mha_test::random_tensor<float>({kBatch, count, kEmbed}, 75);
    std::atomic<int> calls{0};
    const auto throwing = [&](auto score, Index, Index, Index, Index kv_idx) {
      if (kv_idx == 0 && calls.fetch_add(1) == 0) throw std::runtime_error("mod failed");
      return score;
    };
    CHECK_THROWS_AS(mha::flex_decode(layer, step, cache, throwing), std::runtime_error);
    CHECK(cache.length(0) == count);
    CHECK(cache.length(1) == (count == 1 ? 1 : 0));
    const auto next = mha::flex_decode(layer, rows(step, 0, 1), cache, throwing);
    CHECK(next.output.flat().allFinite());
  }
}

TEST_CASE("flex_forward: mods give forward's outputs with the mods written out",
          "[flex][forward]") {
  const auto layer = float_layer();
  const Tensor<float> x = input();
  const Index length = total_length();
  // T5's bidirectional bias (an encoder: not causal) and a mask_mod reading b; then causal ALiBi
  // by a block mask built for a longer sequence than the call's.
  std::vector<float> table(static_cast<std::size_t>(kHeads * 32));
  mha::Random random(76);
  for (float& value : table) value = static_cast<float>(random.normal());
  const auto t5 = mha::mods::t5_bias(table, 32, 128, true);
  const auto stripes = [](Index b, Index /*h*/, Index q_idx, Index kv_idx) {
    return (q_idx + kv_idx + b) % 5 != 0 || q_idx == kv_idx;
  };
  const auto by_mod = mha::flex_forward(layer, x, t5, stripes);
  check_decoded(
      by_mod.output,
      truth(
          layer, x,
          [&](Index, Index h, Index i, Index j) {
            return static_cast<double>(table[static_cast<std::size_t>(
                h * 32 + mha::mods::t5_bucket(j - i, 32, 128, true))]);
          },
          [](Index b, Index, Index i, Index j) { return (i + j + b) % 5 != 0 || i == j; }, false));

  const mha::mods::Alibi<float> alibi{mha::alibi_slopes<float>(kHeads), 0};
  const auto causal = mha::create_block_mask(mha::mods::causal(), 1, 1, length + 50, length + 50);
  const auto by_blocks = mha::flex_forward(layer, x, alibi, causal);
  check_decoded(by_blocks.output, truth(layer, x, alibi_bias(alibi.slopes),
                                        [](Index, Index, Index, Index) { return true; }));
}

TEST_CASE("flex_forward: a packed batch's sequences are b = 0, 1, ... to the mods",
          "[flex][forward][varlen]") {
  const auto layer = float_layer();
  const std::vector<Index> lengths{70, 130, 45};
  const std::vector<Index> cu_seqlens{0, 70, 200, 245};
  const Tensor<float> packed = mha_test::random_tensor<float>({245, kEmbed}, 77);
  // A window whose width depends on b.
  const auto window = [](Index b, Index /*h*/, Index q_idx, Index kv_idx) {
    return kv_idx <= q_idx && q_idx - kv_idx < 10 * (b + 1);
  };
  auto options = mha::flex_forward_options<float>();
  options.cu_seqlens = cu_seqlens;
  const auto together = mha::flex_forward(layer, packed, mha::no_score_mod, window, options);
  for (Index s = 0; s < 3; ++s) {
    INFO("sequence " << s);
    const Index first = cu_seqlens[static_cast<std::size_t>(s)];
    const Index count = lengths[static_cast<std::size_t>(s)];
    Tensor<float> alone({count, kEmbed});
    alone.matrix() = packed.matrix().middleRows(first, count);
    const auto as_s = [&](Index /*b*/, Index h, Index q_idx, Index kv_idx) {
      return window(s, h, q_idx, kv_idx);
    };
    const auto expected = mha::flex_forward(layer, alone, mha::no_score_mod, as_s);
    Tensor<float> rows_of_s({count, kEmbed});
    rows_of_s.matrix() = together.output.matrix().middleRows(first, count);
    CHECK(rows_of_s.flat() == expected.output.flat());
  }
}

TEST_CASE("flex_forward: refusals", "[flex][forward][errors]") {
  const auto layer = float_layer();
  const Tensor<float> x = mha_test::random_tensor<float>({kBatch, 40, kEmbed}, 78);
  mha::ForwardOptions<float> weights;  // need_weights by default
  CHECK(mha_test::contains(mha_test::message_of<std::invalid_argument>([&] {
                             (void)mha::flex_forward(layer, x, mha::no_score_mod, mha::AllVisible{},
                                                     weights);
                           }),
                           "need_weights"));
  const auto short_mask = mha::create_block_mask(mha::mods::causal(), 1, 1, 39, 40);
  CHECK_THROWS_AS(mha::flex_forward(layer, x, mha::no_score_mod, short_mask), mha::ShapeError);
  const auto three = mha::create_block_mask(mha::mods::causal(), 3, 1, 40, 40);
  CHECK_THROWS_AS(mha::flex_forward(layer, x, mha::no_score_mod, three), mha::ShapeError);
  MultiHeadAttentionConfig with_bias_kv(kEmbed, kHeads);
  with_bias_kv.add_bias_kv = true;
  const MultiHeadAttention<float> extra_keys(with_bias_kv);
  CHECK_THROWS_AS(mha::flex_forward(extra_keys, x, mha::no_score_mod), std::invalid_argument);
}
