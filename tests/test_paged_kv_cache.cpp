// Decoding with a paged KV cache (PagedKVCache, MultiHeadAttention::decode with sequence ids):
// the same steps give the same bits as through a KVCache, on every path of the decoding kernel
// and through the flash kernel's gathered rows, in every storage format; fork shares pages until
// a write copies the one written; truncate and remove return pages; a step the pool cannot hold,
// and bad ids or shapes, are refused with the cache unchanged.
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "helpers.hpp"

using mha::Index;
using mha::KVCache;
using mha::KVCacheFormat;
using mha::MultiHeadAttention;
using mha::MultiHeadAttentionConfig;
using mha::PagedKVCache;
using mha::Tensor;

namespace {

using mha_test::randomise;

template <class T>
void require_identical(const Tensor<T>& actual, const Tensor<T>& expected) {
  REQUIRE(actual.shape() == expected.shape());
  Index differ = 0;
  for (Index i = 0; i < actual.size(); ++i) differ += actual.data()[i] != expected.data()[i];
  CHECK(differ == 0);
}

struct Setup {
  std::string name;
  MultiHeadAttentionConfig config;
  bool rope = false, alibi = false, softcap = false, pattern = false;
  Index window = -1;
};

MultiHeadAttentionConfig grouped(Index embed, Index heads, Index kv_heads) {
  MultiHeadAttentionConfig config(embed, heads);
  config.num_kv_heads = kv_heads;
  return config;
}

// Setups that reach each path of the decoding kernel (a query head per key/value head: dots;
// four: the register blocks; sixteen: the micro-kernel's panels, or lanes with AVX-512) and the
// flash kernel (a block layout, which the decoding kernel does not compute).
std::vector<Setup> setups() {
  std::vector<Setup> all;
  all.push_back({"H = H_kv = 2, D = 32", MultiHeadAttentionConfig(64, 2)});
  Setup modern{"GQA 8/2, D = 32, RoPE + ALiBi + softcap + window", grouped(256, 8, 2)};
  modern.rope = modern.alibi = modern.softcap = true;
  modern.window = 200;
  all.push_back(modern);
  Setup wide{"GQA 16/1, D = 32, RoPE", grouped(512, 16, 1)};
  wide.rope = true;
  all.push_back(wide);
  Setup sparse{"GQA 4/2, D = 16, global tokens + block layout", grouped(64, 4, 2)};
  sparse.pattern = true;
  all.push_back(sparse);
  return all;
}

template <class T>
mha::ForwardOptions<T> options_for(const Setup& setup, const MultiHeadAttention<T>& layer,
                                   Index longest) {
  auto options = MultiHeadAttention<T>::decode_options();
  if (setup.rope) options.rope = mha::Rope{10000, mha::RopeLayout::rotate_half, 0, 0};
  if (setup.alibi) {
    options.alibi_slopes = mha::alibi_slopes<mha::detail::compute_t<T>>(layer.num_heads());
  }
  if (setup.softcap) options.softcap = T(4);
  if (setup.window >= 0) options.window = mha::Window{setup.window, 0};
  if (setup.pattern) {
    options.pattern.global_tokens = {0, 5};
    options.pattern.block_size = 16;
    const Index blocks = (longest + 15) / 16;
    options.pattern.block_layout = Tensor<bool>({layer.num_heads(), blocks, blocks});
    mha::Random random(7);
    for (Index i = 0; i < options.pattern.block_layout.size(); ++i) {
      options.pattern.block_layout.data()[i] = random.uniform() < 0.6;
    }
  }
  return options;
}

// decode's defaults with rotary embeddings: keys that depend on their positions.
mha::ForwardOptions<float> rotary_decode_options() {
  auto options = MultiHeadAttention<float>::decode_options();
  options.rope = mha::Rope{10000, mha::RopeLayout::rotate_half, 0, 0};
  return options;
}

// A schedule of steps for four sequences: prompts of different lengths (one sitting out), then
// steps of one to three tokens, ragged, past the decoding kernel's 240-key chunks and many pages.
std::vector<std::vector<Index>> schedule() {
  std::vector<std::vector<Index>> steps = {{200, 150, 0, 230}, {0, 0, 20, 0}};
  for (Index s = 0; s < 24; ++s) steps.push_back({1 + s % 3, 1, 2 - s % 2, s % 4 == 0 ? 0 : 1});
  return steps;
}

Index longest_sequence() {
  Index longest = 0;
  for (Index b = 0; b < 4; ++b) {
    Index total = 0;
    for (const auto& step : schedule()) total += step[static_cast<std::size_t>(b)];
    longest = std::max(longest, total);
  }
  return longest;
}

// Runs the schedule through a KVCache and through a paged cache whose sequences have other ids
// and step in another order; every step's outputs must be the same bits.
template <class T>
void check_same_as_contiguous(const MultiHeadAttention<T>& layer,
                              const mha::ForwardOptions<T>& options, KVCacheFormat format,
                              Index page_size) {
  const Index E = layer.embed_dim(), B = 4, longest = longest_sequence();
  auto contiguous = layer.make_kv_cache(B, longest, -1, format);
  auto paged =
      layer.make_paged_kv_cache(page_size, B * ((longest + page_size - 1) / page_size), format);
  const Index unused = paged.add_sequence();
  std::vector<Index> ids;
  for (Index b = 0; b < B; ++b) ids.push_back(paged.add_sequence());
  paged.remove_sequence(unused);  // (ids need not start at 0)
  // Paged row i is contiguous row order[i].
  const std::vector<Index> order = {2, 0, 3, 1};
  std::vector<Index> paged_ids;
  for (const Index b : order) paged_ids.push_back(ids[static_cast<std::size_t>(b)]);
  std::uint64_t seed = 100;
  for (const auto& counts : schedule()) {
    const Index n = *std::max_element(counts.begin(), counts.end());
    const auto x = mha_test::random_tensor<T>({B, n, E}, seed++);
    Tensor<T> reordered({B, n, E});
    std::vector<Index> reordered_counts;
    for (Index i = 0; i < B; ++i) {
      const auto b = order[static_cast<std::size_t>(i)];
      reordered[i].matrix() = x[b].matrix();
      reordered_counts.push_back(counts[static_cast<std::size_t>(b)]);
    }
    const auto expected = layer.decode(x, contiguous, options, counts).output;
    const auto actual = layer.decode(reordered, paged, paged_ids, options, reordered_counts).output;
    for (Index i = 0; i < B; ++i) {
      const auto b = order[static_cast<std::size_t>(i)];
      INFO("step of " << n << " tokens, sequence " << b << " ("
                      << counts[static_cast<std::size_t>(b)] << " new)");
      require_identical(Tensor<T>(actual[i]), Tensor<T>(expected[b]));
    }
  }
  for (Index b = 0; b < B; ++b) {
    CHECK(paged.length(ids[static_cast<std::size_t>(b)]) == contiguous.length(b));
    require_identical(paged.dequantized_values(ids[static_cast<std::size_t>(b)]),
                      contiguous.dequantized_values(b));
  }
}

}  // namespace

TEST_CASE("a paged cache gives the same bits as a KVCache, on every path and format",
          "[decode][paged]") {
  std::set<mha::detail::DecodePath> paths;
  for (const auto& setup : setups()) {
    MultiHeadAttention<float> layer(setup.config);
    randomise(layer, 3);
    const auto options = options_for<float>(setup, layer, longest_sequence());
    const mha::detail::DecodeShape shape{layer.num_heads(), layer.num_kv_heads(), layer.head_dim(),
                                         layer.head_dim(),  layer.embed_dim(),    layer.embed_dim(),
                                         layer.kv_dim()};
    if (!setup.pattern) {
      for (const Index n : {1, 2, 3}) paths.insert(mha::detail::decode_path(shape, n));
    }
    for (const auto format : {KVCacheFormat::as_layer, KVCacheFormat::q8, KVCacheFormat::q4}) {
      for (const Index page_size : {48, 96}) {
        INFO(setup.name << ", " << mha::kv_cache_format_name(format) << ", pages of " << page_size);
        check_same_as_contiguous(layer, options, format, page_size);
      }
    }
  }
  // The float setups' one- to three-token steps reach three of the kernel's paths where it has
  // register blocks (dots, blocks, and panels or lanes).
  if (mha::detail::packed_gemm_available()) CHECK(paths.size() >= 3);
}

TEMPLATE_TEST_CASE("a paged cache of a 16-bit or double layer gives a KVCache's bits",
                   "[decode][paged]", Eigen::half, double) {
  using T = TestType;
  for (const auto& setup : setups()) {
    INFO(setup.name);
    MultiHeadAttention<T> layer(setup.config);
    randomise(layer, 4);
    check_same_as_contiguous(layer, options_for<T>(setup, layer, longest_sequence()),
                             KVCacheFormat::as_layer, 48);
  }
}

TEST_CASE("fork shares pages until a step writes into one, and gives a copied cache's outputs",
          "[decode][paged]") {
  MultiHeadAttention<float> layer(grouped(256, 8, 2));
  randomise(layer, 5);
  const auto options = rotary_decode_options();
  const Index E = layer.embed_dim(), prefix = 100;  // 48 + 48 + 4 rows: a last page not full
  const auto prompt = mha_test::random_tensor<float>({1, prefix, E}, 6);
  // The reference: both sequences of a KVCache decode the prompt.
  auto copied = layer.make_kv_cache(2, 400);
  Tensor<float> both({2, prefix, E});
  both[0].matrix() = both[1].matrix() = prompt[0].matrix();
  layer.decode(both, copied, options);

  // A pool of exactly enough pages: the prompt's 3, and one for the copy of the shared last page.
  auto paged = layer.make_paged_kv_cache(48, 4);
  const Index first = paged.add_sequence();
  layer.decode(prompt, paged, {first}, options);
  const Index second = paged.fork(first);
  CHECK(paged.usage().used_pages == 3);
  CHECK(paged.usage().shared_pages == 3);
  CHECK(paged.page_table(second) == paged.page_table(first));
  CHECK(paged.length(second) == prefix);
  // Both write into the shared last page: one copy, and the other keeps the page.
  CHECK(paged.pages_needed({first, second}, {1, 1}) == 1);
  const auto tokens = mha_test::random_tensor<float>({2, 1, E}, 7);
  const auto expected = layer.decode(tokens, copied, options).output;
  const auto actual = layer.decode(tokens, paged, {first, second}, options).output;
  require_identical(actual, expected);
  CHECK(paged.free_pages() == 0);
  CHECK(paged.usage().shared_pages == 2);
  CHECK(paged.page_table(first)[0] == paged.page_table(second)[0]);
  CHECK(paged.page_table(first)[2] != paged.page_table(second)[2]);
  require_identical(paged.keys(second), Tensor<float>(copied.keys(1)));
}

TEST_CASE("truncate and remove return pages, and decoding goes on as after a rewind",
          "[decode][paged]") {
  MultiHeadAttention<float> layer(grouped(128, 4, 2));
  randomise(layer, 8);
  const auto options = layer.decode_options();
  const Index E = layer.embed_dim();
  auto contiguous = layer.make_kv_cache(1, 300);
  auto paged = layer.make_paged_kv_cache(48, 10);
  const Index s = paged.add_sequence();
  const auto prompt = mha_test::random_tensor<float>({1, 150, E}, 9);
  layer.decode(prompt, contiguous, options);
  layer.decode(prompt, paged, {s}, options);
  CHECK(paged.usage().used_pages == 4);
  CHECK(paged.usage().unused_rows == 4 * 48 - 150);
  paged.truncate(s, 60);
  contiguous.rewind(0, 60);
  CHECK(paged.usage().used_pages == 2);
  CHECK(paged.length(s) == 60);
  for (Index step = 0; step < 5; ++step) {
    const auto token =
        mha_test::random_tensor<float>({1, 1, E}, static_cast<std::uint64_t>(20 + step));
    require_identical(layer.decode(token, paged, {s}, options).output,
                      layer.decode(token, contiguous, options).output);
  }
  const Index other = paged.fork(s);
  paged.remove_sequence(s);
  CHECK(!paged.contains(s));
  CHECK(paged.usage().used_pages == 2);  // the fork holds them still
  paged.remove_sequence(other);
  CHECK(paged.free_pages() == 10);
  CHECK(paged.add_sequence() == 0);  // ids are reused
}

TEST_CASE("a paged step that does not fit, or names bad sequences, changes nothing",
          "[decode][paged][errors]") {
  MultiHeadAttention<float> layer(grouped(64, 4, 2));
  randomise(layer, 10);
  const auto options = layer.decode_options();
  const auto message = [](auto&& f) { return mha_test::message_of<mha::ShapeError>(f); };
  const Index E = layer.embed_dim();
  auto paged = layer.make_paged_kv_cache(48, 3);
  const Index a = paged.add_sequence(), b = paged.add_sequence();
  layer.decode(mha_test::random_tensor<float>({1, 90, E}, 11), paged, {a}, options);  // 2 pages
  const auto pages_a = paged.page_table(a);
  // 30 tokens for each: b needs a page, a needs one more (90 + 30 > 96): 2 > 1 free.
  const auto step = mha_test::random_tensor<float>({2, 30, E}, 12);
  CHECK(message([&] {
          layer.decode(step, paged, {a, b}, options);
        }) ==
        "cache: the step needs 2 free pages of 48 tokens, the pool has 1 of 3 (remove or "
        "truncate sequences, or make a larger pool)");
  CHECK(paged.length(a) == 90);
  CHECK(paged.length(b) == 0);
  CHECK(paged.free_pages() == 1);
  CHECK(paged.page_table(a) == pages_a);
  CHECK(mha_test::contains(message([&] {
                             layer.decode(step, paged, {a, a}, options);
                           }),
                           "sequences: expected distinct ids, got 0 at 0 and 1"));
  CHECK(mha_test::contains(message([&] {
                             layer.decode(step, paged, {a, 7}, options);
                           }),
                           "sequence: expected the id of a sequence this cache holds (2 held), "
                           "got 7"));
  CHECK(mha_test::contains(message([&] { layer.decode(step, paged, {a}, options); }),
                           "x: expected [1, n, 64] (one row per cached sequence) or [n, E]"));
  CHECK(mha_test::contains(message([&] { layer.decode(step, paged, {}, options); }),
                           "sequences: expected at least one sequence id, got none"));
  CHECK(mha_test::contains(message([&] { paged.truncate(a, 91); }),
                           "length: sequence 0 can be truncated to a length in [0, 90], got 91"));
  CHECK(mha_test::contains(message([&] { paged.fork(5); }), "sequence: expected the id"));
  CHECK(mha_test::contains(message([&] { layer.make_paged_kv_cache(16, 4); }),
                           "page_size: expected a positive multiple of 48 tokens, got 16"));
  CHECK(mha_test::contains(message([&] { layer.make_paged_kv_cache(48, 0); }),
                           "num_pages: expected at least 1, got 0"));
  CHECK(mha_test::contains(message([&] { PagedKVCache<float>(1, 16, 48, 2, KVCacheFormat::q8); }),
                           "expected H_kv·D a multiple of 32, got 1·16 = 16"));
  CHECK(mha_test::contains(message([&] { PagedKVCache<double>(2, 16, 48, 2, KVCacheFormat::q8); }),
                           "q8 caches are for layers that compute in float"));
  CHECK(paged.length(a) == 90);
  // The step that fits still runs after the refusals.
  layer.decode(mha_test::random_tensor<float>({1, 6, E}, 13), paged, {a}, options);
  CHECK(paged.length(a) == 96);
  CHECK(paged.free_pages() == 1);
}

TEST_CASE("prefix caching shares the pages of a prompt's cached prefix, and keeps them cached",
          "[decode][paged]") {
  MultiHeadAttention<float> layer(grouped(128, 4, 2));
  randomise(layer, 14);
  const auto options = rotary_decode_options();
  const Index E = layer.embed_dim(), P = 48;
  // Token ids and their embeddings: token t's row is embedding(t).
  const auto table = mha_test::random_tensor<float>({64, E}, 15);
  const auto embed = [&](const std::vector<std::int64_t>& tokens, std::size_t first) {
    Tensor<float> x({1, static_cast<Index>(tokens.size() - first), E});
    for (std::size_t t = first; t < tokens.size(); ++t) {
      x[0].matrix().row(static_cast<Index>(t - first)) = table.matrix().row(tokens[t]);
    }
    return x;
  };
  std::vector<std::int64_t> prompt(150);
  for (std::size_t t = 0; t < prompt.size(); ++t) prompt[t] = static_cast<std::int64_t>(t * 7 % 64);
  // Another prompt with the same first 100 tokens: two whole pages in common.
  auto other = prompt;
  other.resize(130);
  for (std::size_t t = 100; t < other.size(); ++t) other[t] = 5;

  auto paged = layer.make_paged_kv_cache(P, 12);
  const Index first = paged.add_sequence(prompt);
  CHECK(paged.length(first) == 0);  // nothing cached yet
  layer.decode(embed(prompt, 0), paged, {first}, options);
  // The reference for the other prompt: a copy of the first's first 96 tokens (fork, truncate).
  const Index copy = paged.fork(first);
  paged.truncate(copy, 2 * P);
  const Index second = paged.add_sequence(other);
  CHECK(paged.length(second) == 2 * P);
  CHECK(paged.page_table(second) ==
        std::vector<Index>(paged.page_table(first).begin(), paged.page_table(first).begin() + 2));
  const auto rest = embed(other, 2 * P);
  require_identical(layer.decode(rest, paged, {second}, options).output,
                    layer.decode(rest, paged, {copy}, options).output);

  // Removed, their registered pages stay cached, and a third sequence with the first prompt finds
  // all three of its whole pages (the last prompt token is always decoded).
  const Index pages_before = paged.free_pages();
  paged.remove_sequence(first);
  paged.remove_sequence(second);
  paged.remove_sequence(copy);
  CHECK(paged.usage().used_pages == 0);
  CHECK(paged.usage().cached_pages == 3);
  CHECK(paged.free_pages() == 12);
  CHECK(pages_before < 12);
  const Index third = paged.add_sequence(prompt);
  CHECK(paged.length(third) == 3 * P);
  CHECK(paged.usage().cached_pages == 0);
  // Its outputs equal the first's, decoded again from scratch in a cache of its own.
  auto fresh = layer.make_paged_kv_cache(P, 12);
  const Index again = fresh.add_sequence();
  const auto expected = layer.decode(embed(prompt, 0), fresh, {again}, options).output;
  const auto actual = layer.decode(embed(prompt, 3 * P), paged, {third}, options).output;
  CHECK((actual[0].matrix() - expected[0].matrix().bottomRows(6)).cwiseAbs().maxCoeff() <=
        1e-5F * expected.flat().cwiseAbs().maxCoeff());

  // Truncated into a registered page, a sequence copies that page before writing: the cached rows
  // stay as they were for the next sequence with the prompt.
  paged.truncate(third, 100);
  layer.decode(embed(other, 100), paged, {third}, options);
  const Index fourth = paged.add_sequence(prompt);
  CHECK(paged.length(fourth) == 3 * P);
  const auto repeated = layer.decode(embed(prompt, 3 * P), paged, {fourth}, options).output;
  require_identical(repeated, actual);

  // A pool that needs every page forgets the cached ones, oldest first.
  paged.remove_sequence(third);
  paged.remove_sequence(fourth);
  const Index big = paged.add_sequence();
  layer.decode(mha_test::random_tensor<float>({1, 12 * P, E}, 16), paged, {big}, options);
  CHECK(paged.usage().cached_pages == 0);
  CHECK(paged.free_pages() == 0);
  paged.remove_sequence(big);
  CHECK(paged.length(paged.add_sequence(prompt)) == 0);
}
