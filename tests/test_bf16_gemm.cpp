// bf16 products with fp32 sums (kernels/bf16_gemm.hpp, bf16_projection.hpp): the rounding to bf16
// against Eigen's (to nearest, ties to even), the operands' layouts (rows of pairs, panels from
// a matrix's rows or columns) with odd depths and partial panels, vectorised and element by
// element, and the `vdpbf16ps` micro-kernel and the projection, where the CPU has it, against
// double: exactly on grid values (which bf16 holds and whose sums fp32 holds), and within the
// bound of a K-term fp32 sum on random values rounded to bf16.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "helpers.hpp"
#include "mha/kernels/bf16_gemm.hpp"
#include "mha/kernels/bf16_projection.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

using mha::Index;
using mha::detail::Bf16GemmShape;

namespace {

std::uint16_t eigen_bf16_bits(float x) {
  const Eigen::bfloat16 rounded(x);
  std::uint16_t bits = 0;
  std::memcpy(&bits, &rounded, sizeof bits);
  return bits;
}

#ifdef MHA_PACKED_GEMM_X86
// Values on a grid of 1/64 in [-2, 2]: at most 8 significant bits, so bf16 holds them exactly, a
// product of two is a multiple of 2^-12 below 4, and a sum of up to 512 of them fits fp32's 24
// bits: the micro-kernel must then equal double bit for bit.
std::vector<float> grid_values(Index count, std::uint64_t seed) {
  mha::Random random(seed);
  std::vector<float> values(static_cast<std::size_t>(count));
  for (float& x : values) x = static_cast<float>(std::round(random.uniform(-2, 2) * 64) / 64);
  return values;
}
#endif

std::vector<float> normal_values(Index count, std::uint64_t seed) {
  mha::Random random(seed);
  std::vector<float> values(static_cast<std::size_t>(count));
  for (float& x : values) x = static_cast<float>(random.normal());
  return values;
}

float rounded(float x) {
  return mha::detail::from_bf16_bits(mha::detail::to_bf16_bits(x));
}

}  // namespace

TEST_CASE("floats round to bf16 to nearest with ties to even, as Eigen's bfloat16", "[bf16_gemm]") {
  // Ties: 1 + 2^-8 lies halfway between 1 and 1 + 2^-7 (to the even 1), 1 + 3 · 2^-8 between
  // 1 + 2^-7 and 1 + 2^-6 (to the even 1 + 2^-6).
  CHECK(rounded(1.0F + std::ldexp(1.0F, -8)) == 1.0F);
  CHECK(rounded(1.0F + 3 * std::ldexp(1.0F, -8)) == 1.0F + std::ldexp(1.0F, -6));
  CHECK(rounded(-(1.0F + 3 * std::ldexp(1.0F, -8))) == -(1.0F + std::ldexp(1.0F, -6)));
  CHECK(std::isinf(rounded(std::numeric_limits<float>::max())));  // rounds past the largest bf16
  CHECK(std::isinf(rounded(std::numeric_limits<float>::infinity())));
  CHECK(std::isnan(rounded(std::numeric_limits<float>::quiet_NaN())));
  // A signalling NaN's payload in the low 16 bits alone must not become an infinity.
  std::uint32_t signalling = 0x7F800001U;
  float snan = 0;
  std::memcpy(&snan, &signalling, sizeof snan);
  CHECK(std::isnan(rounded(snan)));
  mha::Random random(3);
  int differ = 0;
  for (int i = 0; i < 20000; ++i) {
    // Magnitudes from denormals to near the largest float.
    const auto x = static_cast<float>(random.normal() * std::pow(2.0, random.uniform(-140, 120)));
    differ += mha::detail::to_bf16_bits(x) != eigen_bf16_bits(x);
  }
  CHECK(differ == 0);
}

TEST_CASE("bf16 operands hold each depth pair of a row or column, padded with zeros",
          "[bf16_gemm]") {
  // Rows of pairs (A), and panels of 16 (B) from M's rows (pack_bf16_transposed: keys, weights)
  // or from its columns (pack_bf16_columns: values), by the vectorised code where the CPU has
  // AVX512_BF16 and element by element elsewhere: each lane must hold the two bf16 of its pair,
  // to nearest with ties to even, and zeros past the last row, column and depth.
  constexpr Index kNr = Bf16GemmShape::kNr;
  for (const Index depth : {1, 2, 7, 16, 33, 70}) {
    for (const Index width : {1, 6, 16, 21, 40}) {
      INFO("depth " << depth << ", width " << width);
      // M [width, depth] with rows `stride` apart, and its transpose [depth, width] likewise.
      const Index stride = depth + 3, t_stride = width + 2;
      const auto values = normal_values(width * stride, 5 + static_cast<std::uint64_t>(depth));
      std::vector<float> transposed(static_cast<std::size_t>(depth * t_stride), 0.0F);
      for (Index j = 0; j < width; ++j) {
        for (Index k = 0; k < depth; ++k) {
          transposed[static_cast<std::size_t>(k * t_stride + j)] =
              values[static_cast<std::size_t>(j * stride + k)];
        }
      }
      const Index pairs = mha::detail::bf16_pairs(depth), panels = mha::detail::bf16_panels(width);
      const auto expected = [&](Index j, Index k) -> std::uint16_t {
        return k < depth && j < width
                   ? mha::detail::to_bf16_bits(values[static_cast<std::size_t>(j * stride + k)])
                   : 0;
      };
      const auto holds = [&](std::uint32_t lane, Index j, Index p) {
        return (lane & 0xFFFFU) == expected(j, 2 * p) && (lane >> 16) == expected(j, 2 * p + 1);
      };
      mha::detail::Bf16Lanes rows(static_cast<std::size_t>(width * (pairs + 1)), 0xDEADBEEFU);
      mha::detail::round_rows_bf16(values.data(), width, depth, stride, rows.data(), pairs + 1);
      std::vector<std::uint32_t> from_rows(static_cast<std::size_t>(panels * pairs * kNr),
                                           0xDEADBEEFU);
      std::vector<std::uint32_t> from_columns = from_rows;
      mha::detail::Bf16Lanes scratch;
      mha::detail::pack_bf16_transposed(values.data(), width, depth, stride, from_rows.data(),
                                        scratch);
      mha::detail::pack_bf16_columns(transposed.data(), depth, width, t_stride,
                                     from_columns.data());
      bool rows_right = true, untouched = true, transposed_right = true, columns_right = true;
      for (Index j = 0; j < width; ++j) {
        for (Index p = 0; p < pairs; ++p) {
          rows_right =
              rows_right && holds(rows[static_cast<std::size_t>(j * (pairs + 1) + p)], j, p);
        }
        untouched =
            untouched && rows[static_cast<std::size_t>(j * (pairs + 1) + pairs)] == 0xDEADBEEFU;
      }
      for (Index j = 0; j < panels * kNr; ++j) {
        for (Index p = 0; p < pairs; ++p) {
          const auto at = static_cast<std::size_t>((j / kNr) * pairs * kNr + p * kNr + j % kNr);
          transposed_right = transposed_right && holds(from_rows[at], j, p);
          columns_right = columns_right && holds(from_columns[at], j, p);
        }
      }
      CHECK(rows_right);
      CHECK(untouched);
      CHECK(transposed_right);
      CHECK(columns_right);
    }
  }
}

#ifdef MHA_PACKED_GEMM_X86
TEST_CASE("the bf16 micro-kernel equals double on values bf16 holds, and its rounding bound",
          "[bf16_gemm]") {
  if (!mha::detail::bf16_dot_available()) {
    WARN("this CPU lacks AVX512_BF16: the bf16 micro-kernel is not run");
    return;
  }
  constexpr Index kRows = Bf16GemmShape::kMr;
  for (const bool grid : {true, false}) {
    for (const Index depth : {1, 2, 7, 64, 257, 512}) {
      for (const int panels : {1, 2}) {
        INFO((grid ? "grid" : "normal")
             << " values, depth " << depth << ", " << panels << " panels of B");
        const Index cols = 16 * panels, ld = cols + 3;
        const auto seed = static_cast<std::uint64_t>(depth * 10 + panels);
        const auto a = grid ? grid_values(kRows * depth, seed) : normal_values(kRows * depth, seed);
        const auto b =
            grid ? grid_values(depth * cols, seed + 1) : normal_values(depth * cols, seed + 1);
        const Index pairs = mha::detail::bf16_pairs(depth);
        // A as rows of pairs a few lanes longer than the depth's, B as panels of its columns.
        const Index a_stride = pairs + 2;
        std::vector<std::uint32_t> rows_a(static_cast<std::size_t>(a_stride * kRows));
        std::vector<std::uint32_t> packed_b(static_cast<std::size_t>(panels * pairs * 16));
        mha::detail::round_rows_bf16(a.data(), kRows, depth, depth, rows_a.data(), a_stride);
        mha::detail::pack_bf16_columns(b.data(), depth, cols, cols, packed_b.data());
        // Twice: the first call writes the tile, the second adds to it, each scaled by 1/8
        // (exact on the grid). The column after the tile's must stay as it was.
        std::vector<float> tile(static_cast<std::size_t>(kRows * ld), -7.0F);
        for (const bool first : {true, false}) {
          if (panels == 2) {
            mha::detail::micro_tile_bf16<2>(pairs, rows_a.data(), a_stride, packed_b.data(),
                                            pairs * 16, 0.125F, first, tile.data(), ld);
          } else {
            mha::detail::micro_tile_bf16<1>(pairs, rows_a.data(), a_stride, packed_b.data(), 0,
                                            0.125F, first, tile.data(), ld);
          }
        }
        bool exact = true, bounded = true, untouched = true;
        double worst = 0;
        for (Index i = 0; i < kRows; ++i) {
          for (Index j = 0; j < ld; ++j) {
            const double actual = tile[static_cast<std::size_t>(i * ld + j)];
            if (j >= cols) {
              untouched = untouched && actual == -7.0;
              continue;
            }
            double sum = 0, magnitude = 0;
            for (Index k = 0; k < depth; ++k) {
              const double term =
                  static_cast<double>(rounded(a[static_cast<std::size_t>(i * depth + k)])) *
                  static_cast<double>(rounded(b[static_cast<std::size_t>(k * cols + j)]));
              sum += term;
              magnitude += std::abs(term);
            }
            // Two calls' sums of `depth` products in fp32, then their addition: within twice
            // γ(depth + 2) = n · 2^-24 / (1 - n · 2^-24) of the terms' magnitudes (a sum of n
            // terms in fp32 is within γ(n) of them).
            const double n = static_cast<double>(depth + 2), u = std::ldexp(1.0, -24);
            const double bound = 2 * (n * u / (1 - n * u)) * magnitude;
            const double expected = 2 * sum / 8;
            exact = exact && actual == expected;
            bounded = bounded && std::abs(actual - expected) <= bound / 8;
            worst = std::max(worst, std::abs(actual - expected) / std::max(bound / 8, 1e-30));
          }
        }
        if (grid) CHECK(exact);
        CHECK(bounded);
        CHECK(untouched);
        INFO("largest error, as a fraction of the bound: " << worst);
      }
    }
  }
}
#endif

#ifdef MHA_PACKED_GEMM_X86
TEST_CASE("the bf16 micro-kernel takes denormal inputs and results as zero", "[bf16_gemm]") {
  // What the header says of `vdpbf16ps`, whatever MXCSR holds: a bf16 denormal times 2^100 adds
  // nothing, and 2^-70 · 2^-70 = 2^-140, below fp32's normals, gives 0; a normal pair still
  // counts (2^-60 · 2^-60 = 2^-120).
  if (!mha::detail::bf16_dot_available()) {
    WARN("this CPU lacks AVX512_BF16: the bf16 micro-kernel is not run");
    return;
  }
  const auto lane = [](std::uint16_t low, std::uint16_t high) {
    return static_cast<std::uint32_t>(low) | (static_cast<std::uint32_t>(high) << 16);
  };
  constexpr std::uint16_t kDenormal = 0x0040, kTwoTo100 = 0x7180, kTwoToMinus70 = 0x1C80,
                          kTwoToMinus60 = 0x2180;
  CHECK(mha::detail::from_bf16_bits(kTwoTo100) == std::ldexp(1.0F, 100));
  CHECK(mha::detail::from_bf16_bits(kTwoToMinus70) == std::ldexp(1.0F, -70));
  CHECK(mha::detail::from_bf16_bits(kTwoToMinus60) == std::ldexp(1.0F, -60));
  CHECK(std::fpclassify(mha::detail::from_bf16_bits(kDenormal)) == FP_SUBNORMAL);
  const std::uint16_t a_values[3] = {kDenormal, kTwoToMinus70, kTwoToMinus60};
  const std::uint16_t b_values[3] = {kTwoTo100, kTwoToMinus70, kTwoToMinus60};
  const float expected[3] = {0.0F, 0.0F, std::ldexp(1.0F, -120)};
  for (int c = 0; c < 3; ++c) {
    INFO("case " << c);
    std::vector<std::uint32_t> a(Bf16GemmShape::kMr, lane(a_values[c], 0));
    std::vector<std::uint32_t> b(16, lane(b_values[c], 0));
    std::vector<float> tile(Bf16GemmShape::kMr * 16, -7.0F);
    mha::detail::micro_tile_bf16<1>(1, a.data(), 1, b.data(), 0, 1.0F, true, tile.data(), 16);
    CHECK(std::all_of(tile.begin(), tile.end(), [&](float x) { return x == expected[c]; }));
  }
}

TEST_CASE("a bf16 projection x Wᵀ equals double on the bf16 operands, on any number of threads",
          "[bf16_gemm]") {
  if (!mha::detail::bf16_dot_available()) {
    WARN("this CPU lacks AVX512_BF16: the bf16 projection is not run");
    return;
  }
  using Buffer = std::vector<std::uint32_t, Eigen::aligned_allocator<std::uint32_t>>;
  // Rows that end in partial panels of 6, outputs in partial tiles of 32 and 16 and over more
  // than one chunk, depths odd and over more than one slice of pairs; x and W with columns beyond
  // the product's, dst with columns beyond the outputs'.
  for (const bool grid : {true, false}) {
    for (const Index rows : {1, 7, 64}) {
      for (const Index outputs : {16, 45, 300}) {
        for (const Index depth : {7, 512, 1031}) {
          if (grid && depth > 512) continue;  // (grid sums stay exact up to 512 terms)
          INFO((grid ? "grid" : "normal")
               << " values: " << rows << " rows, " << outputs << " outputs, depth " << depth);
          const Index x_stride = depth + 3, w_stride = depth + 5, ld = outputs + 2;
          const auto seed = static_cast<std::uint64_t>(rows * 7 + outputs * 3 + depth);
          const auto x =
              grid ? grid_values(rows * x_stride, seed) : normal_values(rows * x_stride, seed);
          const auto w = grid ? grid_values(outputs * w_stride, seed + 1)
                              : normal_values(outputs * w_stride, seed + 1);
          mha::detail::Bf16PackedWeight packed;
          Buffer packed_x;
          mha::detail::pack_bf16_weight(w.data(), outputs, depth, w_stride, packed, packed_x);
          std::vector<float> dst(static_cast<std::size_t>(rows * ld), -7.0F);
          for (const bool accumulate : {false, true}) {
            mha::detail::bf16_projection(x.data(), rows, x_stride, packed, dst.data(), ld,
                                         accumulate, packed_x);
          }
          bool exact = true, bounded = true, untouched = true;
          for (Index i = 0; i < rows; ++i) {
            for (Index n = 0; n < ld; ++n) {
              const double actual = dst[static_cast<std::size_t>(i * ld + n)];
              if (n >= outputs) {
                untouched = untouched && actual == -7.0;
                continue;
              }
              double sum = 0, magnitude = 0;
              for (Index k = 0; k < depth; ++k) {
                const double term =
                    static_cast<double>(rounded(x[static_cast<std::size_t>(i * x_stride + k)])) *
                    static_cast<double>(rounded(w[static_cast<std::size_t>(n * w_stride + k)]));
                sum += term;
                magnitude += std::abs(term);
              }
              // Two calls' sums of `depth` products in fp32 (slice sums added in turn), then
              // their addition: within twice γ(depth + 2) of the terms' magnitudes.
              const double m = static_cast<double>(depth + 2), u = std::ldexp(1.0, -24);
              exact = exact && actual == 2 * sum;
              bounded =
                  bounded && std::abs(actual - 2 * sum) <= 2 * (m * u / (1 - m * u)) * magnitude;
            }
          }
          if (grid) CHECK(exact);
          CHECK(bounded);
          CHECK(untouched);
#ifdef _OPENMP
          // The same bits on one thread and on three.
          const int threads_before = omp_get_max_threads();
          std::vector<float> one(dst.size()), three(dst.size());
          omp_set_num_threads(1);
          mha::detail::bf16_projection(x.data(), rows, x_stride, packed, one.data(), ld, false,
                                       packed_x);
          omp_set_num_threads(3);
          mha::detail::bf16_projection(x.data(), rows, x_stride, packed, three.data(), ld, false,
                                       packed_x);
          omp_set_num_threads(threads_before);
          CHECK(one == three);
#endif
        }
      }
    }
  }
}
#endif
