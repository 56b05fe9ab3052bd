// The library's products (kernels/tile_product.hpp, kernels/packed_gemm.hpp, kernels/gemm.hpp):
// every operand orientation, alpha and accumulation, at shapes that cut the packed GEMM's
// micro-tiles, row blocks and depth slices anywhere, against the same product in double; and
// the same element computed bit for bit alike wherever a product is cut into slabs.
#include <vector>

#include "helpers.hpp"

using mha::Index;
using mha::Tensor;
using mha::detail::Accumulate;
using mha::detail::Operand;

namespace {

// Float values on a grid of 1/64 in [-2, 2]: a product of two is a multiple of 2^-12 below 4 in
// magnitude, and a sum of up to 600 of them (times 1 or 3/8, plus another grid value) needs at
// most 24 bits for these seeds' sums: so every float product here is exact, in any order of
// summation, and must equal the double one bit for bit.
Tensor<float> grid_matrix(Index rows, Index cols, std::uint64_t seed) {
  mha::Random random(seed);
  Tensor<float> m({rows, cols});
  for (Index i = 0; i < m.size(); ++i) {
    m.data()[i] = static_cast<float>(std::round(random.uniform(-2, 2) * 64) / 64);
  }
  return m;
}

// op(m) in double: m as stored, or transposed.
mha::Matrix<double> op(const Tensor<float>& m, Operand o) {
  const mha::Matrix<double> widened = m.matrix().cast<double>();
  return o == Operand::transposed ? mha::Matrix<double>(widened.transpose()) : widened;
}

Tensor<double> as_tensor(const mha::Matrix<double>& m) {
  Tensor<double> t({m.rows(), m.cols()});
  t.matrix() = m;
  return t;
}

}  // namespace

TEST_CASE("tile_product equals the product in double for every orientation and shape", "[gemm]") {
  mha::Random random(31);
  const auto pick = [&](Index low, Index high) {
    return low + static_cast<Index>(random.uniform() * static_cast<double>(high - low + 1));
  };
  // Depths past one slice (256) and two, rows past one packed block (72), columns past a few
  // micro-tiles (16) and past the eight panels pack_rhs copies at once, with remainders of every
  // size.
  for (std::uint64_t trial = 0; trial < 120; ++trial) {
    const Index M = pick(1, 160), N = trial % 4 == 1 ? pick(129, 300) : pick(1, 70),
                K = trial % 3 == 0 ? pick(257, 600) : pick(1, 80);
    const Operand lhs_op = random.uniform() < 0.5 ? Operand::as_stored : Operand::transposed;
    const Operand rhs_op = random.uniform() < 0.5 ? Operand::as_stored : Operand::transposed;
    const bool accumulate = random.uniform() < 0.5;
    const float alpha = random.uniform() < 0.5 ? 1.0F : 0.375F;
    const auto lhs = lhs_op == Operand::transposed ? grid_matrix(K, M, 10 + trial)
                                                   : grid_matrix(M, K, 10 + trial);
    const auto rhs = rhs_op == Operand::transposed ? grid_matrix(N, K, 20 + trial)
                                                   : grid_matrix(K, N, 20 + trial);
    auto dst = grid_matrix(M, N, 30 + trial);
    mha::Matrix<double> expected = double(alpha) * op(lhs, lhs_op) * op(rhs, rhs_op);
    if (accumulate) expected += dst.matrix().cast<double>();
    mha::detail::tile_product<float>(mha::detail::strided(dst.matrix()),
                                     mha::detail::const_strided(lhs.matrix()), lhs_op,
                                     mha::detail::const_strided(rhs.matrix()), rhs_op,
                                     accumulate ? Accumulate::yes : Accumulate::no, alpha);
    INFO("trial " << trial << ": M " << M << " N " << N << " K " << K << " lhs "
                  << (lhs_op == Operand::transposed ? "transposed" : "as stored") << " rhs "
                  << (rhs_op == Operand::transposed ? "transposed" : "as stored")
                  << (accumulate ? " accumulate" : "") << " alpha " << alpha);
    CHECK_TENSORS_CLOSE_TOL(dst, as_tensor(expected), 0.0, 0.0);
  }
}

TEST_CASE("a product's elements do not depend on how it is cut into slabs", "[gemm][threads]") {
  // The layer's threaded products cut dst into slabs of rows or columns (gemm.hpp), by a rule on
  // the shape; the packed GEMM must give each element the same arithmetic wherever the cut is.
  // (Eigen's GEMM, which tile_product runs where the packed one is unavailable, blocks by the
  // shape it is given: there the cut is by the shape alone, so the thread count still changes
  // nothing, but pieces need not equal the whole.)
  if (!mha::detail::packed_gemm_available()) return;
  mha::Random random(5);
  const Index M = 150, N = 90, K = 700;
  const auto lhs = mha_test::random_tensor<float>({M, K}, 1);
  const auto rhs = mha_test::random_tensor<float>({N, K}, 2);
  Tensor<float> whole({M, N});
  mha::detail::tile_product<float>(mha::detail::strided(whole.matrix()),
                                   mha::detail::const_strided(lhs.matrix()), Operand::as_stored,
                                   mha::detail::const_strided(rhs.matrix()), Operand::transposed,
                                   Accumulate::no);
  for (int trial = 0; trial < 20; ++trial) {
    // (At least two rows or columns a piece: one row is a matrix-vector product, see tile_product.)
    const Index cut = 2 + static_cast<Index>(random.uniform() * static_cast<double>(M - 4));
    const bool by_rows = trial % 2 == 0;
    Tensor<float> pieces({M, N});
    auto dst = pieces.matrix();
    const auto a = lhs.matrix();
    const auto b = rhs.matrix();
    const Index extent = by_rows ? M : N, at = std::min(cut, extent - 2);
    for (const auto& [start, count] : {std::pair<Index, Index>{0, at}, {at, extent - at}}) {
      if (by_rows) {
        mha::detail::tile_product<float>(mha::detail::strided(dst.middleRows(start, count)),
                                         mha::detail::const_strided(a.middleRows(start, count)),
                                         Operand::as_stored, mha::detail::const_strided(b),
                                         Operand::transposed, Accumulate::no);
      } else {
        mha::detail::tile_product<float>(mha::detail::strided(dst.middleCols(start, count)),
                                         mha::detail::const_strided(a), Operand::as_stored,
                                         mha::detail::const_strided(b.middleRows(start, count)),
                                         Operand::transposed, Accumulate::no);
      }
    }
    INFO((by_rows ? "rows" : "columns") << " cut at " << at);
    CHECK(pieces.flat() == whole.flat());
  }
}

TEST_CASE("the layer's threaded products equal the product in double", "[gemm]") {
  // kernels/gemm.hpp: slabs of dst's columns, each a tile_product; of its rows (700 >= N), on
  // the packed GEMM with op(rhs) packed once for all; and dot products for a few rows (blocks of
  // 4 weight rows × 2 input rows: N = 523 and odd row counts leave partial blocks).
  for (const Index rows : {1, 5, 16, 17, 300, 700}) {
    const Index E = 300, N = rows <= 16 ? 523 : 520;
    const auto x = grid_matrix(rows, E, 1);
    const auto w = grid_matrix(N, E, 2);
    Tensor<float> dst({rows, N});
    std::vector<mha::detail::KernelScratch<float>> scratch;
    const Eigen::Map<const mha::Matrix<float>> weight(w.data(), N, E);
    mha::detail::product_transposed<float, float>(mha::detail::strided(dst.matrix()),
                                                  mha::detail::const_strided(x.matrix()), weight,
                                                  Accumulate::no, scratch);
    INFO("rows " << rows);
    CHECK_TENSORS_CLOSE_TOL(dst, as_tensor(op(x, Operand::as_stored) * op(w, Operand::transposed)),
                            0.0, 0.0);
  }
}

TEST_CASE("slabs of rows sharing a packed rhs equal one tile_product bit for bit",
          "[gemm][threads]") {
  // threaded_product cuts dst [700, 300] into 8 slabs of rows; with the packed GEMM they share
  // op(rhs), packed once, which must change no element's arithmetic. matrix_product takes rhs as
  // stored (either lhs), product_transposed a transposed one (x Wᵀ). Without the packed GEMM the
  // slabs are Eigen's products, whose blocking follows their shape (see the test above).
  if (!mha::detail::packed_gemm_available()) return;
  const Index M = 700, N = 300, K = 600;
  const auto whole_product = [&](const Tensor<float>& lhs, Operand lhs_op, const Tensor<float>& rhs,
                                 Operand rhs_op) {
    Tensor<float> whole({M, N}, 1.0F);
    mha::detail::tile_product<float>(
        mha::detail::strided(whole.matrix()), mha::detail::const_strided(lhs.matrix()), lhs_op,
        mha::detail::const_strided(rhs.matrix()), rhs_op, Accumulate::yes);
    return whole;
  };
  const auto rhs = mha_test::random_tensor<float>({K, N}, 2);
  for (const Operand lhs_op : {Operand::as_stored, Operand::transposed}) {
    const auto lhs = lhs_op == Operand::transposed ? mha_test::random_tensor<float>({K, M}, 1)
                                                   : mha_test::random_tensor<float>({M, K}, 1);
    Tensor<float> threaded({M, N}, 1.0F);
    mha::detail::matrix_product<float>(mha::detail::strided(threaded.matrix()),
                                       mha::detail::const_strided(lhs.matrix()), lhs_op,
                                       mha::detail::const_strided(rhs.matrix()), Accumulate::yes);
    INFO("lhs " << (lhs_op == Operand::transposed ? "transposed" : "as stored"));
    CHECK(threaded.flat() == whole_product(lhs, lhs_op, rhs, Operand::as_stored).flat());
  }
  const auto x = mha_test::random_tensor<float>({M, K}, 3);
  const auto w = mha_test::random_tensor<float>({N, K}, 4);
  Tensor<float> projected({M, N}, 1.0F);
  std::vector<mha::detail::KernelScratch<float>> scratch;
  mha::detail::product_transposed<float, float>(
      mha::detail::strided(projected.matrix()), mha::detail::const_strided(x.matrix()),
      Eigen::Map<const mha::Matrix<float>>(w.data(), N, K), Accumulate::yes, scratch);
  CHECK(projected.flat() == whole_product(x, Operand::as_stored, w, Operand::transposed).flat());
}

TEST_CASE("slabs of columns computed as their transpose equal one tile_product bit for bit",
          "[gemm][threads]") {
  // product_transposed of a few tokens (x Wᵀ, at most a quarter as many rows as the depth) cuts
  // dst into slabs of columns and, on the packed GEMM, computes each as a slab of W xᵀ with xᵀ
  // packed once (gemm.hpp's packed_column_slabs), then transposes it into dst: the same
  // products, in the same order, as one tile_product of the whole. Token counts not a multiple of
  // the 8 x 8 transposes, depths over two slices and not a multiple of them (W read in place) and
  // of 1024 (rows 4 KiB apart: W packed, slabs of rows past one packed block of 72), columns
  // cutting the last slab short; accumulated onto dst and not.
  if (!mha::detail::packed_gemm_available()) return;
  for (const Index M : {17, 45, 131}) {
    for (const Index K : {600, 1024}) {
      REQUIRE(mha::detail::few_tokens_for_depth(M, K));
      const Index N = 700;
      const auto x = mha_test::random_tensor<float>({M, K}, 5);
      const auto w = mha_test::random_tensor<float>({N, K}, 6);
      for (const Accumulate accumulate : {Accumulate::no, Accumulate::yes}) {
        Tensor<float> whole({M, N}, 0.5F), projected({M, N}, 0.5F);
        mha::detail::tile_product<float>(mha::detail::strided(whole.matrix()),
                                         mha::detail::const_strided(x.matrix()), Operand::as_stored,
                                         mha::detail::const_strided(w.matrix()),
                                         Operand::transposed, accumulate);
        std::vector<mha::detail::KernelScratch<float>> scratch;
        mha::detail::product_transposed<float, float>(
            mha::detail::strided(projected.matrix()), mha::detail::const_strided(x.matrix()),
            Eigen::Map<const mha::Matrix<float>>(w.data(), N, K), accumulate, scratch);
        INFO("M " << M << ", K " << K << (accumulate == Accumulate::yes ? ", accumulated" : ""));
        CHECK(projected.flat() == whole.flat());
      }
    }
  }
}

#ifdef MHA_PACKED_GEMM_X86
TEST_CASE("the AVX-512 and AVX2 micro-kernels give every element the same arithmetic", "[gemm]") {
  // packed_gemm.hpp chooses the kernel by the CPU and the tile by the rows left: a product must
  // not change with either. Random (not grid) values, so that a different order of summation
  // shows in the last bits.
  if (!mha::detail::cpu_has_avx512f() || !mha::detail::cpu_has_avx2_fma()) {
    WARN("this CPU lacks AVX-512 or AVX2: nothing to compare");
    return;
  }
  constexpr Index kMr = mha::detail::PackedGemmShape::kMr, kNr = mha::detail::PackedGemmShape::kNr;
  constexpr Index kRows = 2 * kMr;  // two panels of A: the 12 x 32 tile's
  for (const Index depth : {1, 7, 64, 300}) {
    for (const bool first : {true, false}) {
      // A as a row-major block (rows depth + 13 floats apart, k_step 1) and packed; B as a
      // row-major block of 2·kNr columns (row stride 2·kNr + 5) and as two packed panels.
      const Index lda = depth + 13, ldb = 2 * kNr + 5;
      const auto seed = static_cast<std::uint64_t>(3 * depth);
      const auto a = mha_test::random_tensor<float>({kRows, lda}, seed);
      const auto b = mha_test::random_tensor<float>({depth, ldb}, seed + 1);
      const auto old = mha_test::random_tensor<float>({kRows, 2 * kNr}, seed + 2);
      const float alpha = first ? 1.0F : 0.7F;
      std::vector<float> packed_a(static_cast<std::size_t>(kRows * depth));
      std::vector<float> packed_b(static_cast<std::size_t>(2 * kNr * depth));
      mha::detail::pack_lhs(mha::detail::PackedOperand{a.data(), lda, 1}, 0, kRows, 0, depth,
                            packed_a.data());
      mha::detail::pack_rhs(mha::detail::PackedOperand{b.data(), ldb, 1}, 0, depth, 0, 2 * kNr,
                            packed_b.data());
      Tensor<float> narrow = old, two_panels = old, two_packed = old, one_panel = old;
      Tensor<float> tall = old, tall_packed = old;
      for (Index q = 0; q < 2; ++q) {
        const Index row = q * kMr;
        for (Index p = 0; p < 2; ++p) {
          mha::detail::micro_kernel_avx2(depth, a.data() + row * lda, lda, 1, b.data() + p * kNr,
                                         ldb, alpha, first, &narrow(row, p * kNr), 2 * kNr);
          mha::detail::micro_kernel_avx512<1>(depth, packed_a.data() + row * depth, 1, kMr,
                                              packed_b.data() + p * kNr * depth, 0, kNr, alpha,
                                              first, &one_panel(row, p * kNr), 2 * kNr);
        }
        mha::detail::micro_kernel_avx512<2>(depth, a.data() + row * lda, lda, 1, b.data(), kNr, ldb,
                                            alpha, first, &two_panels(row, 0), 2 * kNr);
        mha::detail::micro_kernel_avx512<2>(depth, packed_a.data() + row * depth, 1, kMr,
                                            packed_b.data(), kNr * depth, kNr, alpha, first,
                                            &two_packed(row, 0), 2 * kNr);
      }
      mha::detail::micro_tile_avx512<2, 2>(depth, a.data(), lda, 1, kMr * lda, b.data(), kNr, ldb,
                                           alpha, first, tall.data(), 2 * kNr);
      mha::detail::micro_tile_avx512<2, 2>(depth, packed_a.data(), 1, kMr, kMr * depth,
                                           packed_b.data(), kNr * depth, kNr, alpha, first,
                                           tall_packed.data(), 2 * kNr);
      INFO("depth " << depth << (first ? " first" : " accumulated"));
      CHECK(two_panels.flat() == narrow.flat());
      CHECK(two_packed.flat() == narrow.flat());
      CHECK(one_panel.flat() == narrow.flat());
      CHECK(tall.flat() == narrow.flat());
      CHECK(tall_packed.flat() == narrow.flat());
    }
  }
}
#endif
