// Google Benchmark suite. Names: forward/<kernel>/B:<b>/L:<l>/E:<e>/H:<h> for the whole layer,
// train/<kernel>/... for one training step of it (forward_train + backward), sdpa/<kernel>/...
// for the attention core alone, gemm/N:<n> for the GEMM in the same run, and ceiling/... for the
// machine's limits measured in the same run (ceilings.hpp: the FMA peak, the bf16 dot-product
// peak, the memory read bandwidth), which run first. FLOPs per batch element (self-attention,
// L = S = n, width E): projections 8·n·E², core 4·n²·E; the GFLOPS counter uses these counts
// (three times them for train/, see train below), of_fma_peak divides it by the FMA peak, and
// of_nearby_fma_peak by the peak measured just before and after the run (see set_flops);
// decode/ reports GB_per_s read and of_read_bandwidth likewise. The peak_extra_MiB
// counter is the most heap memory one call held above what was allocated before it (inputs and
// the layer excluded, outputs included), from counting malloc/free in this binary (glibc).
#include <benchmark/benchmark.h>
#include <malloc.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <mha/flex.hpp>
#include <mha/flex_layer.hpp>
#include <mha/kernels/bf16_gemm.hpp>
#include <mha/kernels/bf16_projection.hpp>
#include <mha/kernels/decode.hpp>
#include <mha/mha.hpp>
#include <mha/mods.hpp>

#include "ceilings.hpp"

// Heap accounting: every allocation of this process goes through these wrappers of glibc's
// allocator, which keep the bytes in use and the peak since the last reset.
extern "C" {
void* __libc_malloc(std::size_t);
void* __libc_calloc(std::size_t, std::size_t);
void* __libc_realloc(void*, std::size_t);
void* __libc_memalign(std::size_t, std::size_t);
void __libc_free(void*);
}

namespace {

std::atomic<std::int64_t> g_in_use{0};
std::atomic<std::int64_t> g_peak{0};

void count_allocation(void* p) {
  if (p == nullptr) return;
  const auto bytes = static_cast<std::int64_t>(malloc_usable_size(p));
  const std::int64_t now = g_in_use.fetch_add(bytes) + bytes;
  std::int64_t peak = g_peak.load();
  while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {
  }
}
void count_free(void* p) {
  if (p != nullptr) g_in_use.fetch_sub(static_cast<std::int64_t>(malloc_usable_size(p)));
}

}  // namespace

extern "C" {
void* malloc(std::size_t size) {
  void* p = __libc_malloc(size);
  count_allocation(p);
  return p;
}
void* calloc(std::size_t count, std::size_t size) {
  void* p = __libc_calloc(count, size);
  count_allocation(p);
  return p;
}
void* realloc(void* old, std::size_t size) {
  count_free(old);
  void* p = __libc_realloc(old, size);
  count_allocation(p != nullptr ? p : (size == 0 ? nullptr : old));
  return p;
}
void free(void* p) {
  count_free(p);
  __libc_free(p);
}
int posix_memalign(void** out, std::size_t alignment, std::size_t size) {
  void* p = __libc_memalign(alignment, size);
  if (p == nullptr) return ENOMEM;
  count_allocation(p);
  *out = p;
  return 0;
}
void* aligned_alloc(std::size_t alignment, std::size_t size) {
  void* p = __libc_memalign(alignment, size);
  count_allocation(p);
  return p;
}
void* memalign(std::size_t alignment, std::size_t size) {
  void* p = __libc_memalign(alignment, size);
  count_allocation(p);
  return p;
}
}

namespace {

// Wall-clock seconds of a benchmark's timed loop, for its rates. Google Benchmark's own rate
// counters divide by the main thread's CPU time, which leaves out the time that thread sleeps at
// an OpenMP barrier waiting for the other one: the flash backward's GFLOPS came out 1.13 times its
// wall-clock rate (bench/RESULTS.md, 2026-12-04). Started just before the loop; pause() and
// resume() go with State::PauseTiming and ResumeTiming.
class WallClock {
 public:
  void pause() { elapsed_ += std::chrono::steady_clock::now() - started_; }
  void resume() { started_ = std::chrono::steady_clock::now(); }
  double seconds() const {
    return std::chrono::duration<double>(elapsed_ + (std::chrono::steady_clock::now() - started_))
        .count();
  }

 private:
  std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
  std::chrono::steady_clock::duration elapsed_{};
};

// amount_per_iteration × iterations / the loop's wall-clock seconds.
double per_second(const benchmark::State& state, const WallClock& wall,
                  double amount_per_iteration) {
  return amount_per_iteration * static_cast<double>(state.iterations()) / wall.seconds();
}

// Runs call once outside the timing and reports the most memory it held beyond the baseline.
template <class Call>
void report_peak_memory(benchmark::State& state, Call&& call) {
  const std::int64_t before = g_in_use.load();
  g_peak.store(before);
  call();
  state.counters["peak_extra_MiB"] =
      static_cast<double>(g_peak.load() - before) / (1024.0 * 1024.0);
}

mha::Tensor<float> random_tensor(const mha::Shape& shape, std::uint64_t seed) {
  mha::Random random(seed);
  mha::Tensor<float> t(shape);
  for (mha::Index i = 0; i < t.size(); ++i) t.data()[i] = static_cast<float>(random.normal());
  return t;
}

// The FMA peak measured around each run of the layer's benchmarks (forward/, forward_frozen/,
// forward_fresh/, train/, sdpa/, projection/): just before it (their Setup,
// measure_peak_before_run) and just after it (set_flops), the larger of the two. This host's speed
// changes within minutes (the same configuration ran at 0.707 and at 0.562 of the run's best peak
// minutes apart, bench/RESULTS.md 2026-12-03, second session), so a fraction of a peak measured at
// another moment carries that change as well as the code's; a peak measured beside the run shares
// the run's CPU time (not its caches' or memory's contention, which an FMA loop does not feel).
constexpr double kNearbyPeakSeconds = 0.05;
double g_peak_before_run = 0;
void measure_peak_before_run(const benchmark::State& /*state*/) {
  g_peak_before_run = mha_bench::fma_peak_gflops(kNearbyPeakSeconds);
}
// (A run that stopped with an error never reached set_flops: its peak is not the next run's.)
void forget_peak_before_run(const benchmark::State& /*state*/) {
  g_peak_before_run = 0;
}

// GFLOPS; of_fma_peak, that rate as a fraction of the best FMA peak measured in this run (the
// strict ceiling); and, for the benchmarks that measure one before their run, of_nearby_fma_peak,
// the fraction of the peak measured around the run (nearby_fma_peak_GFLOPS).
void set_flops(benchmark::State& state, const WallClock& wall, double flops_per_iteration) {
  const double gflops = per_second(state, wall, flops_per_iteration * 1e-9);
  state.counters["GFLOPS"] = gflops;
  state.counters["of_fma_peak"] = gflops / mha_bench::ceilings().fma_gflops;
  if (g_peak_before_run > 0) {
    const double nearby =
        std::max(g_peak_before_run, mha_bench::fma_peak_gflops(kNearbyPeakSeconds));
    g_peak_before_run = 0;
    state.counters["nearby_fma_peak_GFLOPS"] = nearby;
    state.counters["of_nearby_fma_peak"] = gflops / nearby;
  }
}

// A benchmark's timing: call() once before it, then once an iteration, `flops` an iteration.
template <class Call>
void time_calls(benchmark::State& state, const Call& call, const void* dst, double flops) {
  call();
  const WallClock wall;
  for (auto _ : state) {
    call();
    benchmark::DoNotOptimize(dst);
  }
  set_flops(state, wall, flops);
}

// The micro-kernel benchmarks' calls: sweep(t) on every thread t at once, each its own copy of
// the operands, so that B's bytes stream as in the layer's products.
template <class Sweep>
void time_sweeps(benchmark::State& state, mha::Index threads, const Sweep& sweep, const void* dst,
                 double flops) {
  const auto run = [&] {
    MHA_OMP_PRAGMA(omp parallel for schedule(static))
    for (mha::Index t = 0; t < threads; ++t) sweep(t);
  };
  time_calls(state, run, dst, flops);
}

// GB_per_s read, and of_read_bandwidth: that rate as a fraction of the memory read bandwidth
// measured in this run.
void set_bytes_read(benchmark::State& state, const WallClock& wall, double bytes_per_iteration) {
  const double gbs = per_second(state, wall, bytes_per_iteration * 1e-9);
  state.counters["GB_per_s"] = gbs;
  state.counters["of_read_bandwidth"] = gbs / mha_bench::ceilings().read_gbs;
}

// The ceilings as benchmarks of their own (ceiling/...), run first: each repetition measures
// again, and the best of them is what the fractions of the later benchmarks divide by.
void ceiling_fma(benchmark::State& state) {
  std::string isa;
  double best = 0;
  for (auto _ : state) best = std::max(best, mha_bench::fma_peak_gflops(0.2, &isa));
  state.counters["GFLOPS"] = best;
  state.SetLabel(isa);
  auto& ceilings = mha_bench::ceilings();
  ceilings.fma_gflops = std::max(ceilings.fma_gflops, best);
}
// A dot-product peak (bf16 or int8): the best of the iterations' measurements, raising the kept
// ceiling `kept` to it; skipped where the CPU lacks the instruction (`measure` gives 0).
template <class Measure>
void ceiling_dot_product(benchmark::State& state, Measure measure, const char* missing,
                         const char* counter, double& kept) {
  double best = 0;
  for (auto _ : state) best = std::max(best, measure(0.2));
  if (best == 0) {
    state.SkipWithError(missing);
    return;
  }
  state.counters[counter] = best;
  kept = std::max(kept, best);
}
void ceiling_bf16(benchmark::State& state) {
  ceiling_dot_product(state, mha_bench::bf16_peak_gflops, "this CPU has no AVX512_BF16", "GFLOPS",
                      mha_bench::ceilings().bf16_gflops);
}
void ceiling_int8(benchmark::State& state) {
  ceiling_dot_product(state, mha_bench::int8_peak_gops, "this CPU has no AVX512_VNNI", "GOPS",
                      mha_bench::ceilings().int8_gops);
}
void ceiling_read(benchmark::State& state) {
  double best = 0;
  for (auto _ : state) best = std::max(best, mha_bench::memory_read_gbs(0.3));
  state.counters["GB_per_s"] = best;
  auto& ceilings = mha_bench::ceilings();
  ceilings.read_gbs = std::max(ceilings.read_gbs, best);
}

// With `frozen` (forward_frozen/): the same layer as a FrozenMultiHeadAttention, its weights
// packed once before the timing, as ONNX Runtime packs them when its session is made.
// `precision`: ForwardOptions::precision (forward_bf16/).
template <class Layer = mha::MultiHeadAttention<float>>
void forward(benchmark::State& state, mha::Kernel kernel, bool fresh = false,
             mha::Precision precision = mha::Precision::fp32) {
  const mha::Index B = state.range(0), L = state.range(1), E = state.range(2), H = state.range(3);
  const Layer layer{mha::MultiHeadAttention<float>(E, H)};
  const auto x = random_tensor({B, L, E}, 1);
  mha::ForwardOptions<float> options;
  options.need_weights = false;
  options.kernel = kernel;
  options.precision = precision;
  report_peak_memory(state, [&] { benchmark::DoNotOptimize(layer.forward(x, x, x, options)); });
  // A Workspace and a result kept from call to call, as a serving loop keeps them (and as ONNX
  // Runtime's arena keeps its buffers); `fresh` (forward_fresh/): forward(x, x, x, options),
  // which allocates both anew at every call, and the operating system zeroes their pages.
  // The kept pair is filled once before the timing: its first call allocates them and takes the
  // pages' faults (23414 at L = 8192, 91 MiB), which with the one or two iterations Google
  // Benchmark gives a call of half a second were inside the time (bench/RESULTS.md, 2026-12-04).
  mha::Workspace<float> workspace;
  mha::ForwardResult<float> result;
  if (!fresh) layer.forward(x, x, x, options, workspace, result);
  const WallClock wall;
  for (auto _ : state) {
    if (fresh) {
      benchmark::DoNotOptimize(layer.forward(x, x, x, options).output.data());
    } else {
      layer.forward(x, x, x, options, workspace, result);
      benchmark::DoNotOptimize(result.output.data());
    }
  }
  const double n = static_cast<double>(L), e = static_cast<double>(E);
  set_flops(state, wall, static_cast<double>(B) * (8 * n * e * e + 4 * n * n * e));
}

// One training step of self-attention: forward_train(x), then backward with a fixed random
// grad_output; need_weights = false. One SavedForward serves every iteration, so its buffers are
// reused. zero_grad runs outside the timing (paused), as compare_pytorch.py zeroes torch's
// gradients outside its own. peak_extra_MiB is measured on the first step, so it counts what
// SavedForward keeps for backward (input copy, projections, heads' outputs, log-sum-exp), the
// backward's buffers, the kernels' scratch, the output and the input gradients; the parameters'
// gradients are allocated (by zero_grad) before it, like the parameters themselves.
// FLOPs: 3 × the forward's, the usual forward + backward count (every product y = a b has two
// gradient products, grad_a and grad_b). Both kernels' backward also recompute the scores q kᵀ
// (flash tile by tile from the saved log-sum-exp, reference per head into its [L, S'] scratch),
// so the work done is B·(24·L·E² + 14·L²·E): up to 1/6 more than counted as L grows.
// train_bf16/: mixed precision (Precision::bf16: the projections' products, forward and backward,
// in bf16 with fp32 sums, and the flash forward's where its bf16 panels run), against train/auto
// of the same run; train_fp16/: Precision::fp16, emulated (operands rounded to half, fp32
// products): what the rounding costs.
void train(benchmark::State& state, mha::Kernel kernel,
           mha::Precision precision = mha::Precision::fp32) {
  const mha::Index B = state.range(0), L = state.range(1), E = state.range(2), H = state.range(3);
  if (precision == mha::Precision::bf16 && !mha::bf16_arithmetic_available()) {
    state.SkipWithError("this CPU lacks AVX512_BF16");
    return;
  }
  mha::MultiHeadAttention<float> layer(E, H);
  const auto x = random_tensor({B, L, E}, 1);
  const auto grad_output = random_tensor({B, L, E}, 2);
  mha::ForwardOptions<float> options;
  options.need_weights = false;
  options.kernel = kernel;
  options.precision = precision;
  mha::SavedForward<float> saved;
  // The output and the input gradients kept from step to step, as a training loop keeps them
  // (forward_train and backward into them): fresh ones take new pages at every step, 15-20 % of
  // a step at L = 4096 (bench/RESULTS.md, 2026-12-04).
  mha::ForwardResult<float> result;
  mha::InputGradients<float> grads;
  const auto step = [&] {
    layer.forward_train(x, x, x, options, saved, result);
    layer.backward(saved, grad_output, grads);
    benchmark::DoNotOptimize(result.output.data());
    benchmark::DoNotOptimize(grads.query.data());
  };
  layer.zero_grad();
  report_peak_memory(state, step);
  WallClock wall;
  for (auto _ : state) {
    wall.pause();
    state.PauseTiming();
    layer.zero_grad();
    state.ResumeTiming();
    wall.resume();
    step();
  }
  const double n = static_cast<double>(L), e = static_cast<double>(E);
  set_flops(state, wall, 3 * static_cast<double>(B) * (8 * n * e * e + 4 * n * n * e));
}

// The attention core alone (scaled_dot_product_attention over [B, H, L, D] inputs, no
// projections); sdpa_bf16/: with Precision::bf16, against sdpa/flash of the same run.
void sdpa(benchmark::State& state, mha::Kernel kernel,
          mha::Precision precision = mha::Precision::fp32) {
  const mha::Index B = state.range(0), L = state.range(1), E = state.range(2), H = state.range(3);
  const mha::Index D = E / H;
  if (precision == mha::Precision::bf16 && !mha::bf16_arithmetic_available()) {
    state.SkipWithError("this CPU lacks AVX512_BF16");
    return;
  }
  const auto q = random_tensor({B, H, L, D}, 1), k = random_tensor({B, H, L, D}, 2),
             v = random_tensor({B, H, L, D}, 3);
  mha::AttentionOptions<float> options;
  options.kernel = kernel;
  options.precision = precision;
  report_peak_memory(state, [&] {
    benchmark::DoNotOptimize(mha::scaled_dot_product_attention(q, k, v, options));
  });
  const WallClock wall;
  for (auto _ : state) {
    auto result = mha::scaled_dot_product_attention(q, k, v, options);
    benchmark::DoNotOptimize(result.output.data());
  }
  const double n = static_cast<double>(L), e = static_cast<double>(E);
  set_flops(state, wall, static_cast<double>(B) * 4 * n * n * e);
  if (precision == mha::Precision::bf16) {
    state.counters["of_bf16_peak"] =
        state.counters["GFLOPS"] / std::max(mha_bench::ceilings().bf16_gflops, 1e-9);
  }
}

// The flash kernel's two paths for small heads, the attention core alone (mha::detail): the GEMM
// tiles (attention_flash with FlashBlocks::small_heads off) against the small-head kernel
// (attention_flash_small_head, called directly, so also below the query count from which
// attention_flash would choose it), H = 64, D = 8, S = 4096 keys, L = range(0) queries. Where the
// small-head kernel starts to pay: the source of kSmallHeadMinQueries.
void small_heads(benchmark::State& state, bool small_head_kernel) {
  const mha::Index H = 64, D = 8, S = 4096, L = state.range(0);
  const auto q = random_tensor({1, H, L, D}, 1), k = random_tensor({1, H, S, D}, 2),
             v = random_tensor({1, H, S, D}, 3);
  mha::Tensor<float> out({1, H, L, D});
  mha::detail::CoreOptions<float> core;
  core.causal_cols = S;
  core.scale = 0.35F;
  std::vector<mha::detail::KernelScratch<float>> scratch;
  const auto heads = [H](auto* data, mha::Index rows) {
    return mha::detail::contiguous_heads(data, H, rows, mha::Index{8});
  };
  const auto q_heads = heads(q.data(), L), k_heads = heads(k.data(), S),
             v_heads = heads(v.data(), S);
  const auto out_heads = heads(out.data(), L);
  const WallClock wall;
  for (auto _ : state) {
    if (small_head_kernel) {
      mha::detail::attention_flash_small_head<8, float>(
          1, H, q_heads, k_heads, v_heads, out_heads, core, scratch, static_cast<float*>(nullptr));
    } else {
      mha::detail::attention_flash<float>(1, H, q_heads, k_heads, v_heads, out_heads, core, scratch,
                                          nullptr, {64, 256, false});
    }
    benchmark::DoNotOptimize(out.data());
  }
  set_flops(state, wall, 4.0 * static_cast<double>(H * D * L * S));
}

// Causal sliding-window attention alone (scaled_dot_product_attention, flash kernel), B = 1,
// H = 8, D = 64, L = range(0), each query seeing the range(1) keys before it and itself (window
// left = w, -1 for full causal attention). The kernel skips key blocks wholly outside the window,
// so time should grow as L·w, not L². GFLOPS counts the visible (query, key) pairs only, 4·D
// FLOPs per pair and head (q·k and the weighted sum of v): a constant GFLOPS across w means a cost
// proportional to the work the window leaves.
void window(benchmark::State& state) {
  const mha::Index L = state.range(0), w = state.range(1), H = 8, D = 64;
  const auto q = random_tensor({1, H, L, D}, 1), k = random_tensor({1, H, L, D}, 2),
             v = random_tensor({1, H, L, D}, 3);
  mha::AttentionOptions<float> options;
  options.kernel = mha::Kernel::flash;
  options.causal = mha::Causal::top_left;
  options.window = mha::Window{w, 0};
  const WallClock wall;
  for (auto _ : state) {
    auto result = mha::scaled_dot_product_attention(q, k, v, options);
    benchmark::DoNotOptimize(result.output.data());
  }
  // Query i sees min(i, w) + 1 keys (i + 1 without a window).
  const double n = static_cast<double>(L);
  const double reach = w < 0 ? n : static_cast<double>(w);
  const double pairs =
      w < 0 || w >= L ? n * (n + 1) / 2 : n * (reach + 1) - reach * (reach + 1) / 2;
  state.counters["visible_pairs_M"] = pairs * 1e-6;
  set_flops(state, wall, 4.0 * static_cast<double>(H * D) * pairs);
}

// Block-sparse attention alone (sdpa, flash kernel), B = 1, H = 8, D = 64, L = S = 8192, no causal
// masking: a random layout of 128 x 128 blocks keeping the diagonal and each other block with
// probability 1 / range(0). The kernel visits only the key blocks a query block's layout rows
// keep, so time should fall with the kept share; GFLOPS counts the kept pairs only (4·D FLOPs per
// pair and head), so a constant GFLOPS means a cost proportional to the kept blocks.
void block_sparse(benchmark::State& state) {
  const mha::Index L = 8192, H = 8, D = 64, block = 128, blocks = L / block;
  const auto q = random_tensor({1, H, L, D}, 1), k = random_tensor({1, H, L, D}, 2),
             v = random_tensor({1, H, L, D}, 3);
  mha::AttentionOptions<float> options;
  options.kernel = mha::Kernel::flash;
  options.pattern.block_size = block;
  options.pattern.block_layout = mha::Tensor<bool>({blocks, blocks});
  mha::Random random(4);
  double kept = 0;
  for (mha::Index i = 0; i < blocks; ++i) {
    for (mha::Index j = 0; j < blocks; ++j) {
      const bool keep = i == j || random.uniform() * static_cast<double>(state.range(0)) < 1;
      options.pattern.block_layout(i, j) = keep;
      kept += keep ? 1 : 0;
    }
  }
  const WallClock wall;
  for (auto _ : state) {
    auto result = mha::scaled_dot_product_attention(q, k, v, options);
    benchmark::DoNotOptimize(result.output.data());
  }
  const double pairs = kept * static_cast<double>(block * block);
  state.counters["kept_share"] = kept / static_cast<double>(blocks * blocks);
  set_flops(state, wall, 4.0 * static_cast<double>(H * D) * pairs);
}

// Longformer's pattern (sdpa, flash kernel), B = 1, H = 8, D = 64, L = S = 8192: a band of 256
// keys on each side plus range(0) global tokens at positions 0.. (CLS tokens, attention sinks),
// which see and are seen by every position. A global row makes its whole 64-query block visit
// every key, so the first g rows cost about max(64, g)·L pairs besides the band; GFLOPS counts
// the visible pairs only.
void global_tokens(benchmark::State& state) {
  const mha::Index L = 8192, H = 8, D = 64, w = 256, g = state.range(0);
  const auto q = random_tensor({1, H, L, D}, 1), k = random_tensor({1, H, L, D}, 2),
             v = random_tensor({1, H, L, D}, 3);
  mha::AttentionOptions<float> options;
  options.kernel = mha::Kernel::flash;
  options.window = mha::Window{w, w};
  for (mha::Index t = 0; t < g; ++t) options.pattern.global_tokens.push_back(t);
  const WallClock wall;
  for (auto _ : state) {
    auto result = mha::scaled_dot_product_attention(q, k, v, options);
    benchmark::DoNotOptimize(result.output.data());
  }
  // Visible pairs: global rows see all L keys; other rows their band plus the global columns
  // outside it.
  double pairs = static_cast<double>(g) * static_cast<double>(L);
  for (mha::Index i = g; i < L; ++i) {
    const mha::Index begin = std::max<mha::Index>(0, i - w), end = std::min(L, i + w + 1);
    pairs += static_cast<double>(end - begin + std::max<mha::Index>(0, std::min(g, begin)));
  }
  state.counters["visible_pairs_M"] = pairs * 1e-6;
  set_flops(state, wall, 4.0 * static_cast<double>(H * D) * pairs);
}

// User mods against the built-in options they re-express (issue 20's first target: within
// 1.1x), the attention core alone, B = 1, H = 8, D = 64, L = S = range(0), causal throughout:
// flex/<variant>/builtin runs scaled_dot_product_attention with the options, flex/<variant>/mod
// flex_attention with a causal block mask (built once, outside the timing) and the variant's
// mod. Variants: causal alone; a causal window of 512 keys; ALiBi; softcap 30. GFLOPS counts the
// visible pairs, 4·D FLOPs each per head.
enum class FlexVariant { causal, window, alibi, softcap };
constexpr mha::Index kFlexWindow = 511;

void flex_variant(benchmark::State& state, FlexVariant variant, bool mods) {
  const mha::Index L = state.range(0), H = 8, D = 64;
  const auto q = random_tensor({1, H, L, D}, 1), k = random_tensor({1, H, L, D}, 2),
             v = random_tensor({1, H, L, D}, 3);
  mha::AttentionOptions<float> builtin;
  builtin.causal = mha::Causal::top_left;
  if (variant == FlexVariant::window) builtin.window = mha::Window{kFlexWindow, 0};
  if (variant == FlexVariant::alibi) builtin.alibi_slopes = mha::alibi_slopes<float>(H);
  if (variant == FlexVariant::softcap) builtin.softcap = 30.0F;
  const auto time = [&](const auto& call) {
    call();
    const WallClock wall;
    for (auto _ : state) benchmark::DoNotOptimize(call().output.data());
    const double n = static_cast<double>(L);
    const double reach = variant == FlexVariant::window ? static_cast<double>(kFlexWindow) : n;
    const double pairs = reach >= n ? n * (n + 1) / 2 : n * (reach + 1) - reach * (reach + 1) / 2;
    set_flops(state, wall, 4.0 * static_cast<double>(H * D) * pairs);
  };
  if (!mods) {
    time([&] { return mha::scaled_dot_product_attention(q, k, v, builtin); });
    return;
  }
  const mha::AttentionOptions<float> plain;
  if (variant == FlexVariant::window) {
    const auto window =
        mha::create_block_mask(mha::mods::SlidingWindow{kFlexWindow, 0, 0}, 1, 1, L, L);
    time([&] { return mha::flex_attention(q, k, v, mha::no_score_mod, window, plain); });
    return;
  }
  const auto causal = mha::create_block_mask(mha::mods::causal(), 1, 1, L, L);
  switch (variant) {
    case FlexVariant::alibi: {
      const mha::mods::Alibi<float> alibi{mha::alibi_slopes<float>(H), 0};
      time([&] { return mha::flex_attention(q, k, v, alibi, causal, plain); });
      break;
    }
    case FlexVariant::softcap:
      time([&] {
        return mha::flex_attention(q, k, v, mha::mods::Softcap<float>{30.0F}, causal, plain);
      });
      break;
    default:
      time([&] { return mha::flex_attention(q, k, v, mha::no_score_mod, causal, plain); });
  }
}

// Document masking over n = range(0) packed documents of equal length, T = 8192 tokens in all,
// causal, H = 8, D = 64 (the second target: within 1.2x of running the documents separately):
// flex/documents/mod is one flex_attention over the packed tokens with a document mask,
// flex/documents/separate one causal scaled_dot_product_attention per document.
void flex_documents(benchmark::State& state, bool mods) {
  const mha::Index T = 8192, H = 8, D = 64, n = state.range(0), length = T / n;
  std::vector<mha::Index> cu_seqlens{0};
  for (mha::Index d = 0; d < n; ++d) cu_seqlens.push_back(cu_seqlens.back() + length);
  const auto document_mask = mha::create_block_mask(
      mha::mods::mask_and(mha::mods::document(cu_seqlens), mha::mods::causal()), 1, 1, T, T);
  const auto q = random_tensor({1, H, T, D}, 1), k = random_tensor({1, H, T, D}, 2),
             v = random_tensor({1, H, T, D}, 3);
  std::vector<mha::Tensor<float>> parts_q, parts_k, parts_v;
  for (mha::Index d = 0; d < n && !mods; ++d) {
    parts_q.push_back(random_tensor({1, H, length, D}, 10 + 3 * static_cast<std::uint64_t>(d)));
    parts_k.push_back(random_tensor({1, H, length, D}, 11 + 3 * static_cast<std::uint64_t>(d)));
    parts_v.push_back(random_tensor({1, H, length, D}, 12 + 3 * static_cast<std::uint64_t>(d)));
  }
  mha::AttentionOptions<float> causal;
  causal.causal = mha::Causal::top_left;
  const auto call = [&] {
    if (mods) {
      benchmark::DoNotOptimize(
          mha::flex_attention(q, k, v, mha::no_score_mod, document_mask).output.data());
      return;
    }
    for (mha::Index d = 0; d < n; ++d) {
      const auto i = static_cast<std::size_t>(d);
      benchmark::DoNotOptimize(
          mha::scaled_dot_product_attention(parts_q[i], parts_k[i], parts_v[i], causal)
              .output.data());
    }
  };
  const double per_document = static_cast<double>(length) * static_cast<double>(length + 1) / 2;
  time_calls(state, call, nullptr,
             4.0 * static_cast<double>(H * D) * per_document * static_cast<double>(n));
}

// 2D neighbourhood attention (NATTEN) on a 64 x 64 grid with a range(0) x range(0) kernel, H = 8,
// D = 64 (the third target: time proportional to the visible pairs, at 70% or more of the dense
// kernel's rate per pair): flex/neighbourhood/mod; flex/neighbourhood/dense, the same tokens
// without a mask (every pair visible), whose GFLOPS is the dense rate.
void flex_neighbourhood(benchmark::State& state, bool mods) {
  const mha::Index side = 64, T = side * side, H = 8, D = 64;
  const mha::Index kernel = std::max<mha::Index>(1, state.range(0));  // 0 for dense: unused
  const auto q = random_tensor({1, H, T, D}, 1), k = random_tensor({1, H, T, D}, 2),
             v = random_tensor({1, H, T, D}, 3);
  const auto neighbourhood =
      mha::create_block_mask(mha::mods::neighbourhood_2d(side, side, kernel, kernel), 1, 1, T, T);
  const auto call = [&] {
    if (mods) {
      benchmark::DoNotOptimize(
          mha::flex_attention(q, k, v, mha::no_score_mod, neighbourhood).output.data());
    } else {
      benchmark::DoNotOptimize(mha::scaled_dot_product_attention(q, k, v).output.data());
    }
  };
  const double pairs = static_cast<double>(T) *
                       (mods ? static_cast<double>(kernel * kernel) : static_cast<double>(T));
  state.counters["visited_share"] =
      mods ? 1.0 - static_cast<double>(neighbourhood.count(mha::BlockCover::empty)) /
                       static_cast<double>(neighbourhood.memory_bytes())
           : 1.0;
  time_calls(state, call, nullptr, 4.0 * static_cast<double>(H * D) * pairs);
}

// What talking heads cost: a self-attention layer of E = 512, H = 8 forward, B = 4, L = range(0),
// on the reference kernel, without (range(1) = 0) or with (1) both [H, H] mixes. The mixes add
// 2·H FLOPs per score and head against the attention's 4·D (1/16 more here), but the
// talking-heads kernel keeps each query block's H [rows, S] tiles three times (logits,
// probabilities, mixed weights) and re-packs k and v for every block, so memory traffic decides.
// GFLOPS counts the plain layer's work in both.
void talking_heads(benchmark::State& state) {
  const mha::Index B = 4, L = state.range(0), E = 512, H = 8;
  mha::MultiHeadAttentionConfig config(E, H);
  config.talking_heads_pre = config.talking_heads_post = state.range(1) == 1;
  const mha::MultiHeadAttention<float> layer(config);
  const auto x = random_tensor({B, L, E}, 1);
  mha::ForwardOptions<float> options;
  options.need_weights = false;
  options.kernel = mha::Kernel::reference;
  const WallClock wall;
  for (auto _ : state) {
    auto result = layer.forward(x, x, x, options);
    benchmark::DoNotOptimize(result.output.data());
  }
  const double n = static_cast<double>(L), e = static_cast<double>(E);
  set_flops(state, wall, static_cast<double>(B) * (8 * n * e * e + 4 * n * n * e));
}

// The same layer stored in T (float, Eigen::half, Eigen::bfloat16), computing in float. Forward
// of self-attention at B = 4, E = 512, H = 8, L = range(0): params_MiB is what the layer's
// parameters hold, peak_extra_MiB what one call allocates (the 16-bit layers' float copies of
// input and output included).
template <class T>
void precision_forward(benchmark::State& state) {
  const mha::Index B = 4, L = state.range(0), E = 512, H = 8;
  const mha::MultiHeadAttention<T> layer(E, H);
  const auto x = mha::tensor_cast<T>(random_tensor({B, L, E}, 1));
  mha::ForwardOptions<T> options;
  options.need_weights = false;
  report_peak_memory(state, [&] { benchmark::DoNotOptimize(layer.forward(x, x, x, options)); });
  const WallClock wall;
  for (auto _ : state) {
    auto result = layer.forward(x, x, x, options);
    benchmark::DoNotOptimize(result.output.data());
  }
  double bytes = 0;
  for (const auto& entry : layer.state_dict()) {
    bytes += static_cast<double>(entry.second.size()) * sizeof(T);
  }
  state.counters["params_MiB"] = bytes / (1024.0 * 1024.0);
  const double n = static_cast<double>(L), e = static_cast<double>(E);
  set_flops(state, wall, static_cast<double>(B) * (8 * n * e * e + 4 * n * n * e));
}

// Decoding one token of one sequence with a context of range(0) cached tokens, E = 2048, H = 16
// (as `decode` below, H_kv = 16), layer and KV cache stored in T: a step reads every weight and
// the whole cache once, so 16-bit storage halves what it reads.
template <class T>
void precision_decode(benchmark::State& state) {
  const mha::Index context = state.range(0), E = 2048, H = 16;
  const mha::MultiHeadAttention<T> layer(E, H);
  auto cache = layer.make_kv_cache(1, context + 1);
  const auto options = mha::MultiHeadAttention<T>::decode_options();
  layer.decode(mha::tensor_cast<T>(random_tensor({1, context, E}, 1)), cache, options);
  const auto token = mha::tensor_cast<T>(random_tensor({1, 1, E}, 2));
  const WallClock wall;
  for (auto _ : state) {
    auto result = layer.decode(token, cache, options);
    benchmark::DoNotOptimize(result.output.data());
    cache.rewind(0, context);
  }
  state.counters["tokens_per_second"] = per_second(state, wall, 1);
  const double e = static_cast<double>(E), bytes = sizeof(T);
  state.counters["weights_MiB"] = bytes * 4 * e * e / (1024.0 * 1024.0);
  state.counters["cache_MiB"] = bytes * 2 * static_cast<double>(context) * e / (1024.0 * 1024.0);
}

// A self-attention layer (E = 2048, H = 16, D = 128, like a small Llama) decoding one token for
// each of B = range(0) sequences, with context = range(2) tokens in its KV cache, H_kv =
// range(1). Each iteration is one decode step followed by a rewind, so the context stays the same;
// tokens_per_second counts B tokens per step. A step reads every weight once (W_q and W_o are
// E², W_k and W_v H_kv·D·E each) and the cached keys and values (2·context·H_kv·D per sequence):
// grouped-query attention shrinks both, and the cache's share grows with the context.
// decode_bf16_frozen/: the same step through a FrozenMultiHeadAttention with Precision::bf16,
// its projections on bf16 panels packed once (half the weights' bytes; the attention over the
// cache in fp32); the prompt is filled in fp32.
// decode_int8_frozen/: through a FrozenMultiHeadAttention with FrozenWeights::int8, the steps'
// projections reading int8 weights (a quarter of the bytes). bytes_per_weight: what a step reads
// of each weight.
template <class Layer = mha::MultiHeadAttention<float>>
void decode_step(benchmark::State& state, mha::Precision precision = mha::Precision::fp32,
                 double bytes_per_weight = 4.0,
                 mha::KVCacheFormat format = mha::KVCacheFormat::as_layer) {
  const mha::Index B = state.range(0), kv_heads = state.range(1), context = state.range(2);
  const mha::Index E = 2048, H = 16;
  if (precision == mha::Precision::bf16 && !mha::bf16_arithmetic_available()) {
    state.SkipWithError("this CPU lacks AVX512_BF16");
    return;
  }
  mha::MultiHeadAttentionConfig config(E, H);
  config.num_kv_heads = kv_heads;
  const Layer layer{mha::MultiHeadAttention<float>(config)};
  mha::KVCache<float> cache(B, kv_heads, E / H, context + 1, -1, format);
  // The prompt, untimed: projected into the cache in chunks with a window of one key (the keys
  // and values cached do not depend on the attention over the prompt, and a causal prompt of
  // 16384 tokens would take seconds a sequence).
  auto options = mha::MultiHeadAttention<float>::decode_options();
  options.window = mha::Window{0, 0};
  constexpr mha::Index kPromptChunk = 2048;
  for (mha::Index first = 0; first < context; first += kPromptChunk) {
    const mha::Index count = std::min(kPromptChunk, context - first);
    layer.decode(random_tensor({B, count, E}, static_cast<std::uint64_t>(1 + first)), cache,
                 options);
  }
  options.window = mha::Window{};
  options.precision = precision;
  const auto token = random_tensor({B, 1, E}, 2);
  const WallClock wall;
  for (auto _ : state) {
    auto result = layer.decode(token, cache, options);
    benchmark::DoNotOptimize(result.output.data());
    for (mha::Index b = 0; b < B; ++b) cache.rewind(b, context);
  }
  state.counters["tokens_per_second"] = per_second(state, wall, static_cast<double>(B));
  const double d = static_cast<double>(E / H), e = static_cast<double>(E);
  const double kv = static_cast<double>(kv_heads) * d;
  const double weight_bytes = bytes_per_weight * (2 * e * e + 2 * kv * e);
  const auto cache_bytes = static_cast<double>(cache.storage_bytes());
  state.counters["weights_MiB"] = weight_bytes / (1024.0 * 1024.0);
  state.counters["cache_MiB"] = cache_bytes / (1024.0 * 1024.0);
  set_bytes_read(state, wall, weight_bytes + cache_bytes);
}

void decode(benchmark::State& state) {
  decode_step(state);
}

// flex_decode/<variant>/<way>: decode/'s one-token step (E = 2048, H = 16, H_kv = 4) of B =
// range(0) sequences with context = range(1) cached tokens, each query seeing a window of the last
// 1024 keys, or all of them with ALiBi: by the built-in options (builtin), by mods with a mask_mod
// called for every pair (mod), or with a block mask built for the context (block), with which
// the step does not read the chunks of 240 keys outside the window. bytes_read counts what the
// built-in step reads (every weight, every cached row) for all three.
enum class FlexDecodeWay { builtin, mod, block };
constexpr mha::Index kFlexDecodeWindow = 1023;

void flex_decode_step(benchmark::State& state, bool window, FlexDecodeWay way) {
  const mha::Index B = state.range(0), context = state.range(1), E = 2048, H = 16, kv_heads = 4;
  mha::MultiHeadAttentionConfig config(E, H);
  config.num_kv_heads = kv_heads;
  const mha::MultiHeadAttention<float> layer(config);
  auto cache = layer.make_kv_cache(B, context + 1);
  auto options = mha::MultiHeadAttention<float>::decode_options();
  options.window = mha::Window{0, 0};  // (the prompt, untimed, as decode_step's)
  for (mha::Index first = 0; first < context; first += 2048) {
    const mha::Index count = std::min<mha::Index>(2048, context - first);
    layer.decode(random_tensor({B, count, E}, static_cast<std::uint64_t>(1 + first)), cache,
                 options);
  }
  options.window = mha::Window{};
  const mha::mods::SlidingWindow window_mod{kFlexDecodeWindow, 0};
  const mha::mods::Alibi<float> alibi{mha::alibi_slopes<float>(H), 0};
  const auto block_mask = mha::create_block_mask(window_mod, 1, 1, context + 1, context + 1);
  if (way == FlexDecodeWay::builtin) {
    if (window) {
      options.window = mha::Window{kFlexDecodeWindow, 0};
    } else {
      options.alibi_slopes = alibi.slopes;
    }
  }
  const auto token = random_tensor({B, 1, E}, 2);
  const auto step = [&] {
    if (way == FlexDecodeWay::builtin) return layer.decode(token, cache, options);
    if (!window) return mha::flex_decode(layer, token, cache, alibi);
    if (way == FlexDecodeWay::mod) {
      return mha::flex_decode(layer, token, cache, mha::no_score_mod, window_mod);
    }
    return mha::flex_decode(layer, token, cache, mha::no_score_mod, block_mask);
  };
  const WallClock wall;
  for (auto _ : state) {
    benchmark::DoNotOptimize(step().output.data());
    for (mha::Index b = 0; b < B; ++b) cache.rewind(b, context);
  }
  state.counters["tokens_per_second"] = per_second(state, wall, static_cast<double>(B));
  const double e = static_cast<double>(E), kv = static_cast<double>(kv_heads * E / H);
  set_bytes_read(state, wall,
                 4.0 * (2 * e * e + 2 * kv * e) + static_cast<double>(cache.storage_bytes()));
}

// A paged cache of B sequences whose prompts of `context` tokens were filled a page's worth of
// tokens a step for all of them together, so that each sequence's pages lie B pages apart in the
// pool, as the pages of sequences decoded together do (E = 2048, H = 16). The prompt is untimed,
// with a window of one key (as decode/'s).
struct PagedContext {
  mha::MultiHeadAttention<float> layer;
  mha::PagedKVCache<float> cache;
  std::vector<mha::Index> ids;
  double weight_bytes = 0, cache_bytes = 0;  // what a one-token step of every sequence reads
};

PagedContext paged_context(mha::Index B, mha::Index kv_heads, mha::Index context, mha::Index page,
                           mha::Index extra_pages) {
  const mha::Index E = 2048, H = 16;
  mha::MultiHeadAttentionConfig config(E, H);
  config.num_kv_heads = kv_heads;
  mha::MultiHeadAttention<float> layer(config);
  auto cache = layer.make_paged_kv_cache(page, B * ((context + page) / page + 1) + extra_pages);
  std::vector<mha::Index> ids;
  for (mha::Index b = 0; b < B; ++b) ids.push_back(cache.add_sequence());
  auto options = mha::MultiHeadAttention<float>::decode_options();
  options.window = mha::Window{0, 0};
  for (mha::Index first = 0; first < context; first += page) {
    const mha::Index count = std::min(page, context - first);
    layer.decode(random_tensor({B, count, E}, static_cast<std::uint64_t>(1 + first)), cache, ids,
                 options);
  }
  const double d = static_cast<double>(E / H), e = static_cast<double>(E);
  const double kv = static_cast<double>(kv_heads) * d;
  return {std::move(layer), std::move(cache), std::move(ids), 4.0 * (2 * e * e + 2 * kv * e),
          4.0 * 2 * kv * static_cast<double>(B * (context + 1))};
}

// decode_paged/: decode/'s step over a PagedKVCache of pages of range(3) tokens (paged_context).
void decode_paged(benchmark::State& state) {
  const mha::Index B = state.range(0), context = state.range(2);
  auto paged = paged_context(B, state.range(1), context, state.range(3), 0);
  const auto options = mha::MultiHeadAttention<float>::decode_options();
  const auto token = random_tensor({B, 1, 2048}, 2);
  const WallClock wall;
  for (auto _ : state) {
    auto result = paged.layer.decode(token, paged.cache, paged.ids, options);
    benchmark::DoNotOptimize(result.output.data());
    for (const mha::Index id : paged.ids) paged.cache.truncate(id, context);
  }
  state.counters["tokens_per_second"] = per_second(state, wall, static_cast<double>(B));
  state.counters["cache_MiB"] = paged.cache_bytes / (1024.0 * 1024.0);
  set_bytes_read(state, wall, paged.weight_bytes + paged.cache_bytes);
}

// decode_continuous/: a continuous-batching step over decode_paged/'s cache: one packed call
// (ForwardOptions::cu_seqlens, x [T, E], no padding row) in which sequence 0 brings range(4)
// tokens (a prompt chunk, or 1) and every other sequence one. With chunk 1 it is decode/'s step
// at the same sizes, through the serving interface: issue 19's 1.1x target compares the two.
void decode_continuous(benchmark::State& state) {
  const mha::Index B = state.range(0), context = state.range(2), page = state.range(3);
  const mha::Index chunk = state.range(4);
  auto paged = paged_context(B, state.range(1), context, page, (chunk + page - 1) / page);
  auto options = mha::MultiHeadAttention<float>::decode_options();
  options.cu_seqlens = {0, chunk};
  for (mha::Index b = 1; b < B; ++b) options.cu_seqlens.push_back(chunk + b);
  const auto tokens = random_tensor({chunk + B - 1, 2048}, 2);
  const WallClock wall;
  for (auto _ : state) {
    auto result = paged.layer.decode(tokens, paged.cache, paged.ids, options);
    benchmark::DoNotOptimize(result.output.data());
    for (const mha::Index id : paged.ids) paged.cache.truncate(id, context);
  }
  state.counters["tokens_per_second"] = per_second(state, wall, static_cast<double>(chunk + B - 1));
  state.counters["cache_MiB"] = paged.cache_bytes / (1024.0 * 1024.0);
  set_bytes_read(state, wall, paged.weight_bytes + paged.cache_bytes);
}

// decode_cache/<format>: the decode step above with its KV cache stored as `format`: float
// (as_layer), or quantized in blocks of 32 (q8: 1.06 bytes a value, q4: 0.56), which the decoding
// kernel widens in registers as it reads them. cache_MiB: the bytes the step reads of the cache.
// At context 16 the cache is a few rows: what the step costs beside its cache (the projections,
// their weights' bytes), which bounds what a smaller cache can gain at 16384.
void decode_cache(benchmark::State& state, mha::KVCacheFormat format) {
  decode_step(state, mha::Precision::fp32, 4.0, format);
}
void decode_bf16_frozen(benchmark::State& state) {
  decode_step<mha::FrozenMultiHeadAttention<float>>(state, mha::Precision::bf16, 2.0);
}
// A FrozenMultiHeadAttention<float> made with FrozenWeights::int8.
struct Int8Frozen : mha::FrozenMultiHeadAttention<float> {
  explicit Int8Frozen(const mha::MultiHeadAttention<float>& layer)
      : mha::FrozenMultiHeadAttention<float>(layer, mha::FrozenWeights::int8) {}
};
void decode_int8_frozen(benchmark::State& state) {
  decode_step<Int8Frozen>(state, mha::Precision::fp32, 1.0);
}
// decode_cache_int8_weights/<format>: decode_cache/'s step through a layer with int8 weights
// (decode_int8_frozen/'s), as a deployment that quantizes its cache would also run: the weights'
// bytes, the same for every format, a quarter of decode_cache/'s.
void decode_cache_int8_weights(benchmark::State& state, mha::KVCacheFormat format) {
  decode_step<Int8Frozen>(state, mha::Precision::fp32, 1.0, format);
}

// The attention of one decoding step alone (mha::detail), at sizes whose caches a prompt could not
// fill in a benchmark's time: B = range(0) sequences of context = range(2) cached tokens, one new
// query each, H = 16 query heads of D = 128 over H_kv = range(1) key/value heads, the float cache
// [B, context, H_kv·D] filled with arbitrary values. `batched` runs the decoding kernel
// (kernels/decode.hpp, what a step runs); `per_sequence` the flash kernel one sequence at a time,
// as steps did before it; `read_only` reads the same cache with no arithmetic (an XOR fold, as
// ceiling/memory_read's, straight through on all threads): what the kernel's own bytes read at.
// GB_per_s counts the cache's bytes, each read once; GFLOPS the products (2·(D + Dv) a query
// head and cached token).
// The decoding benchmarks' cached values: arbitrary, bounded and fast to write (gigabytes of
// normal draws would take minutes); element u of the keys (which 0) or values (1).
float arbitrary_cached(std::uint64_t u, int which) {
  return static_cast<float>(u * (which == 0 ? 2654435761U : 40503U) % 1000) * 1e-3F - 0.5F;
}

// The decoding benchmarks' options: D's scale, bottom-right causal masking over `context` keys.
mha::detail::CoreOptions<float> decode_core(mha::Index head_dim, mha::Index context) {
  mha::detail::CoreOptions<float> core;
  core.scale = 1.0F / std::sqrt(static_cast<float>(head_dim));
  core.causal = mha::Causal::bottom_right;
  core.causal_cols = context;
  return core;
}

// B sequences of one query each (rows of `inner` in queries and out) over `context` cached rows
// of row_size elements (floats or blocks), sequence b's from row b · context.
template <class Stored>
std::vector<mha::detail::DecodeSequence<Stored>> decode_sequences(
    mha::Index B, mha::Index context, mha::Index inner, mha::Index row_size, const float* queries,
    float* out, const Stored* keys, const Stored* values) {
  std::vector<mha::detail::DecodeSequence<Stored>> sequences;
  for (mha::Index b = 0; b < B; ++b) {
    sequences.push_back({queries + b * inner, out + b * inner, keys + b * context * row_size,
                         values + b * context * row_size, 1, context});
  }
  return sequences;
}

// `paged` runs the decoding kernel as over a paged cache (PagedKVCache) of pages of range(3)
// tokens: each sequence's rows in pages of a pool, its page table a slice of a shuffled order of
// the pool's pages (fixed seed), as a server's pool is after many sequences came and went.
enum class DecodeRun { batched, per_sequence, read_only, paged };
void decode_attention(benchmark::State& state, DecodeRun run) {
  const mha::Index B = state.range(0), kv_heads = state.range(1), context = state.range(2);
  const mha::Index H = 16, D = 128, inner = H * D, width = kv_heads * D;
  const mha::Index page = run == DecodeRun::paged ? state.range(3) : 0;
  const mha::Index pages_each = page > 0 ? (context + page - 1) / page : 0;
  std::vector<mha::Index> page_order(static_cast<std::size_t>(B * pages_each));
  std::iota(page_order.begin(), page_order.end(), mha::Index{0});
  std::shuffle(page_order.begin(), page_order.end(), std::mt19937_64(7));
  // Stored as the layer's KV cache is: a Tensor's storage, aligned (64 bytes with AVX-512) and on
  // huge pages.
  mha::detail::AlignedBuffer<float> keys, values;
  keys.resize((page > 0 ? B * pages_each * page : B * context) * width, mha::Paging::huge);
  values.resize(keys.size(), mha::Paging::huge);
  for (mha::Index i = 0; i < keys.size(); ++i) {
    keys.data()[i] = arbitrary_cached(static_cast<std::uint64_t>(i), 0);
    values.data()[i] = arbitrary_cached(static_cast<std::uint64_t>(i), 1);
  }
  const auto queries = random_tensor({B, inner}, 1);
  mha::Tensor<float> out({B, inner});
  const mha::detail::CoreOptions<float> core = decode_core(D, context);
  std::vector<mha::detail::KernelScratch<float>> scratch;
  mha::detail::DecodeScratch buffers;
  auto sequences = decode_sequences(B, context, inner, width, queries.data(), out.data(),
                                    keys.data(), values.data());
  for (mha::Index b = 0; b < B && page > 0; ++b) {
    auto& sequence = sequences[static_cast<std::size_t>(b)];
    sequence.keys = keys.data();
    sequence.values = values.data();
    sequence.page_table = page_order.data() + b * pages_each;
    sequence.page_rows = page;
  }
  const mha::detail::DecodeShape shape{H, kv_heads, D, D, inner, inner, width};
  std::uint32_t folded = 0;
  const auto fold = [&folded](const float* data, mha::Index size) {
    folded ^= mha_bench::xor_fold(data, size * static_cast<mha::Index>(sizeof(float)));
  };
  const WallClock wall;
  for (auto _ : state) {
    if (run == DecodeRun::batched || run == DecodeRun::paged) {
      mha::detail::decode_attention(sequences, shape, core, scratch, buffers);
    } else if (run == DecodeRun::per_sequence) {
      for (mha::Index b = 0; b < B; ++b) {
        const mha::detail::HeadLayout<const float> q{queries.data() + b * inner, 0, D, inner, 1, D};
        const mha::detail::HeadLayout<const float> k{
            keys.data() + b * context * width, 0, D, width, context, D, H / kv_heads};
        const mha::detail::HeadLayout<const float> v{
            values.data() + b * context * width, 0, D, width, context, D, H / kv_heads};
        const mha::detail::HeadLayout<float> o{out.data() + b * inner, 0, D, inner, 1, D};
        mha::detail::attention_flash<float>(1, H, q, k, v, o, core, scratch);
      }
    } else {
      fold(keys.data(), keys.size());
      fold(values.data(), values.size());
    }
    benchmark::DoNotOptimize(out.data());
    benchmark::DoNotOptimize(folded);
  }
  set_bytes_read(state, wall, 4.0 * 2 * static_cast<double>(B * context * width));
  if (run != DecodeRun::read_only) {
    set_flops(state, wall, 2.0 * static_cast<double>(B * H * context) * static_cast<double>(D + D));
  }
  state.counters["cache_MiB"] = 8.0 * static_cast<double>(B * context * width) / (1024.0 * 1024.0);
}

// decode_attention/cache_<format>: decode_attention's batched kernel alone over a cache stored
// as float, q8 or q4 (the same values, quantized in blocks of 32), B = range(0) sequences of
// context = range(2) tokens, one new query each, H = 16, D = 128, H_kv = range(1): the cache's
// own gain, without the step's projections (whose weights decode_cache/ reads beside it).
// GB_per_s counts the cache's stored bytes, each read once.
template <class Stored>
void decode_attention_cache(benchmark::State& state) {
  const mha::Index B = state.range(0), kv_heads = state.range(1), context = state.range(2);
  const mha::Index H = 16, D = 128, inner = H * D, width = kv_heads * D;
  constexpr bool kQuantized = mha::detail::is_quantized_block_v<Stored>;
  const mha::Index row_size = kQuantized ? width / mha::detail::kQuantBlock : width;
  std::vector<float> floats(static_cast<std::size_t>(width));
  mha::detail::AlignedBuffer<Stored> keys, values;
  keys.resize(B * context * row_size, mha::Paging::huge);
  values.resize(keys.size(), mha::Paging::huge);
  // decode_attention's values, a row at a time.
  for (int which = 0; which < 2; ++which) {
    Stored* stored = which == 0 ? keys.data() : values.data();
    for (mha::Index row = 0; row < B * context; ++row) {
      for (mha::Index c = 0; c < width; ++c) {
        floats[static_cast<std::size_t>(c)] =
            arbitrary_cached(static_cast<std::uint64_t>(row * width + c), which);
      }
      if constexpr (kQuantized) {
        mha::detail::quantize_rows(floats.data(), 1, width, stored + row * row_size);
      } else {
        std::copy(floats.begin(), floats.end(), stored + row * row_size);
      }
    }
  }
  const auto queries = random_tensor({B, inner}, 1);
  mha::Tensor<float> out({B, inner});
  const mha::detail::CoreOptions<float> core = decode_core(D, context);
  std::vector<mha::detail::KernelScratch<float>> scratch;
  mha::detail::DecodeScratch buffers;
  const auto sequences = decode_sequences(B, context, inner, row_size, queries.data(), out.data(),
                                          keys.data(), values.data());
  const mha::detail::DecodeShape shape{H, kv_heads, D, D, inner, inner, row_size};
  const WallClock wall;
  for (auto _ : state) {
    mha::detail::decode_attention(sequences, shape, core, scratch, buffers);
    benchmark::DoNotOptimize(out.data());
  }
  const double cache_bytes =
      2.0 * static_cast<double>(sizeof(Stored)) * static_cast<double>(B * context * row_size);
  set_bytes_read(state, wall, cache_bytes);
  state.counters["cache_MiB"] = cache_bytes / (1024.0 * 1024.0);
}

// The flash backward alone (mha::detail::attention_flash_backward), B = 1, H = 8, D = 64,
// L = S = range(0), the queries taken in chunks of range(1) (0: the kernel's own choice,
// backward_query_chunk; -1: all L at once). Where the chunks pay: at long L the query-side rows
// each key block re-reads (q, dO, their packed panels, dQ) outgrow the last-level cache.
void flash_backward(benchmark::State& state) {
  const mha::Index H = 8, D = 64, L = state.range(0);
  const auto q = random_tensor({1, H, L, D}, 1), k = random_tensor({1, H, L, D}, 2),
             v = random_tensor({1, H, L, D}, 3), grad_out = random_tensor({1, H, L, D}, 4);
  mha::Tensor<float> out({1, H, L, D}), logsumexp({1, H, L});
  mha::Tensor<float> grad_q(q.shape()), grad_k(k.shape()), grad_v(v.shape());
  mha::detail::CoreOptions<float> core;
  core.causal_cols = L;
  core.scale = 1.0F / std::sqrt(static_cast<float>(D));
  std::vector<mha::detail::KernelScratch<float>> scratch;
  const auto heads = [H, L, D](auto* data) { return mha::detail::contiguous_heads(data, H, L, D); };
  const auto q_heads = heads(q.data()), k_heads = heads(k.data()), v_heads = heads(v.data());
  mha::detail::attention_flash<float>(1, H, q_heads, k_heads, v_heads, heads(out.data()), core,
                                      scratch, logsumexp.data());
  mha::detail::FlashBlocks blocks = mha::detail::kBackwardBlocks;
  blocks.query_chunk = state.range(1) < 0 ? L : state.range(1);
  const auto backward = [&] {
    mha::detail::attention_flash_backward<float>(
        1, H, q_heads, k_heads, v_heads, heads(static_cast<const float*>(out.data())),
        heads(grad_out.data()), logsumexp.data(), heads(grad_q.data()), heads(grad_k.data()),
        heads(grad_v.data()), core, scratch, blocks);
  };
  backward();  // the scratch grown outside the timing (a call of a second is one iteration)
  const WallClock wall;
  for (auto _ : state) {
    backward();
    benchmark::DoNotOptimize(grad_q.data());
  }
  // Recomputing S and dP, then P·dO, dS·K and dSᵀ·Q: five products of 2·L·S·D.
  set_flops(state, wall, 10.0 * static_cast<double>(H * D) * static_cast<double>(L * L));
}

// The same layer (H_kv = range(1)) taking a prompt of range(0) tokens, B = 1: all at once (one
// decode step of n tokens, "prefill"), or token by token (n steps of one). tokens_per_second
// compares the two: a prefill step multiplies matrices, a one-token step multiplies vectors and
// is bound by reading the weights.
void prefill(benchmark::State& state, bool token_by_token) {
  const mha::Index n = state.range(0), kv_heads = state.range(1), E = 2048, H = 16;
  mha::MultiHeadAttentionConfig config(E, H);
  config.num_kv_heads = kv_heads;
  const mha::MultiHeadAttention<float> layer(config);
  auto cache = layer.make_kv_cache(1, n);
  const auto options = mha::MultiHeadAttention<float>::decode_options();
  const auto prompt = random_tensor({1, n, E}, 1);
  std::vector<mha::Tensor<float>> tokens;
  for (mha::Index i = 0; i < n && token_by_token; ++i) {
    tokens.push_back(random_tensor({1, 1, E}, 10 + static_cast<std::uint64_t>(i)));
  }
  const WallClock wall;
  for (auto _ : state) {
    cache.clear();
    if (token_by_token) {
      for (const auto& token : tokens) {
        benchmark::DoNotOptimize(layer.decode(token, cache, options).output.data());
      }
    } else {
      benchmark::DoNotOptimize(layer.decode(prompt, cache, options).output.data());
    }
  }
  state.counters["tokens_per_second"] = per_second(state, wall, static_cast<double>(n));
}

void gemm(benchmark::State& state) {
  const mha::Index n = state.range(0);
  const mha::Matrix<float> a = random_tensor({n, n}, 1).matrix(),
                           b = random_tensor({n, n}, 2).matrix();
  mha::Matrix<float> c(n, n);
  const WallClock wall;
  for (auto _ : state) {
    c.noalias() = a * b;
    benchmark::DoNotOptimize(c.data());
  }
  set_flops(state, wall,
            2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n));
}

// The layer's own product, as its projections run it (kernels/gemm.hpp: x Wᵀ, threaded over
// slabs): dst [L, N] = x [L, E] · W[N, E]ᵀ, N = range(2) (3E for the packed q, k, v projection).
void projection(benchmark::State& state) {
  const mha::Index L = state.range(0), E = state.range(1), N = state.range(2);
  const auto x = random_tensor({L, E}, 1), w = random_tensor({N, E}, 2);
  mha::Tensor<float> dst({L, N});
  std::vector<mha::detail::KernelScratch<float>> scratch;
  const Eigen::Map<const mha::Matrix<float>> weight(w.data(), N, E);
  const WallClock wall;
  for (auto _ : state) {
    mha::detail::product_transposed<float, float>(mha::detail::strided(dst.matrix()),
                                                  mha::detail::const_strided(x.matrix()), weight,
                                                  mha::detail::Accumulate::no, scratch);
    benchmark::DoNotOptimize(dst.data());
  }
  set_flops(state, wall,
            2.0 * static_cast<double>(L) * static_cast<double>(E) * static_cast<double>(N));
}

// The same product with W packed once, before the timing, as ONNX Runtime packs a session's
// weights: what packing at every call costs the layer's projections (a tenth of the forward at
// L = 128, E = 768 on a Zen 4, bench/RESULTS.md). The rows go in slabs of whole micro-tiles, each
// multiplied by the shared packed W (kernels/packed_gemm.hpp's multiply_packed_rhs); its result
// must equal `projection`'s bit for bit, else the benchmark fails.
void projection_prepacked(benchmark::State& state) {
  using Shape = mha::detail::PackedGemmShape;
  const mha::Index L = state.range(0), E = state.range(1), N = state.range(2);
  if (!mha::detail::packed_gemm_available()) {
    state.SkipWithError("the packed GEMM does not run on this CPU");
    return;
  }
  const auto x = random_tensor({L, E}, 1), w = random_tensor({N, E}, 2);
  mha::Tensor<float> dst({L, N}), expected({L, N});
  std::vector<mha::detail::KernelScratch<float>> scratch;
  mha::detail::product_transposed<float, float>(
      mha::detail::strided(expected.matrix()), mha::detail::const_strided(x.matrix()),
      Eigen::Map<const mha::Matrix<float>>(w.data(), N, E), mha::detail::Accumulate::no, scratch);
  const mha::Index width = mha::detail::packed_width(N);
  std::vector<float, Eigen::aligned_allocator<float>> packed(static_cast<std::size_t>(E * width));
  const mha::detail::PackedOperand transposed_w{w.data(), 1, E};  // (k, n) at w[n · E + k]
  for (mha::Index k0 = 0; k0 < E; k0 += Shape::kKc) {
    mha::detail::pack_rhs(transposed_w, k0, std::min(Shape::kKc, E - k0), 0, N,
                          packed.data() + k0 * width);
  }
  // One slab of whole micro-tiles per thread (an element's sums do not depend on where the rows
  // are cut, see packed_gemm.hpp): 8 slabs of 18 rows on two threads had given one 72 rows of
  // 128, which cost what the packing saved.
  const mha::Index tiles = (L + Shape::kMr - 1) / Shape::kMr;
  const mha::Index slabs = std::min<mha::Index>(mha::detail::max_threads(), tiles);
  const auto multiply = [&] {
    MHA_OMP_PRAGMA(omp parallel for schedule(static))
    for (mha::Index slab = 0; slab < slabs; ++slab) {
      const mha::Index first = tiles * slab / slabs * Shape::kMr;
      const mha::Index rows = std::min(L, tiles * (slab + 1) / slabs * Shape::kMr) - first;
      mha::detail::multiply_packed_rhs(rows, N, E,
                                       mha::detail::PackedOperand{x.data() + first * E, E, 1},
                                       packed.data(), 1.0F, false, dst.data() + first * N, N);
    }
  };
  multiply();
  if (!std::equal(dst.data(), dst.data() + dst.size(), expected.data())) {
    state.SkipWithError("the prepacked product differs from the layer's");
    return;
  }
  time_calls(state, multiply, dst.data(),
             2.0 * static_cast<double>(L) * static_cast<double>(E) * static_cast<double>(N));
}

// The same product in bf16 with fp32 sums (kernels/bf16_projection.hpp): W packed
// once into bf16 panels before the timing, as projection_prepacked packs it, x rounded into rows
// of pairs at every call. Against projection_prepacked: what `vdpbf16ps` gains on the layer's
// shapes. of_bf16_peak: the fraction of the bf16 dot-product peak measured in this run;
// error_of_largest: the largest error against the float operands' product in double, over its
// largest element.
void projection_bf16(benchmark::State& state) {
  const mha::Index L = state.range(0), E = state.range(1), N = state.range(2);
  if (!mha::detail::bf16_dot_available()) {
    state.SkipWithError("this CPU lacks AVX512_BF16");
    return;
  }
  const auto x = random_tensor({L, E}, 1), w = random_tensor({N, E}, 2);
  mha::Tensor<float> dst({L, N});
  mha::detail::Bf16PackedWeight packed;
  mha::detail::Bf16Lanes packed_x;
  mha::detail::pack_bf16_weight(w.data(), N, E, E, packed, packed_x);
  const auto multiply = [&] {
    mha::detail::bf16_projection(x.data(), L, E, packed, dst.data(), N, false, packed_x);
  };
  multiply();
  // Its error against the product of the float operands in double, relative to the largest
  // element of that product.
  const mha::Matrix<double> exact =
      x.matrix().cast<double>() * w.matrix().cast<double>().transpose();
  const double error =
      (dst.matrix().cast<double>() - exact).cwiseAbs().maxCoeff() / exact.cwiseAbs().maxCoeff();
  time_calls(state, multiply, dst.data(),
             2.0 * static_cast<double>(L) * static_cast<double>(E) * static_cast<double>(N));
  state.counters["of_bf16_peak"] =
      state.counters["GFLOPS"] / std::max(mha_bench::ceilings().bf16_gflops, 1e-9);
  state.counters["error_of_largest"] = error;
}

// The same product as int8 × int8 (kernels/int8_gemm.hpp's int8_gemm, `vpdpbusd`): W quantized
// per output row and packed once before the timing, x quantized per row at every call.
// of_int8_peak: the fraction of the int8 peak measured in this run (2 operations a
// multiply-add, as GFLOPS counts them); error_of_largest as projection_bf16's.
void projection_int8(benchmark::State& state) {
  const mha::Index L = state.range(0), E = state.range(1), N = state.range(2);
  if (!mha::detail::int8_dot_available()) {
    state.SkipWithError("this CPU lacks AVX512_VNNI");
    return;
  }
  const auto x = random_tensor({L, E}, 1), w = random_tensor({N, E}, 2);
  mha::Tensor<float> dst({L, N});
  mha::detail::Int8Weight quantized;
  mha::detail::quantize_int8_weight(w.data(), N, E, E, quantized);
  mha::detail::Int8PackedWeight packed;
  mha::detail::pack_int8_weight(quantized, packed);
  mha::detail::Int8Scratch scratch;
  const auto multiply = [&] {
    mha::detail::int8_gemm(x.data(), L, E, packed, dst.data(), N, scratch);
  };
  multiply();
  const mha::Matrix<double> exact =
      x.matrix().cast<double>() * w.matrix().cast<double>().transpose();
  const double error =
      (dst.matrix().cast<double>() - exact).cwiseAbs().maxCoeff() / exact.cwiseAbs().maxCoeff();
  time_calls(state, multiply, dst.data(),
             2.0 * static_cast<double>(L) * static_cast<double>(E) * static_cast<double>(N));
  state.counters["of_int8_peak"] =
      state.counters["GFLOPS"] / std::max(mha_bench::ceilings().int8_gops, 1e-9);
  state.counters["error_of_largest"] = error;
}

// The AVX-512 micro-kernel's two tiles alone (kernels/packed_gemm.hpp's micro_tile_avx512): 6 x 32
// (one panel of A) and 12 x 32 (two); without AVX-512, micro_kernel_avx2's 6 x 16; rows = range(0),
// over 72 packed rows of A and B_cols = range(1) packed columns at the depth of a slice (kKc =
// 256), as multiply_panels sweeps them: each row panel (or pair) against every two panels of B, the
// sums added to a tile of dst. Every thread runs its own copy at once, so that B's bytes stream as
// in the layer's products: from L2 at 64 and 1024 columns (64 KiB and 1 MiB of B), from beyond it
// at 8192 (8 MiB), where the first row panel of each chunk of a product takes its B.
void micro_tile(benchmark::State& state) {
  using Shape = mha::detail::PackedGemmShape;
  const mha::Index rows = state.range(0), cols = state.range(1), depth = Shape::kKc;
  const mha::Index a_rows = 72;
  // Without AVX-512, the AVX2 kernel's 6 x 16 tile (micro_kernel_avx2) is the only one there is.
  const bool avx512 = mha::detail::cpu_has_avx512f();
  if (!avx512 && (!mha::detail::cpu_has_avx2_fma() || rows != Shape::kMr)) {
    state.SkipWithError("this CPU has no micro-kernel of this tile's rows");
    return;
  }
  const auto threads = static_cast<mha::Index>(mha::detail::max_threads());
  std::vector<float, Eigen::aligned_allocator<float>> a(static_cast<std::size_t>(a_rows * depth),
                                                        0.5F);
  std::vector<std::vector<float, Eigen::aligned_allocator<float>>> b, dst;
  for (mha::Index t = 0; t < threads; ++t) {
    b.emplace_back(static_cast<std::size_t>(cols * depth), 0.25F);
    dst.emplace_back(static_cast<std::size_t>(a_rows * cols), 0.0F);
  }
  const auto sweep = [&](mha::Index t) {
    const float* panels = b[static_cast<std::size_t>(t)].data();
    float* out = dst[static_cast<std::size_t>(t)].data();
    for (mha::Index i = 0; i < a_rows; i += rows) {
      if (!avx512) {
        for (mha::Index j = 0; j < cols; j += Shape::kNr) {
          mha::detail::micro_kernel_avx2(depth, a.data() + i * depth, 1, Shape::kMr,
                                         panels + j * depth, Shape::kNr, 1.0F, false,
                                         out + i * cols + j, cols);
        }
        continue;
      }
      for (mha::Index j = 0; j < cols; j += 2 * Shape::kNr) {
        const float* b_panel = panels + j * depth;
        if (rows == 2 * Shape::kMr) {
          mha::detail::micro_tile_avx512<2, 2>(depth, a.data() + i * depth, 1, Shape::kMr,
                                               Shape::kMr * depth, b_panel, Shape::kNr * depth,
                                               Shape::kNr, 1.0F, false, out + i * cols + j, cols);
        } else {
          mha::detail::micro_tile_avx512<1, 2>(depth, a.data() + i * depth, 1, Shape::kMr, 0,
                                               b_panel, Shape::kNr * depth, Shape::kNr, 1.0F, false,
                                               out + i * cols + j, cols);
        }
      }
    }
  };
  time_sweeps(state, threads, sweep, dst.data(),
              2.0 * static_cast<double>(threads * a_rows * cols) * static_cast<double>(depth));
  state.counters["B_KiB"] = static_cast<double>(cols * depth) * 4.0 / 1024.0;
}

// The bf16 micro-kernel alone (kernels/bf16_gemm.hpp's micro_tile_bf16, 6 x 32, `vdpbf16ps`),
// swept as micro_tile sweeps the fp32 one: 72 rows of A (rows of pairs) against B_cols = range(0)
// packed columns at a depth of 256 (128 pairs; B's bytes half the fp32 panels'), every thread its
// own copy at once. of_bf16_peak: the fraction of the bf16 dot-product peak measured in this run.
void micro_tile_bf16(benchmark::State& state) {
  using Shape = mha::detail::Bf16GemmShape;
  const mha::Index cols = state.range(0), depth = 256, a_rows = 72;
  const mha::Index pairs = mha::detail::bf16_pairs(depth);
  if (!mha::detail::bf16_dot_available()) {
    state.SkipWithError("this CPU lacks AVX512_BF16");
    return;
  }
  const auto threads = static_cast<mha::Index>(mha::detail::max_threads());
  // Pairs of 0.5 and 0.25 (bf16 0x3F00 and 0x3E80): finite sums at any repetition count.
  std::vector<std::uint32_t> a(static_cast<std::size_t>(a_rows * pairs), 0x3F003F00U);
  std::vector<std::vector<std::uint32_t>> b;
  std::vector<std::vector<float, Eigen::aligned_allocator<float>>> dst;
  for (mha::Index t = 0; t < threads; ++t) {
    b.emplace_back(static_cast<std::size_t>(cols * pairs), 0x3E803E80U);
    dst.emplace_back(static_cast<std::size_t>(a_rows * cols), 0.0F);
  }
  const auto sweep = [&](mha::Index t) {
#ifdef MHA_PACKED_GEMM_X86
    const std::uint32_t* panels = b[static_cast<std::size_t>(t)].data();
    float* out = dst[static_cast<std::size_t>(t)].data();
    for (mha::Index i = 0; i < a_rows; i += Shape::kMr) {
      for (mha::Index j = 0; j < cols; j += 2 * Shape::kNr) {
        mha::detail::micro_tile_bf16<2>(pairs, a.data() + i * pairs, pairs, panels + j * pairs,
                                        Shape::kNr * pairs, 1.0F, false, out + i * cols + j, cols);
      }
    }
#else
    static_cast<void>(t);
#endif
  };
  time_sweeps(state, threads, sweep, dst.data(),
              2.0 * static_cast<double>(threads * a_rows * cols) * static_cast<double>(depth));
  state.counters["of_bf16_peak"] =
      state.counters["GFLOPS"] / std::max(mha_bench::ceilings().bf16_gflops, 1e-9);
  state.counters["B_KiB"] = static_cast<double>(cols * pairs) * 4.0 / 1024.0;
}

// The decoding kernel's scores alone (kernels/decode_products.hpp) for range(0) rows of one
// key/value head (G = 16: 16) and a chunk of range(1) keys (240) of D = range(2) (128: 120 KiB,
// in L2): as the register blocks take them (4 x 4 blocks, each block's sixteen sums across
// lanes) or with the rows as lanes (scaled_dot_lanes). Every thread runs its own copy at once,
// 64 times a parallel region (one call takes microseconds, about what starting the region does).
// (The sizes are arguments: as constants, GCC 12 inlined them into the dot products' remainder
// loop and warned of an overflow that cannot happen.)
void decode_scores(benchmark::State& state, bool lanes) {
  const mha::Index rows = state.range(0), keys = state.range(1), depth = state.range(2);
  const mha::Index repeats = 64;
  if (!mha::detail::query_lanes_available()) {
    state.SkipWithError("the decoding kernel's AVX-512 products do not run on this CPU");
    return;
  }
  const auto threads = static_cast<mha::Index>(mha::detail::max_threads());
  const auto q = random_tensor({rows, depth}, 1), k = random_tensor({keys, depth}, 2);
  struct Copy {
    std::vector<float> prepared, keys, scores;
  };
  std::vector<Copy> copies(static_cast<std::size_t>(threads));
  for (Copy& copy : copies) {
    copy.prepared.resize(static_cast<std::size_t>(rows * depth));
    if (lanes) {
      mha::detail::prepare_query_lanes(q.data(), depth, rows, depth, copy.prepared.data());
    } else {
      mha::detail::prepare_query_rows(q.data(), depth, rows, depth, copy.prepared.data());
    }
    copy.keys.assign(k.data(), k.data() + k.size());
    copy.scores.resize(static_cast<std::size_t>(rows * keys));
  }
  const auto run = [&] {
    MHA_OMP_PRAGMA(omp parallel for schedule(static))
    for (mha::Index t = 0; t < threads; ++t) {
      Copy& copy = copies[static_cast<std::size_t>(t)];
      for (mha::Index repeat = 0; repeat < repeats; ++repeat) {
        if (lanes) {
          mha::detail::scaled_dot_lanes(copy.prepared.data(), rows, copy.keys.data(), depth, keys,
                                        depth, 0.1F, copy.scores.data(), keys);
        } else {
          mha::detail::scaled_dot_rows(copy.prepared.data(), rows, copy.keys.data(), depth, keys,
                                       depth, 0.1F, copy.scores.data(), keys);
        }
      }
    }
  };
  run();
  const WallClock wall;
  for (auto _ : state) {
    run();
    benchmark::DoNotOptimize(copies.data());
  }
  set_flops(state, wall, 2.0 * static_cast<double>(threads * repeats * rows * keys * depth));
}

using Config = std::array<std::int64_t, 4>;  // B, L, E, H

const std::vector<Config> kDefaultConfigs = {{1, 128, 768, 12}, {8, 128, 512, 8},
                                             {1, 1024, 512, 8}, {1, 2048, 512, 8},
                                             {1, 4096, 512, 8}, {4, 512, 1024, 16}};

// The default configurations, the head-count sweep (E in {512, 768, 1024}, every H of
// {1, ..., 64} dividing E, L in {128, 512, 2048}) and the sequence sweep (L = 128 ... 16384 at
// E = 512, H = 8), each once, up to max_length.
std::set<Config> all_configs(std::int64_t max_length) {
  std::set<Config> configs(kDefaultConfigs.begin(), kDefaultConfigs.end());
  for (const std::int64_t e : {512, 768, 1024}) {
    for (const std::int64_t h : {1, 2, 4, 8, 12, 16, 32, 64}) {
      if (e % h != 0) continue;
      for (const std::int64_t l : {128, 512, 2048}) configs.insert({1, l, e, h});
    }
  }
  for (std::int64_t l = 128; l <= 16384; l *= 2) configs.insert({1, l, 512, 8});
  for (auto it = configs.begin(); it != configs.end();) {
    it = (*it)[1] > max_length ? configs.erase(it) : std::next(it);
  }
  return configs;
}

void with_configs(benchmark::internal::Benchmark* b, const std::set<Config>& configs) {
  b->ArgNames({"B", "L", "E", "H"});
  for (const Config& c : configs) b->Args({c[0], c[1], c[2], c[3]});
  b->Unit(benchmark::kMillisecond);
  b->Setup(measure_peak_before_run)->Teardown(forget_peak_before_run);
}

void default_shapes(benchmark::internal::Benchmark* b) {
  with_configs(b, std::set<Config>(kDefaultConfigs.begin(), kDefaultConfigs.end()));
}
// Training: the default configurations and L = 128 ... max_length at E = 512, H = 8.
std::set<Config> train_configs(std::int64_t max_length) {
  std::set<Config> configs(kDefaultConfigs.begin(), kDefaultConfigs.end());
  for (std::int64_t l = 128; l <= 8192; l *= 2) configs.insert({1, l, 512, 8});
  for (auto it = configs.begin(); it != configs.end();) {
    it = (*it)[1] > max_length ? configs.erase(it) : std::next(it);
  }
  return configs;
}
// The reference backward holds two [L, S'] matrices per thread (P and dS): 128 MiB per thread at
// L = 4096, 512 MiB at 8192.
void train_reference_shapes(benchmark::internal::Benchmark* b) {
  with_configs(b, train_configs(4096));
}
void train_shapes(benchmark::internal::Benchmark* b) {
  with_configs(b, train_configs(8192));
}
// The reference kernel stores H·L² scores: up to L = 4096 (512 MiB at H = 8).
void reference_shapes(benchmark::internal::Benchmark* b) {
  with_configs(b, all_configs(4096));
}
void sweep_shapes(benchmark::internal::Benchmark* b) {
  with_configs(b, all_configs(16384));
}
// Precision::bf16: the default configurations, L = 512 at E = 512, H = 8, and the head counts at
// L = 2048, E = 1024 (D = 64 and 128: the small-head kernel, D <= 16, stays fp32).
void bf16_shapes(benchmark::internal::Benchmark* b) {
  std::set<Config> configs(kDefaultConfigs.begin(), kDefaultConfigs.end());
  configs.insert({1, 512, 512, 8});
  configs.insert({1, 2048, 1024, 8});
  configs.insert({1, 2048, 1024, 16});
  with_configs(b, configs);
}

}  // namespace

BENCHMARK(ceiling_fma)->Name("ceiling/fma_peak")->Iterations(3)->Unit(benchmark::kMillisecond);
BENCHMARK(ceiling_bf16)->Name("ceiling/bf16_peak")->Iterations(3)->Unit(benchmark::kMillisecond);
BENCHMARK(ceiling_int8)->Name("ceiling/int8_peak")->Iterations(3)->Unit(benchmark::kMillisecond);
BENCHMARK(ceiling_read)->Name("ceiling/memory_read")->Iterations(3)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(forward, reference, mha::Kernel::reference)
    ->Name("forward/reference")
    ->Apply(reference_shapes);
BENCHMARK_CAPTURE(forward, flash, mha::Kernel::flash)->Name("forward/flash")->Apply(sweep_shapes);
BENCHMARK_CAPTURE(forward, auto, mha::Kernel::automatic) -> Name("forward/auto")
    -> Apply(sweep_shapes);
void forward_frozen(benchmark::State& state, mha::Kernel kernel) {
  forward<mha::FrozenMultiHeadAttention<float>>(state, kernel);
}
BENCHMARK_CAPTURE(forward_frozen, auto, mha::Kernel::automatic) -> Name("forward_frozen/auto")
    -> Apply(sweep_shapes);
// The layer with Precision::bf16 (projections and flash tiles in bf16 with fp32 sums), as a
// MultiHeadAttention (its weights packed into bf16 panels at every call) and frozen (packed
// once); against forward/auto and forward_frozen/auto of the same run. of_bf16_peak: the
// fraction of the bf16 dot-product peak measured in this run.
void forward_bf16(benchmark::State& state, bool frozen) {
  if (!mha::bf16_arithmetic_available()) {
    state.SkipWithError("this CPU lacks AVX512_BF16");
    return;
  }
  if (frozen) {
    forward<mha::FrozenMultiHeadAttention<float>>(state, mha::Kernel::automatic, false,
                                                  mha::Precision::bf16);
  } else {
    forward(state, mha::Kernel::automatic, false, mha::Precision::bf16);
  }
  state.counters["of_bf16_peak"] =
      state.counters["GFLOPS"] / std::max(mha_bench::ceilings().bf16_gflops, 1e-9);
}
// A FrozenMultiHeadAttention with FrozenWeights::int8, its projections as int8 × int8 products
// (Precision::int8); against forward_frozen/auto of the same run.
void forward_int8_frozen(benchmark::State& state) {
  if (!mha::detail::int8_dot_available()) {
    state.SkipWithError("this CPU lacks AVX512_VNNI");
    return;
  }
  forward<Int8Frozen>(state, mha::Kernel::automatic, false, mha::Precision::int8);
}
BENCHMARK(forward_int8_frozen)->Name("forward_int8_frozen/auto")->Apply(bf16_shapes);
BENCHMARK_CAPTURE(forward_bf16, layer, false)->Name("forward_bf16/auto")->Apply(bf16_shapes);
BENCHMARK_CAPTURE(forward_bf16, frozen, true)->Name("forward_bf16_frozen/auto")->Apply(bf16_shapes);
BENCHMARK_CAPTURE(forward, fresh, mha::Kernel::automatic, true)
    ->Name("forward_fresh/auto")
    ->Apply(default_shapes);
BENCHMARK_CAPTURE(train, reference, mha::Kernel::reference)
    ->Name("train/reference")
    ->Apply(train_reference_shapes);
BENCHMARK_CAPTURE(train, flash, mha::Kernel::flash)->Name("train/flash")->Apply(train_shapes);
BENCHMARK_CAPTURE(train, auto, mha::Kernel::automatic) -> Name("train/auto") -> Apply(train_shapes);
BENCHMARK_CAPTURE(train, bf16, mha::Kernel::automatic, mha::Precision::bf16)
    ->Name("train_bf16/auto")
    ->Apply(train_shapes);
BENCHMARK_CAPTURE(train, fp16, mha::Kernel::automatic, mha::Precision::fp16)
    ->Name("train_fp16/auto")
    ->Apply(train_shapes);
BENCHMARK_CAPTURE(sdpa, reference, mha::Kernel::reference)
    ->Name("sdpa/reference")
    ->Apply(default_shapes);
BENCHMARK_CAPTURE(sdpa, flash, mha::Kernel::flash)->Name("sdpa/flash")->Apply(default_shapes);
BENCHMARK_CAPTURE(sdpa, flash_bf16, mha::Kernel::flash, mha::Precision::bf16)
    ->Name("sdpa_bf16/flash")
    ->Apply(bf16_shapes);
BENCHMARK_CAPTURE(small_heads, gemm_tiles, false)
    ->Name("small_heads/gemm_tiles")
    ->ArgName("L")
    ->RangeMultiplier(2)
    ->Range(1, 256);
BENCHMARK_CAPTURE(small_heads, small_head_kernel, true)
    ->Name("small_heads/small_head_kernel")
    ->ArgName("L")
    ->RangeMultiplier(2)
    ->Range(1, 256);
BENCHMARK(window)
    ->Name("window/flash")
    ->ArgNames({"L", "w"})
    ->ArgsProduct({{16384}, {-1, 8192, 2048, 512, 128}})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(block_sparse)
    ->Name("pattern/blocks")
    ->ArgName("one_in")
    ->Arg(1)
    ->Arg(2)
    ->Arg(4)
    ->Arg(8)
    ->Arg(16)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(global_tokens)
    ->Name("pattern/band_global")
    ->ArgName("g")
    ->Arg(0)
    ->Arg(1)
    ->Arg(16)
    ->Arg(64)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(flex_variant, causal_builtin, FlexVariant::causal, false)
    ->Name("flex/causal/builtin")
    ->ArgName("L")
    ->Arg(4096)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(flex_variant, causal_mod, FlexVariant::causal, true)
    ->Name("flex/causal/mod")
    ->ArgName("L")
    ->Arg(4096)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(flex_variant, window_builtin, FlexVariant::window, false)
    ->Name("flex/window/builtin")
    ->ArgName("L")
    ->Arg(4096)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(flex_variant, window_mod, FlexVariant::window, true)
    ->Name("flex/window/mod")
    ->ArgName("L")
    ->Arg(4096)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(flex_variant, alibi_builtin, FlexVariant::alibi, false)
    ->Name("flex/alibi/builtin")
    ->ArgName("L")
    ->Arg(4096)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(flex_variant, alibi_mod, FlexVariant::alibi, true)
    ->Name("flex/alibi/mod")
    ->ArgName("L")
    ->Arg(4096)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(flex_variant, softcap_builtin, FlexVariant::softcap, false)
    ->Name("flex/softcap/builtin")
    ->ArgName("L")
    ->Arg(4096)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(flex_variant, softcap_mod, FlexVariant::softcap, true)
    ->Name("flex/softcap/mod")
    ->ArgName("L")
    ->Arg(4096)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(flex_documents, separate, false)
    ->Name("flex/documents/separate")
    ->ArgName("n")
    ->Arg(4)
    ->Arg(16)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(flex_documents, mod, true)
    ->Name("flex/documents/mod")
    ->ArgName("n")
    ->Arg(4)
    ->Arg(16)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(flex_neighbourhood, dense, false)
    ->Name("flex/neighbourhood/dense")
    ->ArgName("kernel")
    ->Arg(0)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(flex_neighbourhood, mod, true)
    ->Name("flex/neighbourhood/mod")
    ->ArgName("kernel")
    ->Arg(7)
    ->Arg(13)
    ->Arg(21)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(flex_decode_step, window_builtin, true, FlexDecodeWay::builtin)
    ->Name("flex_decode/window/builtin")
    ->ArgNames({"B", "context"})
    ->Args({8, 8192})
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(flex_decode_step, window_mod, true, FlexDecodeWay::mod)
    ->Name("flex_decode/window/mod")
    ->ArgNames({"B", "context"})
    ->Args({8, 8192})
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(flex_decode_step, window_block, true, FlexDecodeWay::block)
    ->Name("flex_decode/window/block")
    ->ArgNames({"B", "context"})
    ->Args({8, 8192})
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(flex_decode_step, alibi_builtin, false, FlexDecodeWay::builtin)
    ->Name("flex_decode/alibi/builtin")
    ->ArgNames({"B", "context"})
    ->Args({8, 8192})
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(flex_decode_step, alibi_mod, false, FlexDecodeWay::mod)
    ->Name("flex_decode/alibi/mod")
    ->ArgNames({"B", "context"})
    ->Args({8, 8192})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(talking_heads)
    ->Name("talking_heads/reference")
    ->ArgNames({"L", "mixes"})
    ->ArgsProduct({{512, 2048}, {0, 1}})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(decode)
    ->Name("decode")
    ->ArgNames({"B", "H_kv", "context"})
    ->ArgsProduct({{1, 8}, {16, 8, 4, 2, 1}, {16, 2048}})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(decode_paged)
    ->Name("decode_paged")
    ->ArgNames({"B", "H_kv", "context", "page"})
    ->ArgsProduct({{1, 8}, {16, 4, 1}, {2048}, {48, 192}})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(decode_continuous)
    ->Name("decode_continuous")
    ->ArgNames({"B", "H_kv", "context", "page", "chunk"})
    ->ArgsProduct({{8}, {16, 4, 1}, {2048}, {48, 192}, {1, 64}})
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(decode_cache, float, mha::KVCacheFormat::as_layer)
    ->Name("decode_cache/float")
    ->ArgNames({"B", "H_kv", "context"})
    ->ArgsProduct({{1, 4}, {16, 4}, {16, 16384}})
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(decode_cache, q8, mha::KVCacheFormat::q8)
    ->Name("decode_cache/q8")
    ->ArgNames({"B", "H_kv", "context"})
    ->ArgsProduct({{1, 4}, {16, 4}, {16, 16384}})
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(decode_cache, q4, mha::KVCacheFormat::q4)
    ->Name("decode_cache/q4")
    ->ArgNames({"B", "H_kv", "context"})
    ->ArgsProduct({{1, 4}, {16, 4}, {16, 16384}})
    ->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(decode_attention_cache, float)
    ->Name("decode_attention/cache_float")
    ->ArgNames({"B", "H_kv", "context"})
    ->ArgsProduct({{1, 4}, {16, 4}, {16384}})
    ->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(decode_attention_cache, mha::detail::Q8Block)
    ->Name("decode_attention/cache_q8")
    ->ArgNames({"B", "H_kv", "context"})
    ->ArgsProduct({{1, 4}, {16, 4}, {16384}})
    ->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(decode_attention_cache, mha::detail::Q4Block)
    ->Name("decode_attention/cache_q4")
    ->ArgNames({"B", "H_kv", "context"})
    ->ArgsProduct({{1, 4}, {16, 4}, {16384}})
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(decode_cache_int8_weights, float, mha::KVCacheFormat::as_layer)
    ->Name("decode_cache_int8_weights/float")
    ->ArgNames({"B", "H_kv", "context"})
    ->ArgsProduct({{1, 4}, {16, 4}, {16, 16384}})
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(decode_cache_int8_weights, q8, mha::KVCacheFormat::q8)
    ->Name("decode_cache_int8_weights/q8")
    ->ArgNames({"B", "H_kv", "context"})
    ->ArgsProduct({{1, 4}, {16, 4}, {16, 16384}})
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(decode_cache_int8_weights, q4, mha::KVCacheFormat::q4)
    ->Name("decode_cache_int8_weights/q4")
    ->ArgNames({"B", "H_kv", "context"})
    ->ArgsProduct({{1, 4}, {16, 4}, {16, 16384}})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(decode_bf16_frozen)
    ->Name("decode_bf16_frozen")
    ->ArgNames({"B", "H_kv", "context"})
    ->ArgsProduct({{1, 8}, {16}, {16, 2048}})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(decode_int8_frozen)
    ->Name("decode_int8_frozen")
    ->ArgNames({"B", "H_kv", "context"})
    ->ArgsProduct({{1, 8}, {16}, {16, 2048}})
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(decode_attention, batched, DecodeRun::batched)
    ->Name("decode_attention/batched")
    ->ArgNames({"B", "H_kv", "context"})
    ->ArgsProduct({{1, 8, 32}, {16, 4, 1}, {2048, 16384}})
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(decode_attention, paged, DecodeRun::paged)
    ->Name("decode_attention/paged")
    ->ArgNames({"B", "H_kv", "context", "page"})
    ->ArgsProduct({{1, 8, 32}, {16, 4, 1}, {2048, 16384}, {48, 192}})
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(decode_attention, per_sequence, DecodeRun::per_sequence)
    ->Name("decode_attention/per_sequence")
    ->ArgNames({"B", "H_kv", "context"})
    ->ArgsProduct({{1, 8, 32}, {16, 4, 1}, {2048, 16384}})
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(decode_attention, read_only, DecodeRun::read_only)
    ->Name("decode_attention/read_only")
    ->ArgNames({"B", "H_kv", "context"})
    ->ArgsProduct({{1, 8, 32}, {16, 4, 1}, {2048, 16384}})
    ->Unit(benchmark::kMillisecond);
// The kernel's arithmetic rate with its cache in the last-level cache (8 MiB at B = 8): what it
// would read at if memory were free, to set beside its rate from memory.
BENCHMARK_CAPTURE(decode_attention, in_cache, DecodeRun::batched)
    ->Name("decode_attention/batched_in_cache")
    ->ArgNames({"B", "H_kv", "context"})
    ->Args({8, 16, 64})
    ->Args({8, 4, 256})
    ->Args({8, 1, 1024})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(flash_backward)
    ->Name("flash_backward")
    ->ArgNames({"L", "chunk"})
    ->ArgsProduct({{4096, 8192}, {0, -1}})
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(prefill, prefill, false)
    ->Name("prefill/all_at_once")
    ->ArgNames({"n", "H_kv"})
    ->ArgsProduct({{512}, {16, 4}})
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(prefill, token_by_token, true)
    ->Name("prefill/token_by_token")
    ->ArgNames({"n", "H_kv"})
    ->ArgsProduct({{512}, {16, 4}})
    ->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(precision_forward, float)
    ->Name("precision/forward/float")
    ->ArgName("L")
    ->Arg(512)
    ->Arg(2048)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(precision_forward, Eigen::half)
    ->Name("precision/forward/half")
    ->ArgName("L")
    ->Arg(512)
    ->Arg(2048)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(precision_forward, Eigen::bfloat16)
    ->Name("precision/forward/bfloat16")
    ->ArgName("L")
    ->Arg(512)
    ->Arg(2048)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(precision_decode, float)
    ->Name("precision/decode/float")
    ->ArgName("context")
    ->Arg(16)
    ->Arg(2048)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(precision_decode, Eigen::half)
    ->Name("precision/decode/half")
    ->ArgName("context")
    ->Arg(16)
    ->Arg(2048)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(precision_decode, Eigen::bfloat16)
    ->Name("precision/decode/bfloat16")
    ->ArgName("context")
    ->Arg(16)
    ->Arg(2048)
    ->Unit(benchmark::kMillisecond);
// The layer's projection shapes (L, E, N): the packed q, k, v projection and the output's at L =
// 128, 512, 1024 and 2048.
void projection_shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"L", "E", "N"});
  for (const auto& shape : std::vector<std::vector<std::int64_t>>{{128, 768, 2304},
                                                                  {128, 768, 768},
                                                                  {512, 512, 1536},
                                                                  {512, 512, 512},
                                                                  {2048, 512, 1536},
                                                                  {2048, 1024, 3072},
                                                                  {1024, 1024, 1024}}) {
    b->Args(shape);
  }
  b->Unit(benchmark::kMillisecond)
      ->Setup(measure_peak_before_run)
      ->Teardown(forget_peak_before_run);
}
BENCHMARK(projection)->Name("projection")->Apply(projection_shapes);
BENCHMARK(projection_prepacked)->Name("projection_prepacked")->Apply(projection_shapes);
BENCHMARK(projection_bf16)->Name("projection_bf16")->Apply(projection_shapes);
BENCHMARK(projection_int8)->Name("projection_int8")->Apply(projection_shapes);
BENCHMARK_CAPTURE(decode_scores, blocks, false)
    ->Name("decode_scores/blocks")
    ->ArgNames({"rows", "keys", "D"})
    ->Args({16, 240, 128});
BENCHMARK_CAPTURE(decode_scores, lanes, true)
    ->Name("decode_scores/lanes")
    ->ArgNames({"rows", "keys", "D"})
    ->Args({16, 240, 128});
BENCHMARK(micro_tile)
    ->Name("micro_tile")
    ->ArgNames({"rows", "B_cols"})
    ->ArgsProduct({{6, 12}, {64, 1024, 8192}});
BENCHMARK(micro_tile_bf16)
    ->Name("micro_tile_bf16")
    ->ArgName("B_cols")
    ->Arg(64)
    ->Arg(1024)
    ->Arg(8192)
    ->Arg(16384);
BENCHMARK(gemm)->Name("gemm")->ArgName("N")->Arg(512)->Arg(1024)->Unit(benchmark::kMillisecond);

// Google Benchmark's main, with the ceilings measured before the first benchmark and written
// into the output's context (the ceiling benchmarks measure them again, and raise them).
namespace {

// The command line as a shell would take it back (arguments with characters a shell reads
// quoted), and the environment variables that change what the benchmarks measure: recorded in
// the output's context, so that each results file says what wrote it.
std::string command_line(int argc, char** argv) {
  std::string line;
  for (int i = 0; i < argc; ++i) {
    const std::string argument = argv[i];
    const bool plain = argument.find_first_of(" '\"|()^$*?[]{}&;<>\\") == std::string::npos;
    line += (i > 0 ? " " : "") + (plain ? argument : "'" + argument + "'");
  }
  return line;
}

std::string environment() {
  std::string set;
  for (const char* name : {"OMP_NUM_THREADS", "OMP_WAIT_POLICY", "OMP_PROC_BIND", "GOMP_SPINCOUNT",
                           "OPENBLAS_CORETYPE", "OPENBLAS_NUM_THREADS", "GLIBC_TUNABLES"}) {
    if (const char* value = std::getenv(name)) {
      set += (set.empty() ? "" : " ") + std::string(name) + "=" + value;
    }
  }
  return set;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string command = command_line(argc, argv);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  const auto& ceilings = mha_bench::ceilings();
  benchmark::AddCustomContext("fma_peak_GFLOPS",
                              std::to_string(ceilings.fma_gflops) + " (" + ceilings.fma_isa + ")");
  benchmark::AddCustomContext("bf16_peak_GFLOPS", std::to_string(ceilings.bf16_gflops));
  benchmark::AddCustomContext("int8_peak_GOPS", std::to_string(ceilings.int8_gops));
  benchmark::AddCustomContext("memory_read_GB_per_s", std::to_string(ceilings.read_gbs));
  benchmark::AddCustomContext("command", command);
  benchmark::AddCustomContext("environment", environment());
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
