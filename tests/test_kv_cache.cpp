// Decoding with a KV cache (MultiHeadAttention::decode, KVCache): token by token, in chunks, in
// batches of sequences of different lengths and with a sliding-window cache, it gives the
// outputs of one forward over the whole sequence with the same options; and it refuses what it
// cannot do before changing the cache.
#include <string>
#include <vector>

#include "helpers.hpp"

using mha::Index;
using mha::KVCache;
using mha::MultiHeadAttention;
using mha::MultiHeadAttentionConfig;
using mha::Tensor;

namespace {

using mha_test::randomise;

// A configuration of the layer and the options that decode and forward share.
struct Setup {
  std::string name;
  MultiHeadAttentionConfig config;
  bool rope = false, interleaved = false, alibi = false, softcap = false;
  bool pattern = false;  // global tokens and a per-head block layout over the positions
  Index window = -1;     // left window; the right one is 0 (causal anyway)
};

std::vector<Setup> setups() {
  std::vector<Setup> all;
  all.push_back({"plain, packed projection", MultiHeadAttentionConfig(16, 4)});
  Setup modern{"GQA + RoPE + window + ALiBi + softcap + head gates",
               MultiHeadAttentionConfig(32, 4)};
  modern.config.num_kv_heads = 2;
  modern.rope = modern.alibi = modern.softcap = true;
  modern.window = 5;
  all.push_back(modern);
  // Four query heads per key/value head, with a window and without ALiBi.
  Setup grouped{"GQA 8/2 + RoPE + window + softcap", MultiHeadAttentionConfig(32, 8)};
  grouped.config.num_kv_heads = 2;
  grouped.rope = grouped.softcap = true;
  grouped.window = 6;
  all.push_back(grouped);
  Setup mqa{"multi-query, interleaved RoPE, no bias", MultiHeadAttentionConfig(24, 3)};
  mqa.config.num_kv_heads = 1;
  mqa.config.bias = false;
  mqa.rope = mqa.interleaved = true;
  all.push_back(mqa);
  Setup sparse{"GQA + window + global tokens + block layout", MultiHeadAttentionConfig(16, 4)};
  sparse.config.num_kv_heads = 2;
  sparse.pattern = true;
  sparse.window = 3;
  all.push_back(sparse);
  Setup talking{"talking heads (pre and post) + GQA + RoPE", MultiHeadAttentionConfig(24, 3)};
  talking.config.num_kv_heads = 1;
  talking.config.talking_heads_pre = talking.config.talking_heads_post = true;
  talking.rope = true;
  all.push_back(talking);
  return all;
}

template <class T>
mha::ForwardOptions<T> options_for(const Setup& setup, const MultiHeadAttention<T>& layer) {
  auto options = MultiHeadAttention<T>::decode_options();
  if (setup.rope) {
    options.rope = mha::Rope{
        10000, setup.interleaved ? mha::RopeLayout::interleaved : mha::RopeLayout::rotate_half, 0,
        0};
  }
  if (setup.alibi) options.alibi_slopes = mha::alibi_slopes<T>(layer.num_heads());
  if (setup.softcap) options.softcap = T(3);
  if (setup.window >= 0) options.window = mha::Window{setup.window, 0};
  if (setup.alibi) options.head_gate = {T(1), T(0.5), T(0), T(1.25)};  // the modern setup, H = 4
  if (setup.pattern) {
    // Blocks of 4 over 32 positions, per head: a layout for the longest sequence serves all.
    options.pattern.global_tokens = {0, 1, 9};
    options.pattern.block_size = 4;
    options.pattern.block_layout = Tensor<bool>({layer.num_heads(), 8, 8});
    mha::Random random(5);
    for (Index i = 0; i < options.pattern.block_layout.size(); ++i) {
      options.pattern.block_layout.data()[i] = random.uniform() < 0.5;
    }
  }
  return options;
}

// Rows first .. first + count - 1 of x [B, L, E] as [B, count, E].
template <class T>
Tensor<T> rows(const Tensor<T>& x, Index first, Index count) {
  const Index batch = x.dim(0), width = x.dim(2);
  Tensor<T> part({batch, count, width});
  for (Index b = 0; b < batch; ++b) {
    part[b].matrix() = x[b].matrix().middleRows(first, count);
  }
  return part;
}

// The bound for decoding against the full forward: 1e-5 of the output's largest element
// in float (both carry float rounding: outputs reach 20 here, and each is about 1e-5 from the
// double result at its largest, 5e-7 relative), 1e-12 in double.
template <class T>
void check_decoded(const Tensor<T>& decoded, const Tensor<T>& full) {
  const double relative = std::is_same_v<T, float> ? 1e-5 : 1e-12;
  const double scale = static_cast<double>(full.flat().cwiseAbs().maxCoeff());
  CHECK_TENSORS_CLOSE_TOL(decoded, full, 0.0, relative * scale);
}

// Rows first .. first + count - 1 of a matrix view [L, E], as a tensor.
template <class T>
Tensor<T> matrix_rows(const mha::TensorView<const T>& m, Index first, Index count) {
  Tensor<T> part({count, m.dim(1)});
  part.matrix() = m.matrix().middleRows(first, count);
  return part;
}

// Decodes x [B, L, E] in chunks of the given sizes (cycled) and returns the outputs [B, L, E].
template <class T>
Tensor<T> decode_in_chunks(const MultiHeadAttention<T>& layer, KVCache<T>& cache,
                           const Tensor<T>& x, const mha::ForwardOptions<T>& options,
                           const std::vector<Index>& chunks) {
  Tensor<T> outputs(x.shape());
  const Index length = x.dim(1);
  std::size_t next = 0;
  for (Index first = 0; first < length;) {
    const Index count = std::min(chunks[next++ % chunks.size()], length - first);
    const auto step = layer.decode(rows(x, first, count), cache, options);
    for (Index b = 0; b < x.dim(0); ++b) {
      outputs[b].matrix().middleRows(first, count) = step.output[b].matrix();
    }
    first += count;
  }
  return outputs;
}

}  // namespace

TEMPLATE_TEST_CASE("decoding token by token or in chunks gives the full causal forward's outputs",
                   "[decode]", float, double) {
  using T = TestType;
  const Index B = 2, L = 23;
  for (const auto& setup : setups()) {
    for (const auto kernel : {mha::Kernel::flash, mha::Kernel::reference}) {
      INFO(setup.name << ", kernel " << mha::kernel_name(kernel));
      MultiHeadAttention<T> layer(setup.config);
      randomise(layer, 11);
      const auto x = mha_test::random_tensor<T>({B, L, layer.embed_dim()}, 12);
      auto options = options_for<T>(setup, layer);
      // Talking heads run on the reference kernel only (flash is refused): automatic picks it.
      const bool talking = setup.config.talking_heads_pre || setup.config.talking_heads_post;
      options.kernel = talking && kernel == mha::Kernel::flash ? mha::Kernel::automatic : kernel;
      const auto full = layer.forward(x, options).output;
      for (const auto& chunks :
           {std::vector<Index>{1}, std::vector<Index>{3, 1, 4, 1, 5}, std::vector<Index>{L}}) {
        INFO("chunks of " << chunks.front() << (chunks.size() > 1 ? ", ..." : ""));
        auto cache = layer.make_kv_cache(B, L);
        const auto decoded = decode_in_chunks(layer, cache, x, options, chunks);
        check_decoded(decoded, full);
        CHECK(cache.position(0) == L);
        CHECK(cache.length(1) == L);
        CHECK(cache.keys(0).shape() == mha::Shape{L, layer.kv_dim()});
      }
    }
  }
}

TEMPLATE_TEST_CASE("a batch of sequences of different lengths decodes without padding", "[decode]",
                   float, double) {
  using T = TestType;
  const Setup setup = setups()[1];
  MultiHeadAttention<T> layer(setup.config);
  randomise(layer, 21);
  const auto options = options_for<T>(setup, layer);
  const std::vector<Index> prompts = {5, 2, 7};
  const Index generated = 4, E = layer.embed_dim();
  // Each sequence on its own: prompt then generated tokens, one forward.
  std::vector<Tensor<T>> sequences, expected;
  for (std::size_t b = 0; b < prompts.size(); ++b) {
    sequences.push_back(mha_test::random_tensor<T>({1, prompts[b] + generated, E}, 30 + b));
    expected.push_back(layer.forward(sequences.back(), options).output);
  }
  // Together: one prefill step holding each prompt in the first new_tokens[b] rows of [3, 7, E]
  // (padding after), then `generated` steps of one token each.
  auto cache = layer.make_kv_cache(3, 16);
  Tensor<T> prompt_rows({3, 7, E});
  prompt_rows.flat().setConstant(T(1e3));  // padding: must not leak into anything
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    prompt_rows[static_cast<Index>(i)].matrix().topRows(prompts[i]) =
        sequences[i][0].matrix().topRows(prompts[i]);
  }
  const auto prefill = layer.decode(prompt_rows, cache, options, prompts);
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    const auto b = static_cast<Index>(i);
    INFO("sequence " << b << ", prefill");
    CHECK(cache.position(b) == prompts[i]);
    check_decoded(matrix_rows<T>(prefill.output[b], 0, prompts[i]),
                  matrix_rows<T>(expected[i][0], 0, prompts[i]));
    CHECK(prefill.output[b].matrix().bottomRows(7 - prompts[i]).isZero());
  }
  for (Index step = 0; step < generated; ++step) {
    Tensor<T> tokens({3, 1, E});
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      tokens[static_cast<Index>(i)].matrix() = sequences[i][0].matrix().row(prompts[i] + step);
    }
    const auto out = layer.decode(tokens, cache, options);
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      INFO("sequence " << i << ", generated token " << step);
      check_decoded(matrix_rows<T>(out.output[static_cast<Index>(i)], 0, 1),
                    matrix_rows<T>(expected[i][0], prompts[i] + step, 1));
    }
  }
}

TEMPLATE_TEST_CASE("a sliding-window cache keeps only the window and decodes as the full forward",
                   "[decode]", float, double) {
  using T = TestType;
  // window 5 with GQA, RoPE, ALiBi, softcap, gates; window 6 with GQA 8/2
  for (const auto& setup : {setups()[1], setups()[2]}) {
    INFO(setup.name);
    const Index w = setup.window;
    MultiHeadAttention<T> layer(setup.config);
    randomise(layer, 41);
    const auto options = options_for<T>(setup, layer);
    const Index L = 40;
    const auto x = mha_test::random_tensor<T>({2, L, layer.embed_dim()}, 42);
    const auto full = layer.forward(x, options).output;
    // capacity 2w: compaction every few steps; chunks up to capacity - w = w tokens.
    for (const auto& chunks : {std::vector<Index>{1}, std::vector<Index>{w, 2, 3}}) {
      auto cache = layer.make_kv_cache(2, 2 * w, w);
      CHECK(cache.sliding());
      const auto decoded = decode_in_chunks(layer, cache, x, options, chunks);
      check_decoded(decoded, full);
      CHECK(cache.position(0) == L);
      CHECK(cache.length(0) == w);
      CHECK(cache.keys(1).shape() == mha::Shape{w, layer.kv_dim()});
    }
    // A narrower window than the cache keeps is fine.
    auto narrow = options;
    narrow.window.left = 3;
    auto cache = layer.make_kv_cache(2, 2 * w, w);
    check_decoded(decode_in_chunks(layer, cache, x, narrow, {1, 2}),
                  layer.forward(x, narrow).output);
  }
}

TEMPLATE_TEST_CASE("rewinding drops the last tokens, and decoding goes on from there", "[decode]",
                   float, double) {
  using T = TestType;
  const Setup setup = setups()[1];
  MultiHeadAttention<T> layer(setup.config);
  randomise(layer, 51);
  const auto options = options_for<T>(setup, layer);
  const Index E = layer.embed_dim();
  // Decoded: a (12 tokens); then its last 5 are replaced by those of b, from position 7 on.
  const auto a = mha_test::random_tensor<T>({1, 12, E}, 52);
  auto b = a;
  b[0].matrix().bottomRows(5) = mha_test::random_tensor<T>({5, E}, 53).matrix();
  const auto expected = layer.forward(b, options).output;
  auto cache = layer.make_kv_cache(1, 20);
  decode_in_chunks(layer, cache, a, options, {1});
  cache.rewind(0, 7);
  CHECK(cache.position(0) == 7);
  CHECK(cache.length(0) == 7);
  check_decoded(layer.decode(rows(b, 7, 5), cache, options).output, rows(expected, 7, 5));
  // A sliding cache (window 5) can rewind while it still holds the window before the position:
  // after 4 tokens it has dropped nothing, so back to 2 is fine.
  auto c = a;
  c[0].matrix().bottomRows(10) = mha_test::random_tensor<T>({10, E}, 54).matrix();
  auto window_cache = layer.make_kv_cache(1, 10, 5);
  decode_in_chunks(layer, window_cache, rows(a, 0, 4), options, {1});
  window_cache.rewind(0, 2);
  check_decoded(decode_in_chunks(layer, window_cache, rows(c, 2, 10), options, {3}),
                rows(layer.forward(c, options).output, 2, 10));
  // A sliding cache that has dropped the keys before the window cannot go further back.
  auto sliding = layer.make_kv_cache(1, 20, 5);
  decode_in_chunks(layer, sliding, a, options, {1});  // holds positions 7 .. 11
  CHECK(mha_test::message_of<mha::ShapeError>([&] { sliding.rewind(0, 11); }) ==
        "position: sequence 0 can rewind to a position in [12, 12], got 11");
  auto full = layer.make_kv_cache(1, 20);
  decode_in_chunks(layer, full, a, options, {4});
  CHECK(mha_test::message_of<mha::ShapeError>([&] { full.rewind(0, 13); }) ==
        "position: sequence 0 can rewind to a position in [0, 12], got 13");
}

TEST_CASE("decode refuses what it cannot do, and a refused step changes nothing",
          "[decode][errors]") {
  using T = double;
  MultiHeadAttention<T> layer(MultiHeadAttentionConfig(8, 2));
  const auto message = [](auto&& f) { return mha_test::message_of<mha::ShapeError>(f); };
  auto cache = layer.make_kv_cache(2, 6);
  const auto three = mha_test::random_tensor<T>({2, 3, 8}, 1);
  layer.decode(three, cache);
  // 3 + 4 > 6: refused, and the cache still holds 3 tokens and decodes on from there.
  const auto four = mha_test::random_tensor<T>({2, 4, 8}, 2);
  CHECK(message([&] { layer.decode(four, cache); }) ==
        "cache: sequence 0 holds 3 keys of its capacity 6; 4 more do not fit");
  CHECK(cache.position(0) == 3);
  CHECK(cache.length(1) == 3);
  layer.decode(rows(four, 0, 3), cache);
  CHECK(cache.position(1) == 6);

  auto fresh = layer.make_kv_cache(2, 6);
  CHECK(mha_test::contains(message([&] {
                             layer.decode(mha_test::random_tensor<T>({3, 1, 8}, 3), fresh);
                           }),
                           "x: expected [2, n, 8] (one row per cached sequence), got [3, 1, 8]"));
  CHECK(mha_test::contains(message([&] {
                             layer.decode(mha_test::random_tensor<T>({1, 8}, 3), fresh);
                           }),
                           "x: expected [2, n, 8]"));
  CHECK(
      mha_test::contains(message([&] { layer.decode(three, fresh, layer.decode_options(), {1}); }),
                         "new_tokens: expected one count per sequence (2), got 1"));
  CHECK(mha_test::contains(message([&] {
                             layer.decode(three, fresh, layer.decode_options(), {1, 4});
                           }),
                           "new_tokens: sequence 1: expected a count in [0, n = 3], got 4"));
  auto with_weights = layer.decode_options();
  with_weights.need_weights = true;
  CHECK(mha_test::contains(message([&] { layer.decode(three, fresh, with_weights); }),
                           "need_weights: decode returns no attention weights"));
  auto masked = layer.decode_options();
  masked.key_padding_mask = mha::Mask<T>::blocked_where_true(Tensor<bool>({2, 3}));
  CHECK(mha_test::contains(message([&] { layer.decode(three, fresh, masked); }),
                           "takes no attn_mask or key_padding_mask"));
  auto sliding = layer.make_kv_cache(2, 6, 3);
  CHECK(mha_test::contains(message([&] { layer.decode(three, sliding); }),
                           "window.left: a sliding-window cache keeping the last 3 keys serves "
                           "windows of at most that many keys to the left, got -1 (unbounded)"));
  auto patterned = layer.decode_options();
  patterned.window.left = 2;
  patterned.pattern.global_tokens = {0};
  CHECK(mha_test::contains(message([&] { layer.decode(three, sliding, patterned); }),
                           "pattern: global tokens and block layouts are over absolute positions"));
  CHECK(fresh.position(0) == 0);
  CHECK(sliding.position(0) == 0);

  MultiHeadAttention<T> grouped([] {
    MultiHeadAttentionConfig config(8, 2);
    config.num_kv_heads = 1;
    return config;
  }());
  CHECK(mha_test::contains(message([&] { grouped.decode(three, fresh); }),
                           "cache: holds 2 key/value heads of D = 4, the layer has 1 of D = 4"));
  MultiHeadAttentionConfig extra(8, 2);
  extra.add_bias_kv = true;
  CHECK(mha_test::contains(message([&] { MultiHeadAttention<T>(extra).decode(three, fresh); }),
                           "add_bias_kv or add_zero_attn"));
  MultiHeadAttentionConfig cross(8, 2);
  cross.kdim = 5;
  CHECK(mha_test::contains(message([&] { MultiHeadAttention<T>(cross).decode(three, fresh); }),
                           "decodes self-attention only"));
  CHECK(mha_test::contains(message([&] { KVCache<T>(2, 1, 4, 3, 3); }),
                           "capacity: expected at least 4 (the window, 3, plus one new token)"));
  CHECK(mha_test::contains(message([&] { fresh.position(2); }),
                           "b: expected a sequence in [0, 2), got 2"));

  // clear() starts over at position 0.
  cache.clear(0);
  CHECK(cache.position(0) == 0);
  CHECK(cache.position(1) == 6);
}
