// MHA_UNROLL, before a register block's loops of a fixed count (its rows, panels, keys): unrolled
// whole at every optimisation level, so that the block's sums and operands stay in registers.
// Without it GCC 12 at -O2 (CMake's RelWithDebInfo, a build type in which a header-only library's
// consumers compile it) keeps them as loops over arrays on the stack: the layer's forward ran at
// 0.29–0.30 of its -O3 speed (bench/RESULTS.md, 2026-12-04). The kernels and the benchmarks' peak
// loops (bench/ceilings.cpp) share it.
#pragma once

#if defined(__clang__)
#define MHA_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define MHA_UNROLL _Pragma("GCC unroll 16")
#else
#define MHA_UNROLL
#endif

// A loop of a run-time count unrolled by four: each step's counter, pointer bumps and branch are
// then paid once per four. (MHA_UNROLL4: a separate macro, as _Pragma takes one literal string.)
#if defined(__clang__)
#define MHA_UNROLL4 _Pragma("unroll 4")
#elif defined(__GNUC__)
#define MHA_UNROLL4 _Pragma("GCC unroll 4")
#else
#define MHA_UNROLL4
#endif
