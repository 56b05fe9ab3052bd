// The ceilings of ceilings.hpp. Each peak loop keeps enough independent accumulator chains in
// registers to cover the instruction's latency on both of a core's pipes (Zen 3 and 5: latency
// 4, two pipes, so 8 chains; 12 or 16 here), so that it measures the throughput the instruction
// allows at the clock the cores run at now: the nominal clock underestimates boosting cores by
// up to 1.6 times.
#include "ceilings.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#define MHA_BENCH_X86 1
#endif
#ifdef _OPENMP
#include <omp.h>
#define MHA_BENCH_OMP(x) _Pragma(#x)
#else
#define MHA_BENCH_OMP(x)
#endif

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include <mha/kernels/unroll.hpp>
#include <mha/tensor.hpp>

namespace mha_bench {
namespace {

using Clock = std::chrono::steady_clock;

int threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

// The best rate over repeated runs of `run(iterations)`, each returning the work it did (flops or
// bytes), for about `seconds` in all: iterations grow until one run takes at least 20 ms.
template <class Run>
double best_rate(double seconds, Run&& run) {
  std::int64_t iterations = 1 << 10;
  double best = 0;
  const auto start = Clock::now();
  while (std::chrono::duration<double>(Clock::now() - start).count() < seconds) {
    const auto before = Clock::now();
    const double work = run(iterations);
    const double elapsed = std::chrono::duration<double>(Clock::now() - before).count();
    if (elapsed < 0.02) {
      iterations *= 2;
      continue;
    }
    best = std::max(best, work / elapsed);
  }
  return best;
}

// Each chain's accumulator starts apart and is multiplied by a factor just below 1, so that no
// value overflows or becomes subnormal however long the loop runs.
#ifdef MHA_BENCH_X86
// The sum of every lane of `count` accumulators: what keeps the loops from being optimised away.
// (Through memory: GCC 12's _mm512_reduce_add_ps trips its own -Wuninitialized.)
__attribute__((target("avx512f"))) float sum_of(const __m512* acc, int count) {
  float total = 0;
  alignas(64) float lanes[16];
  for (int c = 0; c < count; ++c) {
    _mm512_store_ps(lanes, acc[c]);
    for (const float lane : lanes) total += lane;
  }
  return total;
}

__attribute__((target("avx512f"))) float fma_chains_avx512(std::int64_t iterations) {
  constexpr int kChains = 16;
  __m512 acc[kChains];
  MHA_UNROLL
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(1.0F + 0.01F * static_cast<float>(c));
  const __m512 factor = _mm512_set1_ps(0.9999999F), term = _mm512_set1_ps(1e-7F);
  for (std::int64_t i = 0; i < iterations; ++i) {
    MHA_UNROLL
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_fmadd_ps(acc[c], factor, term);
  }
  return sum_of(acc, kChains);
}
constexpr double kAvx512FlopsPerIteration = 16 * 16 * 2;

__attribute__((target("avx2,fma"))) float fma_chains_avx2(std::int64_t iterations) {
  constexpr int kChains = 12;
  __m256 acc[kChains];
  MHA_UNROLL
  for (int c = 0; c < kChains; ++c) acc[c] = _mm256_set1_ps(1.0F + 0.01F * static_cast<float>(c));
  const __m256 factor = _mm256_set1_ps(0.9999999F), term = _mm256_set1_ps(1e-7F);
  for (std::int64_t i = 0; i < iterations; ++i) {
    MHA_UNROLL
    for (int c = 0; c < kChains; ++c) acc[c] = _mm256_fmadd_ps(acc[c], factor, term);
  }
  __m256 sum = acc[0];
  for (int c = 1; c < kChains; ++c) sum = _mm256_add_ps(sum, acc[c]);
  float lanes[8];
  _mm256_storeu_ps(lanes, sum);
  float total = 0;
  for (const float lane : lanes) total += lane;
  return total;
}
constexpr double kAvx2FlopsPerIteration = 12 * 8 * 2;

// vdpbf16ps: each 32-bit lane adds two bf16 products, 4 flops.
__attribute__((target("avx512f,avx512bf16"))) float dot_chains_bf16(std::int64_t iterations) {
  constexpr int kChains = 16;
  __m512 acc[kChains];
  MHA_UNROLL
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(static_cast<float>(c));
  // bf16 pairs of 1/1024 and 2^-20: each instruction adds 2^-29 per lane.
  const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi16(0x3A80));
  const __m512bh b = reinterpret_cast<__m512bh>(_mm512_set1_epi16(0x3580));
  for (std::int64_t i = 0; i < iterations; ++i) {
    MHA_UNROLL
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], a, b);
  }
  return sum_of(acc, kChains);
}
constexpr double kBf16FlopsPerIteration = 16 * 16 * 4;

// vpdpbusd: each 32-bit lane adds four u8 × s8 products, 8 operations.
__attribute__((target("avx512f,avx512vnni"))) float dot_chains_int8(std::int64_t iterations) {
  constexpr int kChains = 16;
  __m512i acc[kChains];
  MHA_UNROLL
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_epi32(c);
  // Bytes 1 and 1: each instruction adds 4 per lane, so 2^29 iterations stay in range.
  const __m512i a = _mm512_set1_epi8(1);
  const __m512i b = _mm512_set1_epi8(1);
  for (std::int64_t i = 0; i < iterations; ++i) {
    MHA_UNROLL
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbusd_epi32(acc[c], a, b);
  }
  __m512i sum = acc[0];
  for (int c = 1; c < kChains; ++c) sum = _mm512_add_epi32(sum, acc[c]);
  return static_cast<float>(_mm512_reduce_add_epi32(sum));
}
constexpr double kInt8OpsPerIteration = 16 * 16 * 8;

bool has_avx512_vnni() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__builtin_cpu_supports("avx512f")) return false;
  if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0) return false;
  return (ecx & (1U << 11)) != 0;
}

bool has_avx512_bf16() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__builtin_cpu_supports("avx512f")) return false;
  if (__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) == 0) return false;
  return (eax & (1U << 5)) != 0;
}
#endif

// The portable loop: what the compiler makes of 16 scalar chains.
float fma_chains_scalar(std::int64_t iterations) {
  constexpr int kChains = 16;
  float acc[kChains];
  MHA_UNROLL
  for (int c = 0; c < kChains; ++c) acc[c] = 1.0F + 0.01F * static_cast<float>(c);
  for (std::int64_t i = 0; i < iterations; ++i) {
    for (float& a : acc) a = a * 0.9999999F + 1e-7F;
  }
  float total = 0;
  for (const float a : acc) total += a;
  return total;
}
constexpr double kScalarFlopsPerIteration = 16 * 2;

// Runs chains(iterations) on every thread; returns the flops done.
template <class Chains>
double on_all_threads(Chains chains, std::int64_t iterations, double flops_per_iteration) {
  std::vector<float> results(static_cast<std::size_t>(threads()));
  MHA_BENCH_OMP(omp parallel) {
#ifdef _OPENMP
    const auto t = static_cast<std::size_t>(omp_get_thread_num());
#else
    const std::size_t t = 0;
#endif
    results[t] = chains(iterations);
  }
  volatile float sink = results[0];  // keeps the loops
  static_cast<void>(sink);
  return flops_per_iteration * static_cast<double>(iterations) *
         static_cast<double>(results.size());
}

}  // namespace

double fma_peak_gflops(double seconds, std::string* isa) {
  float (*chains)(std::int64_t) = fma_chains_scalar;
  double flops = kScalarFlopsPerIteration;
  std::string name = "scalar";
#ifdef MHA_BENCH_X86
  if (__builtin_cpu_supports("avx512f")) {
    chains = fma_chains_avx512;
    flops = kAvx512FlopsPerIteration;
    name = "avx512";
  } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    chains = fma_chains_avx2;
    flops = kAvx2FlopsPerIteration;
    name = "avx2";
  }
#endif
  if (isa != nullptr) *isa = name;
  return 1e-9 * best_rate(seconds, [&](std::int64_t iterations) {
           return on_all_threads(chains, iterations, flops);
         });
}

double bf16_peak_gflops(double seconds) {
#ifdef MHA_BENCH_X86
  if (has_avx512_bf16()) {
    return 1e-9 * best_rate(seconds, [&](std::int64_t iterations) {
             return on_all_threads(dot_chains_bf16, iterations, kBf16FlopsPerIteration);
           });
  }
#endif
  static_cast<void>(seconds);
  return 0;
}

double int8_peak_gops(double seconds) {
#ifdef MHA_BENCH_X86
  if (has_avx512_vnni()) {
    return 1e-9 * best_rate(seconds, [&](std::int64_t iterations) {
             return on_all_threads(dot_chains_int8, iterations, kInt8OpsPerIteration);
           });
  }
#endif
  static_cast<void>(seconds);
  return 0;
}

namespace {
#ifdef MHA_BENCH_X86
// The XOR of words [0, count), count a multiple of 16: one 512-bit load and XOR a step, the loop
// GCC 12 makes of the plain one at -O3. (Four accumulators, four lines a step, read 0.82 as fast:
// 52.9-57.2 GB/s against 65.5-71.3, alternated, 2026-12-04.)
__attribute__((target("avx512f"))) std::uint32_t xor_words_avx512(const std::uint32_t* words,
                                                                  std::int64_t count) {
  __m512i acc = _mm512_setzero_si512();
  for (std::int64_t i = 0; i < count; i += 16) {
    acc = _mm512_xor_si512(acc, _mm512_loadu_si512(words + i));
  }
  alignas(64) std::uint32_t lanes[16];
  _mm512_store_si512(lanes, acc);
  std::uint32_t folded = 0;
  for (const std::uint32_t lane : lanes) folded ^= lane;
  return folded;
}
#endif

}  // namespace

std::uint32_t xor_fold(const void* data, std::int64_t bytes) {
  const std::int64_t count = bytes / static_cast<std::int64_t>(sizeof(std::uint32_t));
  const auto word = [data](std::int64_t i) {
    std::uint32_t w = 0;
    std::memcpy(&w, static_cast<const char*>(data) + i * 4, sizeof w);
    return w;
  };
  std::uint32_t folded = 0;
  MHA_BENCH_OMP(omp parallel reduction(^ : folded)) {
#ifdef _OPENMP
    const auto t = static_cast<std::int64_t>(omp_get_thread_num());
    const auto n = static_cast<std::int64_t>(omp_get_num_threads());
#else
    const std::int64_t t = 0, n = 1;
#endif
    // Each thread a contiguous share, in whole 64-byte steps but for the last one's tail.
    const std::int64_t share = (count / n) / 16 * 16;
    const std::int64_t begin = t * share, end = t + 1 == n ? count : begin + share;
    std::int64_t i = begin;
#ifdef MHA_BENCH_X86
    if (__builtin_cpu_supports("avx512f")) {
      const std::int64_t whole = (end - begin) / 16 * 16;
      // (Through uint32_t: the words are whatever `data` holds; the loads do not care.)
      folded ^= xor_words_avx512(static_cast<const std::uint32_t*>(data) + begin, whole);
      i += whole;
    }
#endif
    for (; i < end; ++i) folded ^= word(i);
  }
  return folded;
}

double memory_read_gbs(double seconds) {
  // 512 MiB: 16 times a 32 MiB last-level cache. Written first by the threads that read it, so
  // that each reads pages placed near it. On huge pages, as the library's KV caches are
  // (mha::Paging): on 4 KiB pages the walks of the page tables, not the memory, bound a stream
  // of gigabytes on this virtual machine (it read 38-50 GB/s that way, 77-84 on huge pages).
  constexpr std::int64_t kWords = std::int64_t{1} << 27;
  mha::detail::AlignedBuffer<std::uint32_t> owner;
  owner.resize(kWords, mha::Paging::huge);
  std::uint32_t* const words = owner.data();
  MHA_BENCH_OMP(omp parallel for schedule(static))
  for (std::int64_t i = 0; i < kWords; ++i) words[i] = static_cast<std::uint32_t>(i);
  std::uint32_t sink = 0;
  // One pass per run, whatever `iterations` asks: a pass of 512 MiB takes 7 to 15 ms.
  const double rate = best_rate(seconds, [&](std::int64_t iterations) {
    double bytes = 0;
    for (std::int64_t pass = 0; pass < std::max<std::int64_t>(1, iterations >> 10); ++pass) {
      sink ^= xor_fold(words, kWords * static_cast<std::int64_t>(sizeof(std::uint32_t)));
      bytes += static_cast<double>(kWords) * sizeof(std::uint32_t);
    }
    return bytes;
  });
  volatile std::uint32_t keep = sink;
  static_cast<void>(keep);
  return 1e-9 * rate;
}

Ceilings& ceilings() {
  static Ceilings measured = [] {
    Ceilings c;
    c.fma_gflops = fma_peak_gflops(0.3, &c.fma_isa);
    c.bf16_gflops = bf16_peak_gflops(0.3);
    c.int8_gops = int8_peak_gops(0.3);
    c.read_gbs = memory_read_gbs(0.5);
    return c;
  }();
  return measured;
}

}  // namespace mha_bench
