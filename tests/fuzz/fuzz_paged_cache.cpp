// Fuzz target: PagedKVCache's API (add_sequence with and without a prompt's tokens, fork,
// truncate, remove_sequence) and decoding steps over any set of its sequences
// (MultiHeadAttention::decode with ids and new_tokens, every other step packed with cu_seqlens),
// in a sequence of operations decoded from the bytes, on a small float layer and pool. Every token
// is an id of a vocabulary of 4, its row the id's embedding, and prompts are prefixes of two fixed
// strings of ids, so that prefix caching finds pages to share. Properties:
//   - no crash, and no exception but mha::ShapeError (bad ids, lengths, a full pool);
//   - a refused operation changes nothing: every sequence's length and page table, the free pages;
//   - the pool's accounting: used plus free pages is the pool; each sequence holds
//     ceil(length / page_size) pages; the used pages are those the sequences' tables name, and
//     the shared ones those named twice or more;
//   - a sequence added with a prompt starts with a multiple of page_size of its tokens, fewer than
//     all of them;
//   - every step's output is finite, and for a cache of the layer's type equals (within the test
//     suite's bound for decoding, below) a causal forward over the sequence's tokens so far, which
//     the target keeps per sequence (fork copies them, truncate drops them, a prompt's cached
//     prefix starts them): so prefix caching shares only pages that hold the right keys.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "fuzz_support.hpp"
#include "mha/multihead_attention.hpp"

namespace {

using mha::Index;
using mha::Tensor;
using mha_fuzz::Choices;
using mha_fuzz::violation;

mha_fuzz::Tally tally("fuzz_paged_cache",
                      {"refused at the pool", "ran with no step", "ran steps", "ran refused steps",
                       "ran steps after sharing a cached prefix"});

// What the cache holds, to compare before and after a refused operation.
struct Snapshot {
  std::vector<Index> ids, lengths;
  std::vector<std::vector<Index>> tables;
  Index free_pages = 0;
  bool operator==(const Snapshot& other) const {
    return ids == other.ids && lengths == other.lengths && tables == other.tables &&
           free_pages == other.free_pages;
  }
};

Snapshot snapshot(const mha::PagedKVCache<float>& cache) {
  Snapshot s;
  s.ids = cache.sequences();
  for (const Index id : s.ids) {
    s.lengths.push_back(cache.length(id));
    s.tables.push_back(cache.page_table(id));
  }
  s.free_pages = cache.free_pages();
  return s;
}

void check_accounting(const mha::PagedKVCache<float>& cache) {
  const auto usage = cache.usage();
  if (usage.used_pages + cache.free_pages() != cache.num_pages()) {
    violation("used + free pages is not the pool");
  }
  std::map<Index, Index> holders;
  for (const Index id : cache.sequences()) {
    const auto& table = cache.page_table(id);
    const Index expected = (cache.length(id) + cache.page_size() - 1) / cache.page_size();
    if (static_cast<Index>(table.size()) != expected) {
      violation("sequence " + std::to_string(id) + " holds " + std::to_string(table.size()) +
                " pages for " + std::to_string(cache.length(id)) + " tokens");
    }
    for (const Index page : table) ++holders[page];
  }
  Index shared = 0;
  for (const auto& [page, count] : holders) shared += count > 1 ? 1 : 0;
  if (static_cast<Index>(holders.size()) != usage.used_pages || shared != usage.shared_pages) {
    violation("the pool's used or shared pages are not those the page tables name");
  }
}

void run(Choices& choices) {
  const Index heads = choices.in(1, 4);
  const Index kv_heads = heads % 2 == 0 && choices.flag() ? heads / 2 : heads;
  const Index head_dim = choices.flag() ? 8 : 16;
  mha::MultiHeadAttentionConfig config(heads * head_dim, heads);
  config.num_kv_heads = kv_heads;
  mha::MultiHeadAttention<float> layer(config);
  mha::Random random(choices.seed());
  for (const auto& name : layer.parameter_names()) {
    Tensor<float> values(layer.parameter(name).shape());
    for (Index i = 0; i < values.size(); ++i)
      values.data()[i] = static_cast<float>(0.5 * random.normal());
    layer.set_parameter(name, values);
  }
  auto options = layer.decode_options();
  if (choices.flag()) options.rope = mha::Rope{10000, mha::RopeLayout::rotate_half, 0, 0};
  const Index format_pick = choices.in(0, 2);
  const auto format = format_pick == 1   ? mha::KVCacheFormat::q8
                      : format_pick == 2 ? mha::KVCacheFormat::q4
                                         : mha::KVCacheFormat::as_layer;
  const bool exact = format == mha::KVCacheFormat::as_layer;
  const Index E = layer.embed_dim();
  mha::PagedKVCache<float> cache;
  try {
    cache = layer.make_paged_kv_cache(48 * choices.in(1, 2), choices.in(1, 8), format);
  } catch (const mha::ShapeError&) {
    tally.count(0);  // (a quantized format on rows that are not whole blocks)
    return;
  }
  // The vocabulary's embeddings, two strings of ids that prompts are prefixes of, and each
  // sequence's ids so far and prompt (what its steps decode first).
  constexpr Index kVocabulary = 4, kPromptLength = 200;
  Tensor<float> embeddings({kVocabulary, E});
  for (Index i = 0; i < embeddings.size(); ++i) {
    embeddings.data()[i] = static_cast<float>(random.normal());
  }
  std::vector<std::int64_t> strings[2];
  for (auto& string : strings) {
    for (Index t = 0; t < kPromptLength; ++t) {
      string.push_back(static_cast<std::int64_t>(random.uniform() * kVocabulary) % kVocabulary);
    }
  }
  std::map<Index, std::vector<std::int64_t>> tokens, prompts;

  Index steps_run = 0, steps_refused = 0;
  bool shared_prefix = false;
  for (Index operation = 0, count = choices.in(1, 24); operation < count; ++operation) {
    const Snapshot before = snapshot(cache);
    // A held sequence's id, mostly; sometimes any id (-1, removed or unknown ones: refused).
    const auto pick_id = [&] {
      const auto held = cache.sequences();
      const Index pick = choices.in(0, 15);
      if (held.empty() || pick >= 12) return choices.in(-1, 9);
      return held[static_cast<std::size_t>(pick) % held.size()];
    };
    const Index kind = choices.in(0, 6);
    try {
      if (kind == 0) {
        const Index id = cache.add_sequence();
        tokens[id].clear();
        prompts[id].clear();
      } else if (kind == 1) {
        const Index from = pick_id();
        const Index id = cache.fork(from);
        tokens[id] = tokens[from];
        prompts[id] = prompts[from];
      } else if (kind == 2) {
        const Index id = pick_id(), length = choices.in(0, 120);
        cache.truncate(id, length);
        tokens[id].resize(static_cast<std::size_t>(length));
        prompts[id].clear();  // (the tokens after it are no longer the prompt's)
      } else if (kind == 3) {
        const Index id = pick_id();
        cache.remove_sequence(id);
        tokens.erase(id);
        prompts.erase(id);
      } else if (kind == 4) {
        // A prompt: a prefix of one of the strings, sometimes with one id changed.
        auto prompt = strings[choices.flag() ? 1 : 0];
        prompt.resize(static_cast<std::size_t>(choices.in(0, kPromptLength)));
        const Index changed = choices.in(0, kPromptLength);
        if (changed < static_cast<Index>(prompt.size())) {
          auto& id = prompt[static_cast<std::size_t>(changed)];
          id = (id + 1) % kVocabulary;
        }
        const Index id = cache.add_sequence(prompt);
        const Index cached = cache.length(id);
        if (cached % cache.page_size() != 0 ||
            (cached > 0 && cached >= static_cast<Index>(prompt.size()))) {
          violation("a prompt of " + std::to_string(prompt.size()) + " tokens starts with " +
                    std::to_string(cached) + " cached");
        }
        tokens[id].assign(prompt.begin(), prompt.begin() + cached);
        shared_prefix = shared_prefix || cached > 0;
        prompts[id] = prompt;
      } else {
        // A step over up to four ids (possibly repeated or unknown: refused).
        std::vector<Index> ids, counts;
        for (Index i = 0, m = choices.in(1, 4); i < m; ++i) {
          ids.push_back(pick_id());
          counts.push_back(choices.flag() ? choices.in(0, 3) : choices.in(0, 60));
        }
        const Index n = *std::max_element(counts.begin(), counts.end());
        // Each sequence's next ids: its prompt's, then any.
        std::vector<std::vector<std::int64_t>> next(ids.size());
        Tensor<float> x({static_cast<Index>(ids.size()), n, E});
        for (std::size_t i = 0; i < ids.size(); ++i) {
          const auto& prompt = prompts[ids[i]];
          const std::size_t done = tokens[ids[i]].size();
          for (std::size_t t = 0; t < static_cast<std::size_t>(counts[i]); ++t) {
            next[i].push_back(done + t < prompt.size()
                                  ? prompt[done + t]
                                  : static_cast<std::int64_t>(choices.in(0, kVocabulary - 1)));
            x[static_cast<Index>(i)].matrix().row(static_cast<Index>(t)) =
                embeddings.matrix().row(next[i].back());
          }
        }
        // Every other step packed (options.cu_seqlens, x [T, E]: no padding rows), without a byte
        // of its own so that the corpus keeps its cases; its output put back in [B, n, E].
        Tensor<float> out;
        if (steps_run % 2 == 1) {
          std::vector<Index> starts{0};
          for (const Index new_count : counts) starts.push_back(starts.back() + new_count);
          Tensor<float> rows({starts.back(), E});
          for (std::size_t i = 0; i < ids.size(); ++i) {
            rows.matrix().middleRows(starts[i], counts[i]) =
                x[static_cast<Index>(i)].matrix().topRows(counts[i]);
          }
          auto packed_options = options;
          packed_options.cu_seqlens = starts;
          const auto packed = layer.decode(rows, cache, ids, packed_options).output;
          out = Tensor<float>(x.shape());
          for (std::size_t i = 0; i < ids.size(); ++i) {
            out[static_cast<Index>(i)].matrix().topRows(counts[i]) =
                packed.matrix().middleRows(starts[i], counts[i]);
          }
        } else {
          out = layer.decode(x, cache, ids, options, counts).output;
        }
        ++steps_run;
        if (!out.flat().allFinite()) violation("a step's output is not finite");
        for (std::size_t i = 0; i < ids.size(); ++i) {
          auto& history = tokens[ids[i]];
          const auto b = static_cast<Index>(i);
          history.insert(history.end(), next[i].begin(), next[i].end());
          if (!exact || counts[i] == 0) continue;
          const auto length = static_cast<Index>(history.size());
          Tensor<float> sequence({1, length, E});
          for (Index t = 0; t < length; ++t) {
            sequence[0].matrix().row(t) =
                embeddings.matrix().row(history[static_cast<std::size_t>(t)]);
          }
          const auto full = layer.forward(sequence, options).output;
          // test_kv_cache's bound for decoding against the forward: 1e-5 of the largest output.
          const auto expected = full[0].matrix().bottomRows(counts[i]);
          const double scale = full.flat().cwiseAbs().maxCoeff();
          const double error =
              (out[b].matrix().topRows(counts[i]) - expected).cwiseAbs().maxCoeff();
          if (error > 1e-5 * scale) {
            violation("sequence " + std::to_string(ids[i]) + ": a step is " +
                      std::to_string(error) + " from the forward (largest output " +
                      std::to_string(scale) + ")");
          }
        }
      }
    } catch (const mha::ShapeError&) {
      steps_refused += kind >= 5 ? 1 : 0;
      if (!(snapshot(cache) == before)) violation("a refused operation changed the cache");
    }
    check_accounting(cache);
  }
  tally.count(steps_run > 0 && shared_prefix ? 4 : steps_run > 0 ? 2 : steps_refused > 0 ? 3 : 1);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Choices choices(data, size);
  run(choices);
  return 0;
}
