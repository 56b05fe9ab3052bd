// Decoding with a KV cache: each step projects only the new tokens x [B, n, E] (or [n, E] for a
// cache of one sequence), appends their keys and values [n, H_kv·D] (rotated at their absolute
// positions) to each sequence's cache (kv_cache.hpp, or a paged cache's pages: paged_kv_cache.hpp),
// and attends to that sequence's cached
// [length, H_kv·D] keys and values, bottom-right aligned: the output is that of one causal
// forward over the whole sequence, for the new tokens.
#pragma once

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

#include "mha/compiled.hpp"
#include "mha/finite.hpp"
#include "mha/kernels/decode.hpp"
#include "mha/kv_cache.hpp"
#include "mha/layer/forward.hpp"
#include "mha/layer/parameters.hpp"
#include "mha/layer/projections.hpp"
#include "mha/paged_kv_cache.hpp"
#include "mha/rotary.hpp"

namespace mha::detail {

// The decoding room: a struct rather than free functions because it reads the caches' own rows
// and buffers (KVCache and PagedKVCache befriend it). One step runs the same way over either
// cache (run); the two differ only in where a sequence's rows live, which Contiguous and Paged
// below tell it.
template <class T>
struct Decoding {
  using Compute = compute_t<T>;

  // One step; new_tokens (empty, or one count per sequence) as MultiHeadAttention::decode;
  // packed: null, or a frozen layer's packed weights: its bf16 panels under Precision::bf16 (which
  // the layer, whose weights would be packed at every step, refuses) and its int8 weights.
  static ForwardResult<T> step(const LayerParameters<T>& parameters, const TensorView<const T>& x,
                               KVCache<T>& cache, const ForwardOptions<T>& options,
                               const std::vector<Index>& new_tokens,
                               const PackedProjections* packed = nullptr) {
    Contiguous steps{cache};
    return run(parameters, x, steps, options, new_tokens, packed);
  }
  // ... over a paged cache's `sequences` (row b of x is sequence sequences[b]'s).
  static ForwardResult<T> step(const LayerParameters<T>& parameters, const TensorView<const T>& x,
                               PagedKVCache<T>& cache, const std::vector<Index>& sequences,
                               const ForwardOptions<T>& options,
                               const std::vector<Index>& new_tokens,
                               const PackedProjections* packed = nullptr) {
    if (sequences.empty()) {
      throw_argument("sequences", "expected at least one sequence id, got none");
    }
    Paged steps{cache, sequences};
    return run(parameters, x, steps, options, new_tokens, packed);
  }
  // The same two steps with a user's mods (flex_layer.hpp's flex_decode).
  template <class Flex>
  static ForwardResult<T> flex_step(const LayerParameters<T>& parameters,
                                    const TensorView<const T>& x, KVCache<T>& cache,
                                    const ForwardOptions<T>& options,
                                    const std::vector<Index>& new_tokens, const Flex& flex) {
    Contiguous steps{cache};
    return run(parameters, x, steps, options, new_tokens, nullptr, flex);
  }
  template <class Flex>
  static ForwardResult<T> flex_step(const LayerParameters<T>& parameters,
                                    const TensorView<const T>& x, PagedKVCache<T>& cache,
                                    const std::vector<Index>& sequences,
                                    const ForwardOptions<T>& options,
                                    const std::vector<Index>& new_tokens, const Flex& flex) {
    if (sequences.empty()) {
      throw_argument("sequences", "expected at least one sequence id, got none");
    }
    Paged steps{cache, sequences};
    return run(parameters, x, steps, options, new_tokens, nullptr, flex);
  }
  // A cross-attention step: x's queries attend to every row of `memory`'s sequences, which
  // encode filled, appending nothing.
  static ForwardResult<T> cross_step(const LayerParameters<T>& parameters,
                                     const TensorView<const T>& x, KVCache<T>& memory,
                                     const ForwardOptions<T>& options,
                                     const std::vector<Index>& new_tokens,
                                     const PackedProjections* packed = nullptr) {
    Memory steps{Contiguous{memory}};
    return run(parameters, x, steps, options, new_tokens, packed);
  }
  // memory [B, S, kdim] ([S, kdim] for one sequence), an encoder's output, projected into keys
  // and values once, into `cache` (B sequences, capacity S, empty): sequence b holds its first
  // lengths[b] rows (all S without lengths).
  static void encode(const LayerParameters<T>& parameters, const TensorView<const T>& memory,
                     KVCache<T>& cache, const std::vector<Index>& lengths);

 private:
  // A step's `count` new rows of keys and values [count, H_kv·D] narrowed to the layer's type, or
  // quantized, at `key_row` and `value_row` (a quantized format's blocks: Stored).
  template <class Stored>
  static void store_rows(Index count, Index width, const Compute* keys, const Compute* values,
                         Stored* key_row, Stored* value_row) {
    if constexpr (is_quantized_block_v<Stored>) {
      if constexpr (std::is_same_v<Compute, float>) {  // (only such a layer's cache is quantized)
        quantize_rows(keys, count, width, key_row);
        quantize_rows(values, count, width, value_row);
      }
    } else {
      narrow(keys, count * width, key_row);
      narrow(values, count * width, value_row);
    }
  }

  // A KVCache's sequences, as a step sees them: sequence b is the cache's row b.
  struct Contiguous {
    KVCache<T>& cache;
    // Each sequence's first key row: where its rows begin (after reserve, before advance).
    std::vector<Index> starts{};

    Index batch() const { return cache.batch(); }
    DecodeStepBuffers<T>& buffers() { return cache.step_; }
    Index num_kv_heads() const { return cache.num_kv_heads(); }
    Index head_dim() const { return cache.head_dim(); }
    Index length(Index b) const { return cache.length(b); }
    Index position(Index b) const { return cache.position(b); }
    KVCacheFormat format() const { return cache.format(); }

    // What the cache refuses of a step of counts[b] tokens, before anything changes.
    void check(const ForwardOptions<T>& options, const std::vector<Index>& counts) const {
      for (Index b = 0; b < batch(); ++b) {
        const Index count = counts[static_cast<std::size_t>(b)];
        if (cache.length(b) + count > cache.capacity()) {
          throw_argument("cache", "sequence " + std::to_string(b) + " holds " +
                                      std::to_string(cache.length(b)) + " keys of its capacity " +
                                      std::to_string(cache.capacity()) + "; " +
                                      std::to_string(count) + " more do not fit");
        }
      }
      if (cache.sliding() && (options.window.left < 0 || options.window.left > cache.window())) {
        throw_argument("window.left",
                       "a sliding-window cache keeping the last " + std::to_string(cache.window()) +
                           " keys serves windows of at most that many keys to the left, got " +
                           std::to_string(options.window.left) +
                           (options.window.left < 0 ? " (unbounded)" : ""));
      }
      if (cache.streaming() && (options.window.active() || options.pattern.active())) {
        throw_argument("window/pattern",
                       "a streaming cache decides which keys a token sees (its sinks and its "
                       "last " +
                           std::to_string(cache.window()) +
                           " tokens), at positions inside the cache: set neither");
      }
      if (cache.sliding() && options.pattern.active()) {
        throw_argument("pattern",
                       "global tokens and block layouts are over absolute positions, which a "
                       "sliding-window cache drops: use a cache that keeps every token");
      }
    }

    // `count` rows of keys and values into sequence b's rows from `row` on, in the cache's format.
    void store_at(Index b, Index row, Index count, const Compute* keys, const Compute* values) {
      const Index width = cache.width();
      if (cache.format() == KVCacheFormat::q8) {
        store_rows(count, width, keys, values, cache.template block_row<Q8Block>(false, b, row),
                   cache.template block_row<Q8Block>(true, b, row));
      } else if (cache.format() == KVCacheFormat::q4) {
        store_rows(count, width, keys, values, cache.template block_row<Q4Block>(false, b, row),
                   cache.template block_row<Q4Block>(true, b, row));
      } else {
        store_rows(count, width, keys, values, cache.key_row(b, row), cache.value_row(b, row));
      }
    }

    // Before the step's keys are rotated: a streaming cache keeps its first tokens' keys
    // unrotated (and their values), to rotate them again whenever tokens are dropped.
    void keep_sinks(Index b, Index count, const Compute* keys, const Compute* values) {
      const Index position = cache.position(b), sinks = cache.sink_tokens();
      if (position >= sinks) return;
      const Index width = cache.width(), rows = std::min(count, sinks - position);
      std::copy(keys, keys + rows * width, cache.sink_rows(false, b) + position * width);
      std::copy(values, values + rows * width, cache.sink_rows(true, b) + position * width);
    }

    // After the step (its kernels have read every row): where a streaming cache dropped tokens,
    // its sinks are written before the rows it kept, rotated at positions dropped .. dropped +
    // sinks - 1 so that each key sits as far from the next query as inside the cache.
    void settle(Index b, const ForwardOptions<T>& options, Index rotary_dim) {
      const auto i = static_cast<std::size_t>(b);
      if (!cache.streaming() || !cache.sinks_moved_[i]) return;
      cache.sinks_moved_[i] = false;
      const Index sinks = cache.sink_tokens(), width = cache.width();
      Matrix<Compute>& rotated = cache.step_.sink_keys;
      rotated.resize(sinks, width);
      const Compute* unrotated = cache.sink_rows(false, b);
      std::copy(unrotated, unrotated + sinks * width, rotated.data());
      if (options.rope) {
        RopeTable<Compute>& table = cache.step_.rope_table;
        table.fill(*options.rope, rotary_dim, cache.position(b) - cache.length(b), sinks);
        rotate_heads(rotated.data(), sinks, width, cache.num_kv_heads(), cache.head_dim(), table,
                     false);
      }
      store_at(b, cache.start_[i], sinks, rotated.data(), cache.sink_rows(true, b));
    }

    // Sequence b's `count` new rows into its cache; returns the keys its step attends to.
    Index append(Index b, Index count, const Compute* keys, const Compute* values) {
      const Index first = cache.reserve(b, count);
      store_at(b, first, count, keys, values);
      starts.resize(static_cast<std::size_t>(batch()));
      const Index start = cache.start_[static_cast<std::size_t>(b)];
      starts[static_cast<std::size_t>(b)] = start;
      return first + count - start;
    }

    // Sequence b's step for the decoding kernel, in the list of its storage type.
    void add_to_kernel(Index b, const float* queries, float* attended, Index count, Index keys) {
      const Index start = starts[static_cast<std::size_t>(b)];
      if (cache.format() == KVCacheFormat::q8) {
        enlist(cache.step_.q8_sequences, b,
               {queries, attended, cache.template block_row<Q8Block>(false, b, start),
                cache.template block_row<Q8Block>(true, b, start), count, keys});
      } else if (cache.format() == KVCacheFormat::q4) {
        enlist(cache.step_.q4_sequences, b,
               {queries, attended, cache.template block_row<Q4Block>(false, b, start),
                cache.template block_row<Q4Block>(true, b, start), count, keys});
      } else {
        enlist(
            cache.step_.sequences, b,
            {queries, attended, cache.key_row(b, start), cache.value_row(b, start), count, keys});
      }
    }

    // attend(keys, values) with sequence b's `rows` cached rows [rows, H_kv·D] in one buffer each:
    // the cache's own, or a quantized cache's widened into the step's buffers.
    template <class Attend>
    void with_rows(Index b, Index rows, Attend&& attend) {
      const Index start = starts[static_cast<std::size_t>(b)];
      const Index width = cache.width(), blocks = width / kQuantBlock;
      auto& step = cache.step_;
      if (cache.format() == KVCacheFormat::as_layer || !std::is_same_v<Compute, float>) {
        attend(static_cast<const T*>(cache.key_row(b, start)),
               static_cast<const T*>(cache.value_row(b, start)));
        return;
      }
      step.widened_keys.resize(rows, width);
      step.widened_values.resize(rows, width);
      if (cache.format() == KVCacheFormat::q8) {
        dequantize_rows(cache.template block_row<Q8Block>(false, b, start), rows, width, blocks,
                        step.widened_keys);
        dequantize_rows(cache.template block_row<Q8Block>(true, b, start), rows, width, blocks,
                        step.widened_values);
      } else {
        dequantize_rows(cache.template block_row<Q4Block>(false, b, start), rows, width, blocks,
                        step.widened_keys);
        dequantize_rows(cache.template block_row<Q4Block>(true, b, start), rows, width, blocks,
                        step.widened_values);
      }
      if constexpr (std::is_same_v<Compute, float>) {  // (only such a layer's cache is quantized)
        attend(static_cast<const float*>(step.widened_keys.data()),
               static_cast<const float*>(step.widened_values.data()));
      }
    }

    // After sequence b's step: a sliding cache may drop its oldest keys (no rows move).
    void advance(Index b, Index count) { cache.advance(b, count); }
  };

  // A cross-attention memory (encode): a KVCache that an encoder's output filled once. A step
  // reads every row of its sequence and stores nothing, so keys and values are not projected.
  struct Memory : Contiguous {
    // What cross-attention refuses: what places queries and keys on one axis of positions.
    void check(const ForwardOptions<T>& options, const std::vector<Index>& counts) const {
      arguments_unused(counts);
      const auto refuse = [](bool given, const char* name, const char* why) {
        if (given) throw_argument(name, std::string("not in cross-attention: ") + why);
      };
      refuse(options.is_causal, "is_causal",
             "a query sees every token of the memory; set it false "
             "(cross_attention_options() does)");
      refuse(options.rope.has_value(), "rope",
             "the memory's tokens have no positions relative to the queries");
      refuse(options.window.active() || options.pattern.active() || !options.alibi_slopes.empty(),
             "window/pattern/alibi_slopes",
             "they measure distances between queries and keys, which cross-attention lacks");
    }
    // Where sequence b's rows are; it attends to all of them.
    Index append(Index b, Index count, const Compute* keys, const Compute* values) {
      arguments_unused(count, keys, values);
      this->starts.resize(static_cast<std::size_t>(this->batch()));
      this->starts[static_cast<std::size_t>(b)] = this->cache.start_[static_cast<std::size_t>(b)];
      return this->cache.length(b);
    }
    void advance(Index b, Index count) { arguments_unused(b, count); }
  };

  // A paged cache's sequences of a step: sequence b is the cache's sequences[b].
  struct Paged {
    PagedKVCache<T>& cache;
    const std::vector<Index>& ids;

    Index batch() const { return static_cast<Index>(ids.size()); }
    DecodeStepBuffers<T>& buffers() { return cache.step_; }
    Index num_kv_heads() const { return cache.num_kv_heads(); }
    Index head_dim() const { return cache.head_dim(); }
    Index id(Index b) const { return ids[static_cast<std::size_t>(b)]; }
    Index length(Index b) const { return cache.length(id(b)); }
    Index position(Index b) const { return cache.position(id(b)); }
    KVCacheFormat format() const { return cache.format(); }

    void check(const ForwardOptions<T>& options, const std::vector<Index>& counts) const {
      arguments_unused(options);
      for (Index b = 0; b < batch(); ++b) {
        cache.checked(id(b));  // (throws for an id the cache does not hold)
        for (Index other = 0; other < b; ++other) {
          if (id(other) == id(b)) {
            throw_argument("sequences", "expected distinct ids, got " + std::to_string(id(b)) +
                                            " at " + std::to_string(other) + " and " +
                                            std::to_string(b));
          }
        }
      }
      const Index needed = cache.pages_needed(ids, counts);
      if (needed > cache.free_pages()) {
        throw_argument("cache", "the step needs " + std::to_string(needed) + " free pages of " +
                                    std::to_string(cache.page_size()) + " tokens, the pool has " +
                                    std::to_string(cache.free_pages()) + " of " +
                                    std::to_string(cache.num_pages()) +
                                    " (remove or truncate sequences, or make a larger pool)");
      }
    }

    Index append(Index b, Index count, const Compute* keys, const Compute* values) {
      const Index sequence = id(b), first = cache.length(sequence);
      cache.reserve(sequence, count);
      const Index width = cache.width(), blocks = cache.blocks(), page = cache.page_size();
      // A page's worth of rows at a time.
      for (Index j = first, done = 0; done < count; j += page - j % page) {
        const Index rows = std::min(page - j % page, count - done);
        const Index at = cache.pool_row(sequence, j);
        const Compute* k = keys + done * width;
        const Compute* v = values + done * width;
        if (cache.format() == KVCacheFormat::q8) {
          store_rows(rows, width, k, v, cache.stored_.q8_keys.data() + at * blocks,
                     cache.stored_.q8_values.data() + at * blocks);
        } else if (cache.format() == KVCacheFormat::q4) {
          store_rows(rows, width, k, v, cache.stored_.q4_keys.data() + at * blocks,
                     cache.stored_.q4_values.data() + at * blocks);
        } else {
          store_rows(rows, width, k, v, cache.stored_.keys.data() + at * width,
                     cache.stored_.values.data() + at * width);
        }
        done += rows;
      }
      cache.checked(sequence).length = first + count;
      cache.register_pages(sequence);
      return first + count;
    }

    void add_to_kernel(Index b, const float* queries, float* attended, Index count, Index keys) {
      const Index* table = cache.page_table(id(b)).data();
      const Index page = cache.page_size();
      if (cache.format() == KVCacheFormat::q8) {
        enlist(cache.step_.q8_sequences, b,
               {queries, attended, cache.stored_.q8_keys.data(), cache.stored_.q8_values.data(),
                count, keys, table, page});
      } else if (cache.format() == KVCacheFormat::q4) {
        enlist(cache.step_.q4_sequences, b,
               {queries, attended, cache.stored_.q4_keys.data(), cache.stored_.q4_values.data(),
                count, keys, table, page});
      } else {
        enlist(cache.step_.sequences, b,
               {queries, attended, cache.stored_.keys.data(), cache.stored_.values.data(), count,
                keys, table, page});
      }
    }

    // attend(keys, values) with sequence b's `rows` rows gathered from its pages (widened from a
    // quantized cache's) into the step's buffers.
    template <class Attend>
    void with_rows(Index b, Index rows, Attend&& attend) {
      const Index sequence = id(b), width = cache.width(), blocks = cache.blocks();
      const Index page = cache.page_size();
      auto& step = cache.step_;
      const bool as_layer = cache.format() == KVCacheFormat::as_layer;
      if (as_layer) {
        step.gathered_keys.resize(rows, width);
        step.gathered_values.resize(rows, width);
      } else {
        step.widened_keys.resize(rows, width);
        step.widened_values.resize(rows, width);
      }
      for (Index j = 0; j < rows; j += page) {
        const Index count = std::min(page, rows - j), at = cache.pool_row(sequence, j);
        if (cache.format() == KVCacheFormat::q8) {
          dequantize_rows(cache.stored_.q8_keys.data() + at * blocks, count, width, blocks,
                          step.widened_keys.data() + j * width, width);
          dequantize_rows(cache.stored_.q8_values.data() + at * blocks, count, width, blocks,
                          step.widened_values.data() + j * width, width);
        } else if (cache.format() == KVCacheFormat::q4) {
          dequantize_rows(cache.stored_.q4_keys.data() + at * blocks, count, width, blocks,
                          step.widened_keys.data() + j * width, width);
          dequantize_rows(cache.stored_.q4_values.data() + at * blocks, count, width, blocks,
                          step.widened_values.data() + j * width, width);
        } else {
          const T* k = cache.stored_.keys.data() + at * width;
          const T* v = cache.stored_.values.data() + at * width;
          std::copy(k, k + count * width, step.gathered_keys.data() + j * width);
          std::copy(v, v + count * width, step.gathered_values.data() + j * width);
        }
      }
      if (as_layer) {
        attend(static_cast<const T*>(step.gathered_keys.data()),
               static_cast<const T*>(step.gathered_values.data()));
      } else if constexpr (std::is_same_v<Compute, float>) {  // (as Contiguous::with_rows)
        attend(static_cast<const float*>(step.widened_keys.data()),
               static_cast<const float*>(step.widened_values.data()));
      }
    }

    void advance(Index b, Index count) { arguments_unused(b, count); }  // (append did)
    void keep_sinks(Index b, Index count, const Compute* keys, const Compute* values) {
      arguments_unused(b, count, keys, values);
    }
    void settle(Index b, const ForwardOptions<T>& options, Index rotary_dim) {
      arguments_unused(b, options, rotary_dim);
    }
  };

  // Sequence b of a step into the decoding kernel's list of its cache's format.
  template <class Stored>
  static void enlist(std::vector<DecodeSequence<Stored>>& list, Index b,
                     DecodeSequence<Stored> sequence) {
    sequence.batch_index = b;
    list.push_back(sequence);
  }

  // Where each sequence's rows of a step are in x: padded ([B, n, E], row b·n on) or packed
  // (ForwardOptions::cu_seqlens, [T, E], row cu_seqlens[b] on).
  struct StepRows {
    Index padded = 0;  // n; 0 when packed
    const std::vector<Index>* cumulative = nullptr;
    const std::vector<Index>* new_tokens = nullptr;
    Index first(Index b) const {
      return cumulative != nullptr ? (*cumulative)[static_cast<std::size_t>(b)] : b * padded;
    }
    Index count(Index b) const {
      const auto i = static_cast<std::size_t>(b);
      if (cumulative != nullptr) return (*cumulative)[i + 1] - (*cumulative)[i];
      return new_tokens->empty() ? padded : (*new_tokens)[i];
    }
  };

  // Every check of a step, before anything changes; returns where its rows are.
  template <class Steps>
  static StepRows check(const LayerParameters<T>& parameters, const TensorView<const T>& x,
                        const Steps& steps, const ForwardOptions<T>& options,
                        const std::vector<Index>& new_tokens);

  // flex: a user's mods (flex_layer.hpp's flex_decode; NoFlex for none), as the flash kernel
  // takes them.
  template <class Steps, class Flex = NoFlex>
  static ForwardResult<T> run(const LayerParameters<T>& parameters, const TensorView<const T>& x,
                              Steps& steps, const ForwardOptions<T>& options,
                              const std::vector<Index>& new_tokens, const PackedProjections* packed,
                              const Flex& flex = {});
};

template <class T>
template <class Steps, class Flex>
ForwardResult<T> Decoding<T>::run(const LayerParameters<T>& parameters,
                                  const TensorView<const T>& x, Steps& steps,
                                  const ForwardOptions<T>& options,
                                  const std::vector<Index>& new_tokens,
                                  const PackedProjections* packed, const Flex& flex) {
  const Index heads = parameters.num_heads(), head_dim = parameters.head_dim();
  const Index width = parameters.kv_dim(), inner = parameters.inner_dim();
  const Index batch = steps.batch();
  const StepRows step_rows = check(parameters, x, steps, options, new_tokens);
  if (options.precision != Precision::fp32 && packed == nullptr) {
    throw_argument("precision",
                   std::string("decode computes in ") + precision_name(options.precision) +
                       " on weights packed once, which a layer does not keep (it would pack them "
                       "at every step): decode through a FrozenMultiHeadAttention, or with "
                       "Precision::fp32");
  }
  DecodeStepBuffers<T>& buffers = steps.buffers();
  // A frozen layer's projections by its packings: in bf16 by its bf16 panels (where the CPU has
  // AVX512_BF16), in int8 by its int8 panels, or by its int8 values for a few rows
  // (FrozenWeights::int8); the attention over the cache stays fp32, bound by reading the cache
  // rather than by products.
  const ProjectionArithmetic arithmetic = projection_arithmetic(options.precision, packed);
  buffers.bf16.forget();
  const auto route = [&](int which) {
    return projection_route(packed, arithmetic, buffers.bf16, buffers.int8, which);
  };
  const Kernel kernel = layer_kernel(parameters, options.kernel, false);
  if constexpr (Flex::kActive) {
    if (kernel != Kernel::flash) {
      throw_argument("options.kernel",
                     "user mods run in the flash kernel, which this layer (talking heads) or these "
                     "options (Kernel::reference) do not use");
    }
    Index longest = 0;
    for (Index b = 0; b < batch; ++b) {
      longest = std::max(longest, steps.length(b) + step_rows.count(b));
    }
    flex.check_covers(batch, parameters.num_heads(), longest, longest);
  }
  const Index rotary_dim = options.rope ? checked_rotary_dim(*options.rope, head_dim) : 0;
  CoreOptions<Compute> core;
  core.scale = Compute(1) / std::sqrt(static_cast<Compute>(head_dim));
  core.causal = options.is_causal ? Causal::bottom_right : Causal::none;
  core.window = options.window;
  core.window.alignment = Alignment::bottom_right;
  core.alibi_slopes = checked_alibi_slopes(options.alibi_slopes, heads);
  core.alibi_alignment = Alignment::bottom_right;
  core.softcap = checked_softcap(options.softcap);
  core.talking_heads = parameters.talking_heads();
  core.sinks = parameters.sinks();

  // Every row of x projected at once: padded rows too (cheaper than gathering), none when packed.
  const auto input = as_compute(x, buffers.input);  // [B*n, E]
  Matrix<Compute>* projected[] = {&buffers.queries, &buffers.new_keys, &buffers.new_values};
  // A step stores its keys and values, but for a cross-attention memory's, which were projected
  // when it was encoded.
  constexpr bool appends = !std::is_same_v<Steps, Memory>;
  for (int which = 0; which < (appends ? 3 : 1); ++which) {
    projected[which]->resize(input.rows(), parameters.projection_width(which));
    project_rows<Compute>(strided(*projected[which]), const_strided(input),
                          parameters.weight_rows(which), route(which), buffers.kernel);
    add_bias(parameters, *projected[which], which);
  }
  buffers.attended.resize(input.rows(), inner);
  buffers.attended.setZero();

  // Sequences of a few new tokens go to the decoding kernel together, in one parallel pass
  // (kernels/decode.hpp); longer steps (a prompt) and what that kernel does not compute go to
  // attention() one sequence at a time.
  bool batched = false;
  if constexpr (std::is_same_v<Compute, float>) {
    batched = kernel == Kernel::flash && !options.pattern.active() && decode_kernel_applies(core);
  }
  // A user's mod may throw inside the kernels: the exception goes on, and each sequence the step
  // reached keeps its tokens, settled as after a step (its length says which).
  const auto settle = [&] {
    for (Index b = 0; b < batch; ++b) steps.settle(b, options, rotary_dim);
  };
  try {
    buffers.sequences.clear();
    buffers.q8_sequences.clear();
    buffers.q4_sequences.clear();
    for (Index b = 0; b < batch; ++b) {
      const Index count = step_rows.count(b), first = step_rows.first(b);
      if (count == 0) continue;
      Compute* queries = buffers.queries.data() + first * inner;
      Compute* keys = appends ? buffers.new_keys.data() + first * width : nullptr;
      Compute* values = appends ? buffers.new_values.data() + first * width : nullptr;
      if (appends) steps.keep_sinks(b, count, keys, values);
      if (options.rope) {
        buffers.rope_table.fill(*options.rope, rotary_dim, steps.position(b), count);
        rotate_heads(queries, count, inner, heads, head_dim, buffers.rope_table, false);
        rotate_heads(keys, count, width, parameters.num_kv_heads(), head_dim, buffers.rope_table,
                     false);
      }
      const Index total_keys = steps.append(b, count, keys, values);
      Compute* attended = buffers.attended.data() + first * inner;
      if constexpr (std::is_same_v<Compute, float>) {
        if (batched && count < kPanelsMinQueries) {
          // (advance() moves no rows: these stay where they are until the kernel has run.)
          steps.add_to_kernel(b, queries, attended, count, total_keys);
          steps.advance(b, count);
          continue;
        }
      }
      core.causal_cols = total_keys;
      core.pattern =
          checked_pattern(options.pattern, heads, count, total_keys, Alignment::bottom_right);
      const auto queries_layout =
          parameters.template head_layout<const Compute>(queries, count, inner);
      const auto attended_layout = parameters.head_layout(attended, count, inner);
      const auto attend = [&](const auto* cached_keys, const auto* cached_values) {
        using Stored = std::remove_const_t<std::remove_pointer_t<decltype(cached_keys)>>;
        const auto keys_layout =
            parameters.template kv_head_layout<const Stored>(cached_keys, total_keys, width);
        const auto values_layout =
            parameters.template kv_head_layout<const Stored>(cached_values, total_keys, width);
        if constexpr (Flex::kActive) {
          // The mods see this sequence as batch element b, its queries from row total_keys - count.
          Flex sequence_flex = flex;
          sequence_flex.batch_offset = b;
          sequence_flex.query_offset = total_keys - count;
          attention_flash_with_sinks<Compute, Stored>(1, heads, queries_layout, keys_layout,
                                                      values_layout, attended_layout, core,
                                                      buffers.kernel, nullptr, sequence_flex);
        } else {
          attention<Compute>(kernel, 1, heads, queries_layout, keys_layout, values_layout,
                             attended_layout, core, nullptr, buffers.kernel);
        }
      };
      try {
        steps.with_rows(b, total_keys, attend);
      } catch (...) {
        steps.advance(b, count);
        throw;
      }
      steps.advance(b, count);
    }
    if constexpr (std::is_same_v<Compute, float>) {
      // kv_stride counts the cache's elements, or its blocks for a quantized cache.
      const DecodeShape shape{heads, parameters.num_kv_heads(), head_dim, head_dim, inner, inner,
                              width};
      DecodeShape block_shape = shape;
      block_shape.kv_stride = width / kQuantBlock;
      if (!buffers.sequences.empty()) {
        decode_attention(buffers.sequences, shape, core, buffers.kernel, buffers.decode, flex);
      }
      if (!buffers.q8_sequences.empty()) {
        decode_attention(buffers.q8_sequences, block_shape, core, buffers.kernel, buffers.decode,
                         flex);
      }
      if (!buffers.q4_sequences.empty()) {
        decode_attention(buffers.q4_sequences, block_shape, core, buffers.kernel, buffers.decode,
                         flex);
      }
    }
  } catch (...) {
    settle();
    throw;
  }
  settle();

  scale_heads(buffers.attended, options.head_gate, head_dim);
  ForwardResult<T> result;
  result.output.resize(x.shape());
  project_output(parameters, buffers.attended, result.output, buffers.output, buffers.kernel,
                 route(3));
  auto output = result.output.matrix();
  for (Index b = 0; b < batch && !new_tokens.empty(); ++b) {
    const Index count = step_rows.count(b), n = step_rows.padded;
    output.middleRows(b * n + count, n - count).setZero();
  }
  return result;
}

template <class T>
template <class Steps>
typename Decoding<T>::StepRows Decoding<T>::check(const LayerParameters<T>& parameters,
                                                  const TensorView<const T>& x, const Steps& steps,
                                                  const ForwardOptions<T>& options,
                                                  const std::vector<Index>& new_tokens) {
  const MultiHeadAttentionConfig& config = parameters.config();
  const Index embed = config.embed_dim, batch = steps.batch();
  if (config.add_bias_kv || config.add_zero_attn) {
    throw_argument("decode",
                   "a layer with add_bias_kv or add_zero_attn cannot decode with a KV cache: its "
                   "extra key would follow every step's keys");
  }
  if (!std::is_same_v<Steps, Memory> && (config.kdim != embed || config.vdim != embed)) {
    throw_argument("decode", "decodes self-attention only, so kdim and vdim must be E = " +
                                 std::to_string(embed) + ", got " + std::to_string(config.kdim) +
                                 " and " + std::to_string(config.vdim));
  }
  if (steps.num_kv_heads() != parameters.num_kv_heads() ||
      steps.head_dim() != parameters.head_dim()) {
    throw_argument("cache", "holds " + std::to_string(steps.num_kv_heads()) +
                                " key/value heads of D = " + std::to_string(steps.head_dim()) +
                                ", the layer has " + std::to_string(parameters.num_kv_heads()) +
                                " of D = " + std::to_string(parameters.head_dim()) +
                                " (make it with make_kv_cache)");
  }
  const std::string row_shape = "[" + std::to_string(batch) + ", n, " + std::to_string(embed) +
                                "] (one row per cached sequence)";
  StepRows rows;
  rows.new_tokens = &new_tokens;
  if (!options.cu_seqlens.empty() || !options.cu_seqlens_k.empty()) {
    // A packed step: sequence b's tokens are rows cu_seqlens[b] .. cu_seqlens[b + 1] of x.
    if (!options.cu_seqlens_k.empty()) {
      throw_argument("cu_seqlens_k", "decode takes none: the cache holds each sequence's keys");
    }
    if (!new_tokens.empty()) {
      throw_argument("new_tokens", "not with cu_seqlens, which gives each sequence's count");
    }
    check_shape("x", {kAnyDim, embed}, x.shape());
    if (static_cast<Index>(options.cu_seqlens.size()) != batch + 1) {
      throw_argument("cu_seqlens", "expected " + std::to_string(batch + 1) +
                                       " entries (0, then one per sequence), got " +
                                       std::to_string(options.cu_seqlens.size()));
    }
    check_cumulative_lengths("cu_seqlens", options.cu_seqlens, x.dim(0), "x");
    rows.cumulative = &options.cu_seqlens;
  } else if (x.rank() == 2 && batch == 1) {
    check_shape("x", {kAnyDim, embed}, x.shape());
  } else if (x.rank() != 3 || x.dim(0) != batch || x.dim(2) != embed) {
    throw_shape("x", row_shape + (batch == 1 ? " or [n, E]" : ""), x.shape());
  }
  const Index n = x.dim(x.rank() - 2);
  if (rows.cumulative == nullptr) rows.padded = n;
  if (!new_tokens.empty() && static_cast<Index>(new_tokens.size()) != batch) {
    throw_argument("new_tokens", "expected one count per sequence (" + std::to_string(batch) +
                                     "), got " + std::to_string(new_tokens.size()));
  }
  std::vector<Index> counts(static_cast<std::size_t>(batch), n);
  for (Index b = 0; b < batch; ++b) {
    const Index count = rows.count(b);
    if (count < 0 || count > n) {
      throw_argument("new_tokens", "sequence " + std::to_string(b) +
                                       ": expected a count in [0, n = " + std::to_string(n) +
                                       "], got " + std::to_string(count));
    }
    counts[static_cast<std::size_t>(b)] = count;
  }
  steps.check(options, counts);
  check_head_gate(options.head_gate, config.num_heads);
  check_window(options.window);
  check_precision<Compute>(options.precision);
  check_inference_precision(options.precision);
  if (!options.attn_mask.empty() || !options.key_padding_mask.empty()) {
    throw_argument("decode",
                   "takes no attn_mask or key_padding_mask: the cache decides which keys a token "
                   "sees (new_tokens gives each sequence's length)");
  }
  if (options.need_weights) {
    throw_argument("need_weights",
                   "decode returns no attention weights: set it false (decode_options() does), "
                   "or run forward");
  }
  // Here rather than where each sequence's keys are known: a layout too small for a later
  // sequence must throw before earlier sequences have advanced.
  for (Index b = 0; b < batch && options.pattern.active(); ++b) {
    const Index count = counts[static_cast<std::size_t>(b)];
    if (count == 0) continue;
    checked_pattern(options.pattern, config.num_heads, count, steps.length(b) + count,
                    Alignment::bottom_right);
  }
  if (options.check_inputs) check_finite(x, "x");
  return rows;
}

template <class T>
void Decoding<T>::encode(const LayerParameters<T>& parameters, const TensorView<const T>& memory,
                         KVCache<T>& cache, const std::vector<Index>& lengths) {
  const Index rows = memory.dim(memory.rank() - 2), width = parameters.kv_dim();
  DecodeStepBuffers<T>& buffers = cache.step_;
  const auto input = as_compute(memory, buffers.input);  // [B*S, kdim]
  Matrix<Compute>* projected[] = {&buffers.new_keys, &buffers.new_values};
  for (int which = 1; which < 3; ++which) {
    Matrix<Compute>& into = *projected[which - 1];
    into.resize(input.rows(), width);
    project_rows<Compute>(
        strided(into), const_strided(input), parameters.weight_rows(which),
        projection_route(nullptr, ProjectionArithmetic::fp32, buffers.bf16, buffers.int8, which),
        buffers.kernel);
    add_bias(parameters, into, which);
  }
  Contiguous steps{cache};
  for (Index b = 0; b < cache.batch(); ++b) {
    const Index count = lengths.empty() ? rows : lengths[static_cast<std::size_t>(b)];
    steps.append(b, count, buffers.new_keys.data() + b * rows * width,
                 buffers.new_values.data() + b * rows * width);
    steps.advance(b, count);
  }
}

// The instantiations mha::compiled holds (src/layer_decode.cpp; see mha/compiled.hpp).
// NOLINTBEGIN(bugprone-macro-parentheses): the arguments are a type and a keyword
#define MHA_LAYER_DECODE_TEMPLATES(PREFIX, T) PREFIX template struct Decoding<T>;
// NOLINTEND(bugprone-macro-parentheses)
MHA_EXTERN_TEMPLATES(MHA_LAYER_TYPES, MHA_LAYER_DECODE_TEMPLATES)

}  // namespace mha::detail
