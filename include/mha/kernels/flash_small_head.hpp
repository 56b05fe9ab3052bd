// The flash kernel for small heads (float, D = Dv in {4, 8, 12, 16}, at least 16 queries;
// attention_flash decides): the same online softmax as
// attention_flash, with its products computed in registers instead of by Eigen's GEMM.
//
// Why: with many heads (E = 512, H = 64 gives D = 8) the score product q kᵀ of a [64, 256] tile is
// only D multiply-adds deep, so the GEMM's packing, its store of the tile and the softmax's
// passes over it (max, exp, sum, and the read by the P·V product) cost more than the arithmetic.
// Here a key block is transposed once into k_t [D, Bk] and v_t [D, Bk], and each packet of
// `lanes` keys (16 floats with AVX-512) is handled whole while it is in registers:
//   scores: s = mask + Σ_d q[i, d] · k_t[d, j..j+lanes)           (q pre-scaled)
//   softmax and P·V: p = exp(s - m);  sum += p;  acc[d] += p · v_t[d, j..j+lanes)
// where sum and each acc[d] are packets of partial sums, one per lane, reduced once per row at the
// end. The acc[d] of one row (D packets) stay in registers across its whole key block.
// Tasks are (batch, head, 256-query block), so that a transposed key block serves 256 queries;
// the scores of 32 queries at a time fill a [32, Bk] tile in L1.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>

#include "mha/compiled.hpp"
#include "mha/kernels/common.hpp"

namespace mha::detail {

// Head sizes with a small-head kernel; others take attention_flash's GEMM tiles.
inline bool small_head_kernel_exists(Index head_dim) {
  return head_dim == 4 || head_dim == 8 || head_dim == 12 || head_dim == 16;
}

// exp(x - shift) for a packet of scores x ≤ shift (a row's maximum), in 13 operations where
// Eigen's pexp takes 18 for the whole float range: with t = (x - shift) · log2(e) = n + f
// (the difference first, so that large scores lose no precision) and |f| ≤ 1/2, it is
// 2^n · p(f), p the degree-6 Taylor polynomial of 2^f (truncation error at most 1.2e-7, 1.7e-7
// relative, at |f| = 1/2), and 2^n written into the exponent bits. t is clamped at -127, where
// 2^n's bits are all zero: a masked score (-inf) gives exactly 0, as does anything below float's
// normal range; a NaN passes the clamp and stays NaN.
template <class Packet>
Packet exp_shifted(const Packet& x, const Packet& shift) {
  using Eigen::internal::padd;
  using Eigen::internal::pmadd;
  using Eigen::internal::pset1;
// Naming Eigen's packet (an x86 vector type, whose alignment attributes a template argument
// drops) in a class template makes GCC warn; Eigen's own code does the same in system headers.
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wignored-attributes"
#endif
  using PacketI = typename Eigen::internal::unpacket_traits<Packet>::integer_packet;
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif
  // Eigen's pmax(a, b) returns a when either is NaN, as std::max does (and the x86 instructions
  // do for their second operand); its PropagateNaN variant would cost four more operations.
  const Packet t = Eigen::internal::pmax(
      Eigen::internal::pmul(Eigen::internal::psub(x, shift), pset1<Packet>(1.44269504088896341f)),
      pset1<Packet>(-127.0f));
  const Packet n = Eigen::internal::print(t);
  const Packet f = Eigen::internal::psub(t, n);
  // 2^f = e^(f ln 2) = Σ (f ln 2)^k / k!, k ≤ 6, by Horner
  Packet p = pset1<Packet>(1.5403530393381606e-4f);
  p = pmadd(p, f, pset1<Packet>(1.3333558146428443e-3f));
  p = pmadd(p, f, pset1<Packet>(9.6181291076284772e-3f));
  p = pmadd(p, f, pset1<Packet>(5.5504108664821580e-2f));
  p = pmadd(p, f, pset1<Packet>(2.4022650695910071e-1f));
  p = pmadd(p, f, pset1<Packet>(6.9314718055994531e-1f));
  p = pmadd(p, f, pset1<Packet>(1.0f));
  const PacketI biased = Eigen::internal::pcast<Packet, PacketI>(padd(n, pset1<Packet>(127.0f)));
  return Eigen::internal::pmul(
      p, Eigen::internal::preinterpret<Packet>(Eigen::internal::plogical_shift_left<23>(biased)));
}

// Fewer queries than this share too little of a transposed key block: in mha_bench's
// small_heads/ (H = 64, D = 8, S = 4096, 2 threads) the small-head kernel took 0.83x the GEMM
// tiles' time at 16 queries and 0.58x at 256, but 1.31x at one query (a decoding step) and 0.94x
// to 1.19x at 2 to 8 (bench/RESULTS.md).
constexpr Index kSmallHeadMinQueries = 16;

struct SmallHeadBlocks {
  static constexpr Index query = 256;      // queries per task, sharing each transposed key block
  static constexpr Index score_rows = 32;  // queries whose scores are in the tile at once
  static constexpr Index key = 256;
};

// q is (B, H, L, D), k is (B, H, S', D), v is (B, H, S', D), out is (B, H, L, D), as head
// layouts; options, logsumexp and the result are attention_flash's, except that softcap and
// dropout are not supported (attention_flash does not call this with them).
template <int D, class T>
void attention_flash_small_head(Index batch, Index heads, const HeadLayout<const T>& q,
                                const HeadLayout<const T>& k, const HeadLayout<const T>& v,
                                const HeadLayout<T>& out, const CoreOptions<T>& options,
                                std::vector<KernelScratch<T>>& scratch, T* logsumexp) {
  using Packet = typename Eigen::internal::packet_traits<T>::type;
  using Eigen::internal::padd;
  using Eigen::internal::ploadu;
  using Eigen::internal::pmadd;
  using Eigen::internal::pmul;
  using Eigen::internal::pset1;
  using Eigen::internal::pstoreu;
  constexpr Index lanes = Eigen::internal::packet_traits<T>::size;
  constexpr Index kBq = SmallHeadBlocks::query, kRows = SmallHeadBlocks::score_rows;
  constexpr Index kBk = SmallHeadBlocks::key;
  static_assert(kBk % lanes == 0, "a key block is a whole number of packets");
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();
  const Index query_len = q.rows, key_len = k.rows;
  const Index masked_keys = options.causal_cols;
  const bool any_mask = options.any_mask();
  const Index query_blocks = (query_len + kBq - 1) / kBq;
  const Index tasks = batch * heads * query_blocks;
  [[maybe_unused]] const double work = static_cast<double>(batch * heads) *
                                       static_cast<double>(query_len) *
                                       static_cast<double>(key_len) * static_cast<double>(2 * D);

  scratch_for_threads(scratch);
  MHA_OMP_PRAGMA(omp parallel if (worth_threads(tasks, work))) {
    KernelScratch<T>& mine = scratch[static_cast<std::size_t>(thread_index())];
    mine.scores.setZero(kRows, kBk);  // whole packets are read past a block's last key
    mine.key_tile.resize(D, kBk);     // k_t
    mine.value_tile.resize(D, kBk);   // v_t
    mine.queries.resize(kBq, D);      // scale · q
    mine.acc.resize(kBq, D * lanes);
    mine.row_sum.resize(kBq * lanes);
    mine.row_max.resize(kBq);

    MHA_OMP_PRAGMA(omp for schedule(dynamic))
    for (Index task = 0; task < tasks; ++task) {
      const Index b = task / (heads * query_blocks);
      const Index h = (task / query_blocks) % heads;
      const Index i0 = (task % query_blocks) * kBq;
      const Index rows = std::min(kBq, query_len - i0);
      const auto k_bh = k.at(b, h);
      const auto v_bh = v.at(b, h);
      auto out_bh = out.at(b, h);
      mine.queries.topRows(rows).noalias() = options.scale * q.at(b, h).middleRows(i0, rows);
      mine.acc.topRows(rows).setZero();
      mine.row_sum.head(rows * lanes).setZero();
      mine.row_max.head(rows).setConstant(kNegInf);

      const auto process = [&](Index j0, Index cols) {
        // Transpose the block, zero-padded to whole packets (padded keys get -inf scores below).
        const Index padded = (cols + lanes - 1) / lanes * lanes;
        // (A plain loop: Eigen's transpose assignment made E = 512, L = 2048, H = 64 18 % slower.)
        for (Index j = 0; j < padded; ++j) {
          for (Index d = 0; d < D; ++d) {
            mine.key_tile(d, j) = j < cols ? k_bh(j0 + j, d) : T(0);
            mine.value_tile(d, j) = j < cols ? v_bh(j0 + j, d) : T(0);
          }
        }
        const bool masked_tile = any_mask && j0 < masked_keys;
        for (Index r0 = 0; r0 < rows; r0 += kRows) {
          const Index tile_rows = std::min(kRows, rows - r0);
          if (masked_tile &&
              !options.may_see(h, query_len, i0 + r0, i0 + r0 + tile_rows - 1, j0, j0 + cols)) {
            continue;  // causal masking, the window or the pattern hides the block from them
          }
          auto tile = mine.scores.topLeftCorner(tile_rows, cols);
          if (masked_tile) {
            options.masks(b, h, query_len, i0 + r0, j0, tile);
            if ((tile.array() == kNegInf).all()) continue;
          }

          // Scores: one packet of keys in registers against every query of the tile.
          for (Index c = 0; c < padded; c += lanes) {
            Packet key_packets[D];
            for (Index d = 0; d < D; ++d) key_packets[d] = ploadu<Packet>(&mine.key_tile(d, c));
            for (Index r = 0; r < tile_rows; ++r) {
              const T* query = &mine.queries(r0 + r, 0);
              T* score = mine.scores.data() + r * kBk + c;
              Packet s = masked_tile ? ploadu<Packet>(score) : Eigen::internal::pzero(Packet{});
              for (Index d = 0; d < D; ++d) s = pmadd(pset1<Packet>(query[d]), key_packets[d], s);
              pstoreu(score, s);
            }
          }
          for (Index r = 0; r < tile_rows; ++r) {
            std::fill(mine.scores.data() + r * kBk + cols, mine.scores.data() + r * kBk + padded,
                      kNegInf);
          }

          // Online softmax and P·V, a row at a time, its accumulators in registers.
          for (Index r = 0; r < tile_rows; ++r) {
            const Index row = r0 + r;
            const T* score = mine.scores.data() + r * kBk;
            Packet max_packet = pset1<Packet>(kNegInf);
            for (Index c = 0; c < padded; c += lanes) {
              max_packet = Eigen::internal::pmax(max_packet, ploadu<Packet>(score + c));
            }
            const T block_max = Eigen::internal::predux_max(max_packet);
            T* sum_lanes = &mine.row_sum(row * lanes);
            T* acc_lanes = &mine.acc(row, 0);
            if (block_max == kNegInf) {
              // As in attention_flash: the maximum may have skipped a NaN, which must reach the
              // output; otherwise nothing in this block is visible to the row.
              if (tile.row(r).hasNaN()) {
                sum_lanes[0] = std::numeric_limits<T>::quiet_NaN();
              }
              continue;
            }
            Packet sum = ploadu<Packet>(sum_lanes);
            Packet acc[D];
            for (Index d = 0; d < D; ++d) acc[d] = ploadu<Packet>(acc_lanes + d * lanes);
            T& running_max = mine.row_max(row);
            if (block_max > running_max) {
              const T correction =
                  running_max == kNegInf ? T(0) : std::exp(running_max - block_max);
              const Packet factor = pset1<Packet>(correction);
              sum = pmul(sum, factor);
              for (Index d = 0; d < D; ++d) acc[d] = pmul(acc[d], factor);
              running_max = block_max;
            }
            // Masked scores and the padding are -inf: their p is exactly 0.
            const Packet shift = pset1<Packet>(running_max);
            for (Index c = 0; c < padded; c += lanes) {
              const Packet p = exp_shifted(ploadu<Packet>(score + c), shift);
              sum = padd(sum, p);
              for (Index d = 0; d < D; ++d) {
                acc[d] = pmadd(p, ploadu<Packet>(&mine.value_tile(d, c)), acc[d]);
              }
            }
            pstoreu(sum_lanes, sum);
            for (Index d = 0; d < D; ++d) pstoreu(acc_lanes + d * lanes, acc[d]);
          }
        }
      };
      for_each_key_block(options, h, key_len, query_len, i0, i0 + rows - 1, kBk, process);

      // One division per row at the end, as attention_flash: no visible key gives 0, a NaN sum
      // gives NaN.
      for (Index r = 0; r < rows; ++r) {
        const T sum = Eigen::internal::predux(ploadu<Packet>(&mine.row_sum(r * lanes)));
        auto out_row = out_bh.row(i0 + r);
        for (Index d = 0; d < D; ++d) {
          out_row(d) = sum != T(0)
                           ? Eigen::internal::predux(ploadu<Packet>(&mine.acc(r, d * lanes))) / sum
                           : T(0);
        }
        if (logsumexp != nullptr) {
          logsumexp[(b * heads + h) * query_len + i0 + r] =
              sum != T(0) ? mine.row_max(r) + std::log(sum) : kNegInf;
        }
      }
    }
  }
}

// The instantiations mha::compiled holds (src/kernels_flash_small_head.cpp; see mha/compiled.hpp):
// float, at every D small_head_kernel_exists accepts.
// NOLINTBEGIN(bugprone-macro-parentheses): the arguments are a type and a keyword
#define MHA_SMALL_HEAD_KERNEL_TEMPLATES(PREFIX, D)                                         \
  PREFIX template void attention_flash_small_head<D, float>(                               \
      Index, Index, const HeadLayout<const float>&, const HeadLayout<const float>&,        \
      const HeadLayout<const float>&, const HeadLayout<float>&, const CoreOptions<float>&, \
      std::vector<KernelScratch<float>>&, float*);
// NOLINTEND(bugprone-macro-parentheses)
#define MHA_SMALL_HEAD_DIMS(X, PREFIX) \
  MHA_IF_FLOAT_KERNELS(X(PREFIX, 4) X(PREFIX, 8) X(PREFIX, 12) X(PREFIX, 16))
MHA_EXTERN_TEMPLATES(MHA_SMALL_HEAD_DIMS, MHA_SMALL_HEAD_KERNEL_TEMPLATES)

}  // namespace mha::detail
