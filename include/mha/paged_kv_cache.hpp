// PagedKVCache<T>: the keys and values of any number of sequences in one pool of fixed-size pages,
// as vLLM's PagedAttention keeps them, so that a server decoding requests of unknown lengths
// reserves memory a page at a time rather than the longest length for each.
//
// The pool holds num_pages pages of page_size token rows each, for keys and for values, allocated
// once at construction (in the layer's type, or quantized as KVCache's formats). Each sequence has
// a page table: its row j lives in page table[j / page_size] at row j % page_size. Sequences are
// added, extended by decoding steps (MultiHeadAttention::decode with the sequences' ids),
// truncated and removed without moving any other sequence's rows.
//
// fork(s) makes a sequence that shares every page of s (beam search, parallel sampling): a page
// is copied only when a step writes into it while another sequence still holds it, and then only
// that page (copy-on-write). A step that needs more pages than are free is refused before
// anything changes, with the pages it needed and the pages free.
//
// Prefix caching (vLLM's automatic prefix caching): a sequence added with its prompt's token ids,
// add_sequence(tokens), shares the pages of any earlier sequence whose first pages hold the same
// tokens (whole pages, from the first token on), so that only the rest of its prompt is decoded.
// A full page whose rows all hold known prompt tokens is registered under its tokens and those of
// the pages before it (compared exactly, not by hash alone); when no sequence holds it any more,
// it stays cached and counts as free, given to a step that needs it only after the free pages
// that hold nothing, least recently released first. The keys cached depend on the layer and on
// the step's options (RoPE's positions): a cache serves one layer with one set of options.
//
// A decoding step reads a sequence's pages where they lie: the decoding kernel looks each
// sub-block of rows up in the page table (kernels/decode.hpp), which is why page_size must be a
// multiple of 48 (no sub-block spans two pages, and a paged sequence gives the same bits as the
// same rows in a KVCache). A step of many tokens (a prompt) gathers its sequence's rows into one
// buffer first, as a quantized KVCache widens them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "mha/errors.hpp"
#include "mha/kernels/decode.hpp"
#include "mha/kernels/quantized_cache.hpp"
#include "mha/kv_cache.hpp"
#include "mha/tensor.hpp"

namespace mha {

// What a paged cache's pool holds now.
struct PagedKVCacheUsage {
  Index pages = 0;         // in the pool
  Index used_pages = 0;    // held by at least one sequence
  Index shared_pages = 0;  // held by two or more (fork, prefix caching): stored once
  Index cached_pages = 0;  // held by none, but kept for prefix caching (free when needed)
  Index sequences = 0;
  Index tokens = 0;  // every sequence's length, a shared page's rows counted for each holder
  // Rows of used pages that hold no token of any sequence: the last page of each sequence that
  // is not full (less than a page per sequence).
  Index unused_rows = 0;
};

template <class T>
class PagedKVCache {
 public:
  PagedKVCache() = default;
  // A pool of num_pages pages of page_size tokens (a multiple of 48), for H_kv key/value heads of
  // D features, stored as the layer's type or quantized (KVCacheFormat: H_kv·D a multiple of 32
  // and a layer that computes in float).
  PagedKVCache(Index num_kv_heads, Index head_dim, Index page_size, Index num_pages,
               KVCacheFormat format = KVCacheFormat::as_layer)
      : num_kv_heads_(num_kv_heads), head_dim_(head_dim), page_size_(page_size), format_(format) {
    if (num_kv_heads < 1 || head_dim < 1) {
      detail::throw_argument("num_kv_heads, head_dim", "expected positive, got " +
                                                           std::to_string(num_kv_heads) + ", " +
                                                           std::to_string(head_dim));
    }
    if (page_size < detail::kDecodePageGrain || page_size % detail::kDecodePageGrain != 0) {
      detail::throw_argument("page_size", "expected a positive multiple of " +
                                              std::to_string(detail::kDecodePageGrain) +
                                              " tokens, got " + std::to_string(page_size));
    }
    if (num_pages < 1) {
      detail::throw_argument("num_pages", "expected at least 1, got " + std::to_string(num_pages));
    }
    if (quantized()) detail::check_quantizable_cache<T>(format, num_kv_heads, head_dim);
    stored_.allocate(format, page_size * num_pages, num_kv_heads * head_dim);
    holders_.assign(static_cast<std::size_t>(num_pages), 0);
    page_key_.assign(static_cast<std::size_t>(num_pages), 0);
    page_previous_.assign(static_cast<std::size_t>(num_pages), -1);
    page_tokens_.resize(static_cast<std::size_t>(num_pages));
    // Taken from the back: page 0 first.
    for (Index page = num_pages - 1; page >= 0; --page) free_.push_back(page);
  }

  Index num_kv_heads() const { return num_kv_heads_; }
  Index head_dim() const { return head_dim_; }
  Index page_size() const { return page_size_; }
  Index num_pages() const { return static_cast<Index>(holders_.size()); }
  // Pages a step may take: those that hold nothing, and the cached ones no sequence holds.
  Index free_pages() const { return static_cast<Index>(free_.size() + released_.size()); }
  KVCacheFormat format() const { return format_; }
  bool quantized() const { return format_ != KVCacheFormat::as_layer; }
  // The bytes of the pool's keys and values, used or not (allocated at construction).
  std::size_t storage_bytes() const { return stored_.bytes(); }

  // ---- Sequences, named by the ids these return ----

  // A new sequence whose prompt is `tokens` (ids of any vocabulary), sharing the cached pages that
  // hold its first tokens (prefix caching, above): it starts with length() of them, a multiple of
  // page_size and less than tokens.size() (the last prompt token is always decoded, for its
  // output); decode its tokens from there on.
  Index add_sequence(const std::vector<std::int64_t>& tokens) {
    const Index id = add_sequence();
    Sequence& s = sequences_[static_cast<std::size_t>(id)];
    s.tokens = tokens;
    const auto usable = static_cast<Index>(tokens.empty() ? 0 : (tokens.size() - 1)) / page_size_;
    std::uint64_t key = kPrefixSeed;
    for (Index k = 0; k < usable; ++k) {
      const Index page = cached_page(key, s.tokens, k, s.pages.empty() ? -1 : s.pages.back());
      if (page < 0) break;
      key = prefix_key(key, s.tokens, k);
      s.chain.push_back(key);
      if (holders_[static_cast<std::size_t>(page)]++ == 0) {
        released_.erase(std::find(released_.begin(), released_.end(), page));
      }
      s.pages.push_back(page);
      s.length += page_size_;
    }
    return id;
  }

  // A new empty sequence; it takes pages as steps fill it. Ids of removed sequences are reused.
  Index add_sequence() {
    const auto slot = std::find_if(sequences_.begin(), sequences_.end(),
                                   [](const Sequence& s) { return !s.live; });
    const auto id = static_cast<Index>(slot - sequences_.begin());
    if (slot == sequences_.end()) sequences_.emplace_back();
    sequences_[static_cast<std::size_t>(id)].live = true;
    return id;
  }
  // A new sequence holding the same tokens as `sequence`, sharing its pages until either writes
  // into one of them (then that page is copied for the writer).
  Index fork(Index sequence) {
    checked(sequence);
    const Index id = add_sequence();  // (may reallocate sequences_: index again below)
    Sequence& copy = sequences_[static_cast<std::size_t>(id)];
    copy = sequences_[static_cast<std::size_t>(sequence)];
    for (const Index page : copy.pages) ++holders_[static_cast<std::size_t>(page)];
    return id;
  }
  // Keeps the first `length` tokens of `sequence` (a rejected draft, a shortened beam); pages
  // after them return to the pool unless another sequence holds them too.
  void truncate(Index sequence, Index length) {
    Sequence& s = checked(sequence);
    if (length < 0 || length > s.length) {
      detail::throw_argument("length", "sequence " + std::to_string(sequence) +
                                           " can be truncated to a length in [0, " +
                                           std::to_string(s.length) + "], got " +
                                           std::to_string(length));
    }
    const Index keep = pages_for(length);
    for (auto page = s.pages.begin() + keep; page != s.pages.end(); ++page) release(*page);
    s.pages.resize(static_cast<std::size_t>(keep));
    s.length = length;
    // (Tokens after the new length are no longer the sequence's: a step writes others.)
    if (static_cast<Index>(s.tokens.size()) > length) {
      s.tokens.resize(static_cast<std::size_t>(length));
    }
    if (static_cast<Index>(s.chain.size()) > length / page_size_) {
      s.chain.resize(static_cast<std::size_t>(length / page_size_));
    }
  }
  // Removes `sequence`, returning the pages only it held to the pool.
  void remove_sequence(Index sequence) {
    truncate(sequence, 0);
    checked(sequence).live = false;
  }
  bool contains(Index sequence) const {
    return sequence >= 0 && sequence < static_cast<Index>(sequences_.size()) &&
           sequences_[static_cast<std::size_t>(sequence)].live;
  }
  // The ids of the sequences held, in increasing order.
  std::vector<Index> sequences() const {
    std::vector<Index> ids;
    for (Index id = 0; id < static_cast<Index>(sequences_.size()); ++id) {
      if (contains(id)) ids.push_back(id);
    }
    return ids;
  }
  // Tokens `sequence` holds: the position of its next token.
  Index length(Index sequence) const { return checked(sequence).length; }
  Index position(Index sequence) const { return length(sequence); }
  // The pool's pages that hold `sequence`'s rows, in order.
  const std::vector<Index>& page_table(Index sequence) const { return checked(sequence).pages; }
  // The free pages a step appending `count` tokens to `sequence` takes: new pages, and a copy of
  // its last page where that page is not full and shared or registered (prefix caching).
  Index pages_needed(Index sequence, Index count) const {
    const Sequence& s = checked(sequence);
    if (count <= 0) return 0;
    const Index grown = pages_for(s.length + count) - static_cast<Index>(s.pages.size());
    return grown + (copies_last_page(s) ? 1 : 0);
  }

  // ... for a step appending counts[i] tokens to each of `sequences` (distinct): sequences that
  // share a last page copy it, but the last of its holders to write keeps it (unless the page is
  // registered for prefix caching).
  Index pages_needed(const std::vector<Index>& sequences, const std::vector<Index>& counts) const {
    Index needed = 0;
    std::vector<std::pair<Index, Index>> writers;  // (a shared last page, holders writing it)
    for (std::size_t i = 0; i < sequences.size(); ++i) {
      const Sequence& s = checked(sequences[i]);
      if (counts[i] <= 0) continue;
      needed += pages_for(s.length + counts[i]) - static_cast<Index>(s.pages.size());
      if (!copies_last_page(s)) continue;
      const auto known = std::find_if(writers.begin(), writers.end(),
                                      [&](const auto& w) { return w.first == s.pages.back(); });
      if (known == writers.end()) {
        writers.emplace_back(s.pages.back(), 1);
      } else {
        ++known->second;
      }
    }
    for (const auto& [page, count] : writers) {
      // A registered page's rows stay as registered: each writer copies it.
      needed += registered(page)
                    ? count
                    : std::min<Index>(count, holders_[static_cast<std::size_t>(page)] - 1);
    }
    return needed;
  }

  PagedKVCacheUsage usage() const {
    PagedKVCacheUsage usage;
    usage.pages = num_pages();
    usage.used_pages = num_pages() - free_pages();
    usage.cached_pages = static_cast<Index>(released_.size());
    for (const Index holders : holders_) usage.shared_pages += holders > 1 ? 1 : 0;
    for (const Sequence& s : sequences_) {
      if (!s.live) continue;
      ++usage.sequences;
      usage.tokens += s.length;
    }
    // Each used page's rows that some holder fills.
    std::vector<Index> filled(holders_.size(), 0);
    for (const Sequence& s : sequences_) {
      for (std::size_t i = 0; s.live && i < s.pages.size(); ++i) {
        const Index rows = std::min(page_size_, s.length - static_cast<Index>(i) * page_size_);
        auto& most = filled[static_cast<std::size_t>(s.pages[i])];
        most = std::max(most, rows);
      }
    }
    for (std::size_t page = 0; page < holders_.size(); ++page) {
      if (holders_[page] > 0) usage.unused_rows += page_size_ - filled[page];
    }
    return usage;
  }

  // The keys and values of `sequence`, oldest first, gathered from its pages: [length, H_kv·D],
  // head h in columns h·D .. h·D + D - 1 (rotated when the steps used rotary embeddings). A
  // quantized cache holds no such rows: read it with dequantized_keys and dequantized_values.
  Tensor<T> keys(Index sequence) const { return gathered(sequence, false); }
  Tensor<T> values(Index sequence) const { return gathered(sequence, true); }
  // The same rows as float, in any format: a quantized cache's as its codes stand for them.
  Tensor<float> dequantized_keys(Index sequence) const { return dequantized(sequence, false); }
  Tensor<float> dequantized_values(Index sequence) const { return dequantized(sequence, true); }

 private:
  friend struct detail::Decoding<T>;  // a decoding step writes the rows and uses the buffers

  struct Sequence {
    bool live = false;
    Index length = 0;
    std::vector<Index> pages;
    std::vector<std::int64_t> tokens;  // the prompt's token ids, where add_sequence had them
    // The keys of its first pages, each registered as its page (prefix caching): where the next
    // step's registration goes on.
    std::vector<std::uint64_t> chain;
  };
  static constexpr std::uint64_t kPrefixSeed = 0x9E3779B97F4A7C15ULL;

  Sequence& checked(Index sequence) {
    return const_cast<Sequence&>(std::as_const(*this).checked(sequence));
  }
  const Sequence& checked(Index sequence) const {
    if (!contains(sequence)) {
      detail::throw_argument("sequence", "expected the id of a sequence this cache holds (" +
                                             std::to_string(sequences().size()) + " held), got " +
                                             std::to_string(sequence));
    }
    return sequences_[static_cast<std::size_t>(sequence)];
  }
  Index width() const { return num_kv_heads_ * head_dim_; }
  Index blocks() const { return width() / detail::kQuantBlock; }
  Index pages_for(Index rows) const { return (rows + page_size_ - 1) / page_size_; }
  bool registered(Index page) const { return page_key_[static_cast<std::size_t>(page)] != 0; }
  // A step writing into a sequence's last page (not full) copies it first where another sequence
  // holds it, or prefix caching has registered its rows.
  bool copies_last_page(const Sequence& s) const {
    if (s.length % page_size_ == 0) return false;
    const Index page = s.pages.back();
    return holders_[static_cast<std::size_t>(page)] > 1 || registered(page);
  }
  void release(Index page) {
    if (--holders_[static_cast<std::size_t>(page)] > 0) return;
    (registered(page) ? released_ : free_).push_back(page);
  }
  // A page for a step: one that holds nothing, or else the cached page released longest ago
  // (forgotten by prefix caching).
  Index take_page() {
    Index page = -1;
    if (!free_.empty()) {
      page = free_.back();
      free_.pop_back();
    } else {
      page = released_.front();
      released_.erase(released_.begin());
      forget(page);
    }
    holders_[static_cast<std::size_t>(page)] = 1;
    return page;
  }

  // ---- Prefix caching: full pages of known prompt tokens, by their tokens and their prefix's ----

  // The key of a sequence's first k + 1 pages, from the key of its first k (k = 0: kPrefixSeed).
  // FNV-1a over the page's tokens; a key only finds candidates, cached_page compares the tokens.
  std::uint64_t prefix_key(std::uint64_t key, const std::vector<std::int64_t>& tokens,
                           Index k) const {
    for (Index t = k * page_size_; t < (k + 1) * page_size_; ++t) {
      key = (key ^ static_cast<std::uint64_t>(tokens[static_cast<std::size_t>(t)])) *
            0x100000001B3ULL;
    }
    return key == 0 ? 1 : key;  // (0 marks a page with no key)
  }
  // The registered page that holds page k of `tokens` after page `previous` (-1 for k = 0), or -1.
  Index cached_page(std::uint64_t key, const std::vector<std::int64_t>& tokens, Index k,
                    Index previous) const {
    const auto found = registry_.find(prefix_key(key, tokens, k));
    if (found == registry_.end()) return -1;
    const Index page = found->second;
    const auto& held = page_tokens_[static_cast<std::size_t>(page)];
    const auto first = tokens.begin() + k * page_size_;
    const bool same = page_previous_[static_cast<std::size_t>(page)] == previous &&
                      std::equal(held.begin(), held.end(), first, first + page_size_);
    return same ? page : -1;
  }
  // After a step: registers sequence `sequence`'s full pages of known tokens after its chain of
  // registered ones. A page whose tokens another page holds already stays unregistered, and ends
  // the chain (so do pages after one that was forgotten): every registered page's previous is
  // registered.
  void register_pages(Index sequence) {
    Sequence& s = sequences_[static_cast<std::size_t>(sequence)];
    const Index full = std::min(s.length, static_cast<Index>(s.tokens.size())) / page_size_;
    for (auto k = static_cast<Index>(s.chain.size()); k < full; ++k) {
      const Index page = s.pages[static_cast<std::size_t>(k)];
      const Index previous = k == 0 ? -1 : s.pages[static_cast<std::size_t>(k - 1)];
      if (k > 0 && !registered(previous)) return;
      const std::uint64_t key = prefix_key(k == 0 ? kPrefixSeed : s.chain.back(), s.tokens, k);
      if (!registered(page) && registry_.count(key) == 0) {
        registry_.emplace(key, page);
        page_key_[static_cast<std::size_t>(page)] = key;
        page_previous_[static_cast<std::size_t>(page)] = previous;
        const auto first = s.tokens.begin() + k * page_size_;
        page_tokens_[static_cast<std::size_t>(page)].assign(first, first + page_size_);
      }
      const auto found = registry_.find(key);
      if (found == registry_.end() || found->second != page) return;
      s.chain.push_back(key);
    }
  }

  // Unregisters a page about to be reused, and the pages registered after it (their key was made
  // from its tokens): a cached one of those then holds nothing.
  void forget(Index page) {
    std::vector<Index> pages{page};  // to forget: the page, then the pages registered after them
    while (!pages.empty()) {
      const Index forgotten = pages.back();
      pages.pop_back();
      registry_.erase(page_key_[static_cast<std::size_t>(forgotten)]);
      page_key_[static_cast<std::size_t>(forgotten)] = 0;
      page_tokens_[static_cast<std::size_t>(forgotten)].clear();
      for (Index next = 0; next < num_pages(); ++next) {
        if (!registered(next) || page_previous_[static_cast<std::size_t>(next)] != forgotten) {
          continue;
        }
        pages.push_back(next);
        const auto cached = std::find(released_.begin(), released_.end(), next);
        if (cached != released_.end()) {
          released_.erase(cached);
          free_.push_back(next);
        }
      }
      page_previous_[static_cast<std::size_t>(forgotten)] = -1;
    }
  }

  // Makes room for `count` more rows of `sequence`: its last page copied if shared (the rows it
  // holds), then new pages. Checked by the caller: pages_needed(sequence, count) are free.
  void reserve(Index sequence, Index count) {
    Sequence& s = checked(sequence);
    if (count <= 0) return;
    if (copies_last_page(s)) {
      const Index shared = s.pages.back(), page = take_page();
      const Index rows = s.length % page_size_;
      stored_.for_each(format_, width(), [&](auto* buffer, Index row_elements) {
        const auto* from = buffer + shared * page_size_ * row_elements;
        std::copy(from, from + rows * row_elements, buffer + page * page_size_ * row_elements);
      });
      release(shared);
      s.pages.back() = page;
    }
    while (static_cast<Index>(s.pages.size()) < pages_for(s.length + count)) {
      s.pages.push_back(take_page());
    }
  }
  // The pool's row that holds row j of `sequence` (reserved).
  Index pool_row(Index sequence, Index j) const {
    const Sequence& s = sequences_[static_cast<std::size_t>(sequence)];
    return s.pages[static_cast<std::size_t>(j / page_size_)] * page_size_ + j % page_size_;
  }
  Tensor<T> gathered(Index sequence, bool values) const {
    const Sequence& s = checked(sequence);
    if (quantized()) {
      detail::throw_argument("keys, values",
                             std::string("they gather the rows of a cache that stores the "
                                         "layer's type; this one is ") +
                                 kv_cache_format_name(format_) +
                                 ": read it with dequantized_keys() and dequantized_values()");
    }
    Tensor<T> out({s.length, width()});
    const T* pool = (values ? stored_.values : stored_.keys).data();
    for (Index j = 0; j < s.length; ++j) {
      const T* row = pool + pool_row(sequence, j) * width();
      std::copy(row, row + width(), out.data() + j * width());
    }
    return out;
  }
  Tensor<float> dequantized(Index sequence, bool values) const {
    const Sequence& s = checked(sequence);
    Tensor<float> out({s.length, width()});
    Matrix<float> row(1, width());
    for (Index j = 0; j < s.length; ++j) {
      const Index at = pool_row(sequence, j);
      if (format_ == KVCacheFormat::q8) {
        detail::dequantize_rows(
            (values ? stored_.q8_values : stored_.q8_keys).data() + at * blocks(), 1, width(),
            blocks(), row);
      } else if (format_ == KVCacheFormat::q4) {
        detail::dequantize_rows(
            (values ? stored_.q4_values : stored_.q4_keys).data() + at * blocks(), 1, width(),
            blocks(), row);
      } else {
        const T* stored = (values ? stored_.values : stored_.keys).data() + at * width();
        for (Index e = 0; e < width(); ++e) row(0, e) = static_cast<float>(stored[e]);
      }
      std::copy(row.data(), row.data() + width(), out.data() + j * width());
    }
    return out;
  }

  Index num_kv_heads_ = 0, head_dim_ = 0, page_size_ = 0;
  KVCacheFormat format_ = KVCacheFormat::as_layer;
  detail::StoredRows<T> stored_;  // [num_pages · page_size, H_kv·D] rows
  std::vector<Sequence> sequences_;
  std::vector<std::int32_t> holders_;  // per page: the sequences that hold it (0: free)
  std::vector<Index> free_;            // pages that hold nothing, taken from the back
  // Prefix caching: registered pages by key; per page its key (0: none), the page before it in
  // its sequence when registered, and its tokens; registered pages no sequence holds, oldest
  // release first.
  std::unordered_map<std::uint64_t, Index> registry_;
  std::vector<std::uint64_t> page_key_;
  std::vector<Index> page_previous_;
  std::vector<std::vector<std::int64_t>> page_tokens_;
  std::vector<Index> released_;
  detail::DecodeStepBuffers<T> step_;
};

}  // namespace mha
