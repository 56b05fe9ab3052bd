// Streaming caches (KVCache::streaming, StreamingLLM): a sequence keeps its first tokens (the
// sinks) and its last w, and each step's outputs equal a float64 forward over exactly the tokens
// the cache holds plus the step's own, at positions 0, 1, ... inside that list: RoPE, ALiBi,
// learnable sinks, GQA; batches whose sequences drop tokens at different steps; steps long enough
// for the flash kernel; compaction. Until a token is dropped it is the plain cache, bit for bit;
// quantized, it stays within the quantized cache's bound; rewinding and bad arguments are refused
// as the cache's state allows.
#include <algorithm>
#include <string>
#include <vector>

#include "helpers.hpp"

using mha::Index;
using mha::KVCache;
using mha::MultiHeadAttention;
using mha::MultiHeadAttentionConfig;
using mha::Tensor;

namespace {

struct Setup {
  std::string name;
  MultiHeadAttentionConfig config;
  Index sinks = 3, window = 7;
  bool rope = false, interleaved = false, alibi = false, softcap = false;
  Index rotary_dim = 0, position_offset = 0;
};

std::vector<Setup> setups() {
  std::vector<Setup> all;
  Setup rope{"GQA 4/2 + RoPE + softcap", MultiHeadAttentionConfig(32, 4)};
  rope.config.num_kv_heads = 2;
  rope.rope = rope.softcap = true;
  all.push_back(rope);
  Setup alibi{"MQA + ALiBi + partial interleaved RoPE, offset 5", MultiHeadAttentionConfig(24, 3)};
  alibi.config.num_kv_heads = 1;
  alibi.rope = alibi.interleaved = alibi.alibi = true;
  alibi.rotary_dim = 4;
  alibi.position_offset = 5;
  alibi.sinks = 4;
  alibi.window = 5;
  all.push_back(alibi);
  Setup learned{"learnable sinks + RoPE, 1 sink token", MultiHeadAttentionConfig(16, 2)};
  learned.config.learnable_sinks = true;
  learned.rope = true;
  learned.sinks = 1;
  all.push_back(learned);
  Setup bare{"no positions, window 0: sinks and the step's own tokens",
             MultiHeadAttentionConfig(16, 4)};
  bare.sinks = 2;
  bare.window = 0;
  all.push_back(bare);
  return all;
}

template <class T>
mha::ForwardOptions<T> options_for(const Setup& setup, const MultiHeadAttention<T>& layer) {
  auto options = MultiHeadAttention<T>::decode_options();
  if (setup.rope) {
    options.rope = mha::Rope{
        10000, setup.interleaved ? mha::RopeLayout::interleaved : mha::RopeLayout::rotate_half,
        setup.rotary_dim, setup.position_offset};
  }
  if (setup.alibi) options.alibi_slopes = mha::alibi_slopes<T>(layer.num_heads());
  if (setup.softcap) options.softcap = T(3);
  return options;
}

// What StreamingLLM computes for the `count` tokens from `first` on of a sequence x [L, E]: a
// causal forward over the tokens its cache holds (the first `sinks`, then the last `window`
// before `first`, none of them twice) followed by the new ones, positions counted along that
// list.
Tensor<double> streaming_reference(const MultiHeadAttention<double>& layer,
                                   const mha::ForwardOptions<double>& options,
                                   const Tensor<double>& x, Index sinks, Index window, Index first,
                                   Index count) {
  std::vector<Index> kept;
  for (Index t = 0; t < std::min(sinks, first); ++t) kept.push_back(t);
  for (Index t = std::max(std::min(sinks, first), first - window); t < first + count; ++t)
    kept.push_back(t);
  Tensor<double> gathered({static_cast<Index>(kept.size()), x.dim(1)});
  for (std::size_t r = 0; r < kept.size(); ++r) {
    gathered.matrix().row(static_cast<Index>(r)) = x.matrix().row(kept[r]);
  }
  const auto out = layer.forward(gathered, options).output;
  Tensor<double> last({count, x.dim(1)});
  last.matrix() = out.matrix().bottomRows(count);
  return last;
}

// Sequence b of x [B, L, E], as [L, E].
template <class T>
Tensor<T> sequence(const Tensor<T>& x, Index b) {
  Tensor<T> one({x.dim(1), x.dim(2)});
  one.matrix() = x[b].matrix();
  return one;
}

// Decodes the B sequences of x [B, L, E] through `cache`, sequence b in steps of chunks[b]'s
// sizes (cycled), all in one call per step; checks each step's rows against the float64
// reference within `relative` of the reference's largest output.
template <class T>
void check_streaming(const MultiHeadAttention<T>& layer, KVCache<T>& cache, const Tensor<T>& x,
                     const mha::ForwardOptions<T>& options,
                     const std::vector<std::vector<Index>>& chunks, double relative) {
  const auto reference_layer = mha_test::converted<double>(layer);
  auto reference_options = MultiHeadAttention<double>::decode_options();
  reference_options.rope = options.rope;
  reference_options.softcap = static_cast<double>(options.softcap);
  for (const auto slope : options.alibi_slopes) {
    reference_options.alibi_slopes.push_back(static_cast<double>(slope));
  }
  const Index batch = x.dim(0), length = x.dim(1), embed = x.dim(2);
  std::vector<Tensor<double>> exact_inputs;
  for (Index b = 0; b < batch; ++b)
    exact_inputs.push_back(mha::tensor_cast<double>(sequence(x, b)));
  std::vector<Index> done(static_cast<std::size_t>(batch), 0);
  for (std::size_t step = 0;; ++step) {
    std::vector<Index> counts;
    for (Index b = 0; b < batch; ++b) {
      const auto& sizes = chunks[static_cast<std::size_t>(b)];
      counts.push_back(
          std::min(sizes[step % sizes.size()], length - done[static_cast<std::size_t>(b)]));
    }
    const Index n = *std::max_element(counts.begin(), counts.end());
    if (n == 0) break;
    Tensor<T> input({batch, n, embed});
    input.flat().setZero();
    for (Index b = 0; b < batch; ++b) {
      const auto i = static_cast<std::size_t>(b);
      input[b].matrix().topRows(counts[i]) = x[b].matrix().middleRows(done[i], counts[i]);
    }
    const auto out = layer.decode(input, cache, options, counts).output;
    for (Index b = 0; b < batch; ++b) {
      const auto i = static_cast<std::size_t>(b);
      if (counts[i] == 0) continue;
      INFO("step " << step << ", sequence " << b << ": tokens " << done[i] << " .. "
                   << done[i] + counts[i] - 1);
      const auto expected =
          streaming_reference(reference_layer, reference_options, exact_inputs[i],
                              cache.sink_tokens(), cache.window(), done[i], counts[i]);
      Tensor<T> actual({counts[i], embed});
      actual.matrix() = out[b].matrix().topRows(counts[i]);
      const double largest = expected.flat().cwiseAbs().maxCoeff();
      CHECK_TENSORS_CLOSE_TOL(mha::tensor_cast<double>(actual), expected, 0.0, relative * largest);
      done[i] += counts[i];
      CHECK(cache.position(b) == done[i]);
      CHECK(cache.length(b) == std::min(done[i], cache.sink_tokens() + cache.window()));
    }
  }
}

}  // namespace

TEMPLATE_TEST_CASE("a streaming cache decodes as forward over its sinks and recent tokens",
                   "[streaming]", float, double) {
  using T = TestType;
  // float against float64: both sides' rounding, 1e-5 of the largest output as the plain
  // cache's tests; double: 1e-12.
  const double relative = std::is_same_v<T, float> ? 1e-5 : 1e-12;
  for (const auto& setup : setups()) {
    INFO(setup.name);
    MultiHeadAttention<T> layer(setup.config);
    mha_test::randomise(layer, 21);
    const auto options = options_for<T>(setup, layer);
    const Index L = 61;
    const auto x = mha_test::random_tensor<T>({2, L, layer.embed_dim()}, 22);
    // Sequence 0 token by token (the decoding kernel); sequence 1 in chunks, one of 17 tokens
    // (the flash kernel), dropping tokens at other steps than sequence 0. The capacity leaves
    // room for the longest step only, so the kept rows move to the front now and then.
    const Index capacity = setup.sinks + setup.window + 17;
    auto cache = layer.make_streaming_cache(2, setup.sinks, setup.window, capacity);
    CHECK(cache.streaming());
    CHECK_FALSE(cache.sliding());
    check_streaming(layer, cache, x, options, {{1}, {3, 1, 17, 1, 2}}, relative);
    CHECK(cache.keys(0).shape() == mha::Shape{setup.sinks + setup.window, layer.kv_dim()});
    // Cleared, the sequences start again from position 0 and keep new sinks.
    cache.clear(1);
    CHECK(cache.position(1) == 0);
    cache.clear();
    check_streaming(layer, cache, x, options, {{2, 5}, {1}}, relative);
  }
}

TEST_CASE("until it drops a token, a streaming cache is the plain cache, bit for bit",
          "[streaming]") {
  const auto setup = setups()[0];
  MultiHeadAttention<float> layer(setup.config);
  mha_test::randomise(layer, 31);
  const auto options = options_for<float>(setup, layer);
  const Index L = 30;
  const auto x = mha_test::random_tensor<float>({1, L, layer.embed_dim()}, 32);
  auto streaming = layer.make_streaming_cache(1, 4, L - 4, L + 1);
  auto plain = layer.make_kv_cache(1, L);
  for (const Index count : {Index{1}, Index{17}, Index{1}, Index{11}}) {
    const Index first = streaming.position(0);
    Tensor<float> step({1, count, layer.embed_dim()});
    step[0].matrix() = x[0].matrix().middleRows(first, count);
    const auto a = layer.decode(step, streaming, options).output;
    const auto b = layer.decode(step, plain, options).output;
    CHECK((a.flat().array() == b.flat().array()).all());
  }
  CHECK(streaming.length(0) == L);
  CHECK((streaming.keys(0).matrix().array() == plain.keys(0).matrix().array()).all());
}

TEST_CASE("a quantized streaming cache stays within the quantized cache's bound",
          "[streaming][quantized]") {
  // E = 64, H = 4, H_kv = 2: H_kv·D = 32, whole blocks; PyTorch's initialisation, where
  // test_quantized_cache holds issue 18's bound for q8: 1e-2 of the float64 output's largest.
  auto setup = setups()[0];
  setup.config = MultiHeadAttentionConfig(64, 4);
  setup.config.num_kv_heads = 2;
  setup.config.seed = 51;
  MultiHeadAttention<float> layer(setup.config);
  const auto options = options_for<float>(setup, layer);
  const auto x = mha_test::random_tensor<float>({2, 40, layer.embed_dim()}, 52);
  auto cache = layer.make_streaming_cache(2, 3, 7, 27, mha::KVCacheFormat::q8);
  check_streaming(layer, cache, x, options, {{1}, {17, 2}}, 1e-2);
  CHECK(cache.dequantized_keys(1).shape() == mha::Shape{10, layer.kv_dim()});
}

TEST_CASE("a streaming cache rewinds only where no dropped token is missed, and refuses the rest",
          "[streaming][errors]") {
  const auto setup = setups()[0];
  MultiHeadAttention<float> layer(setup.config);
  mha_test::randomise(layer, 61);
  const auto options = options_for<float>(setup, layer);
  const auto x = mha_test::random_tensor<float>({1, 30, layer.embed_dim()}, 62);
  using mha_test::contains;
  using mha_test::message_of;
  const auto tokens = [&](Index first, Index count) {
    Tensor<float> step({1, count, layer.embed_dim()});
    step[0].matrix() = x[0].matrix().middleRows(first, count);
    return step;
  };

  CHECK(contains(message_of<mha::ShapeError>([&] { layer.make_streaming_cache(1, 0, 4, 9); }),
                 "sink_tokens"));
  CHECK(contains(message_of<mha::ShapeError>([&] { layer.make_streaming_cache(1, 2, -1, 9); }),
                 "window"));
  CHECK(contains(message_of<mha::ShapeError>([&] { layer.make_streaming_cache(1, 2, 4, 6); }),
                 "expected at least 7"));

  auto cache = layer.make_streaming_cache(1, 2, 4, 10);
  // Before anything is dropped it rewinds anywhere, into the sinks too.
  layer.decode(tokens(0, 5), cache, options);
  cache.rewind(0, 1);
  CHECK(cache.length(0) == 1);
  auto replayed = layer.make_streaming_cache(1, 2, 4, 10);
  layer.decode(tokens(0, 1), replayed, options);
  const auto after_rewind = layer.decode(tokens(1, 6), cache, options).output;
  const auto straight = layer.decode(tokens(1, 6), replayed, options).output;
  CHECK((after_rewind.flat().array() == straight.flat().array()).all());
  CHECK(cache.length(0) == 6);  // 2 sinks + 4 recent: token 2 dropped

  // Once tokens are dropped, only the present position is a state the cache can stand for.
  CHECK_NOTHROW(cache.rewind(0, 7));
  CHECK(contains(message_of<mha::ShapeError>([&] { cache.rewind(0, 6); }),
                 "rewind to a position in [7, 7], got 6"));

  // Refused steps change nothing: a window or pattern of the options, more tokens than fit.
  auto twin = cache;
  auto windowed = options;
  windowed.window = mha::Window{3, 0};
  CHECK(contains(message_of<mha::ShapeError>([&] { layer.decode(tokens(7, 1), cache, windowed); }),
                 "streaming cache"));
  CHECK(contains(message_of<mha::ShapeError>([&] { layer.decode(tokens(7, 5), cache, options); }),
                 "do not fit"));
  CHECK(cache.position(0) == 7);
  CHECK(cache.length(0) == 6);
  // ... so the next step is the one a cache that was never asked gives.
  const auto next = layer.decode(tokens(7, 4), cache, options).output;
  const auto expected = layer.decode(tokens(7, 4), twin, options).output;
  CHECK((next.flat().array() == expected.flat().array()).all());
}
