// The machine's ceilings, measured in the same run as the benchmarks they bound: the fp32 FMA
// peak, the bf16 dot-product peak (where the CPU has AVX512_BF16), the int8 one (AVX512_VNNI)
// and the memory read bandwidth.
// Each is the best of a few short timed runs on all of OpenMP's threads. The instructions are
// chosen at run time from what the CPU has (AVX-512, else AVX2 with FMA, else plain C++), so one
// binary measures each machine it runs on.
#pragma once

#include <cstdint>
#include <string>

namespace mha_bench {

struct Ceilings {
  double fma_gflops = 0;   // fp32 multiply-adds, 2 flops each
  double bf16_gflops = 0;  // vdpbf16ps, 4 flops per 32-bit lane; 0 where the CPU lacks it
  double int8_gops = 0;    // vpdpbusd, 8 operations (4 multiply-adds) per 32-bit lane; 0 likewise
  double read_gbs = 0;     // reading an array far larger than the last-level cache
  std::string fma_isa;     // the instructions the FMA peak ran: "avx512", "avx2" or "scalar"
};

// Each measurement takes about `seconds` (0.1 to 1 is enough: the loops reach their rate at once).
double fma_peak_gflops(double seconds, std::string* isa = nullptr);
double bf16_peak_gflops(double seconds);
double int8_peak_gops(double seconds);
double memory_read_gbs(double seconds);

// The XOR of the 32-bit words of `bytes` bytes at `data` (a multiple of 4), read once on all of
// OpenMP's threads, a contiguous share each, with 512-bit loads where the CPU has them:
// memory_read_gbs's loop, and mha_bench's plain read of a KV cache. Written with intrinsics: at
// -O2 GCC 12 left the plain loop scalar, and the ceiling read 15.6 GB/s where -O3's read 52.2.
std::uint32_t xor_fold(const void* data, std::int64_t bytes);

// All four, measured once (the first call) and kept; the benchmarks' fraction counters divide by
// these. The ceiling benchmarks raise them to the best they measure.
Ceilings& ceilings();

}  // namespace mha_bench
