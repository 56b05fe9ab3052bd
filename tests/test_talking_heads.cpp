// Talking-heads attention (kernels/talking_heads.hpp): the kernel against a naive loop
// implementation in double for every option, identity (and null) mixes against
// attention_reference, gradients of q, k, v, pre and post against central finite differences,
// and results that do not depend on the number of threads.
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "helpers.hpp"
#include "mha/kernels/reference.hpp"
#include "mha/kernels/talking_heads.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

using mha::Causal;
using mha::Index;
using mha::Mask;
using mha::Tensor;

namespace {

enum class MaskChoice { none, additive, boolean };

struct Config {
  std::string name;
  Index batch = 2, heads = 4, group = 1, query_len = 5, key_len = 7, head_dim = 3, value_dim = 4;
  bool pre = true, post = true;
  Causal causal = Causal::none;
  MaskChoice mask = MaskChoice::none;
  bool alibi = false;
  mha::Alignment alibi_alignment = mha::Alignment::top_left;
  double softcap = 0;
  double dropout = 0;
  std::uint64_t seed = 1;
  // The kernels must split L into several query blocks, the last one shorter than the others.
  bool several_blocks = false;
};

void require_blocks(const Config& c) {
  if (!c.several_blocks) return;
  const Index rows = mha::detail::talking_heads_block_rows(c.query_len);
  INFO("query blocks of " << rows << " rows");
  REQUIRE(rows < c.query_len);
  REQUIRE(c.query_len % rows != 0);
}

// One problem's inputs in T. The masks are owned here and the kernels' options point into them,
// so a Problem is built in place and never copied.
template <class T>
struct Problem {
  Config c;
  Tensor<T> q, k, v;         // (B, H, L, D), (B, H / group, S, D), (B, H / group, S, Dv)
  std::vector<T> pre, post;  // [H, H] row-major, or empty: no mixing
  Mask<T> mask;              // [B, H, L, S]: per (batch, head), so a wrong head index shows
  std::vector<T> slopes;
  T scale = T(0.6);

  explicit Problem(const Config& config) : c(config) {
    const Index B = c.batch, H = c.heads, L = c.query_len, S = c.key_len;
    const Index stored = H / c.group;
    q = mha_test::random_tensor<T>({B, H, L, c.head_dim}, c.seed);
    k = mha_test::random_tensor<T>({B, stored, S, c.head_dim}, c.seed + 1);
    v = mha_test::random_tensor<T>({B, stored, S, c.value_dim}, c.seed + 2);
    mha::Random random(c.seed + 3);
    const auto random_mix = [&] {
      std::vector<T> mix(static_cast<std::size_t>(H * H));
      for (auto& x : mix) x = static_cast<T>(0.6 * random.normal());
      return mix;
    };
    if (c.pre) pre = random_mix();
    if (c.post) post = random_mix();
    // Each mask has one fully masked row, (b, h, i) = (0, H - 1, L / 2), besides random blocks.
    const auto fully_masked = [&](Index b, Index h, Index i) {
      return b == 0 && h == H - 1 && i == L / 2;
    };
    if (c.mask == MaskChoice::additive) {
      Tensor<T> values({B, H, L, S});
      for (Index b = 0; b < B; ++b) {
        for (Index h = 0; h < H; ++h) {
          for (Index i = 0; i < L; ++i) {
            for (Index j = 0; j < S; ++j) {
              const bool blocked = fully_masked(b, h, i) || random.uniform() < 0.2;
              values(b, h, i, j) =
                  blocked ? -std::numeric_limits<T>::infinity() : static_cast<T>(random.normal());
            }
          }
        }
      }
      mask = Mask<T>::additive(std::move(values));
    } else if (c.mask == MaskChoice::boolean) {
      Tensor<bool> blocked({B, H, L, S});
      for (Index b = 0; b < B; ++b) {
        for (Index h = 0; h < H; ++h) {
          for (Index i = 0; i < L; ++i) {
            for (Index j = 0; j < S; ++j) {
              blocked(b, h, i, j) = fully_masked(b, h, i) || random.uniform() < 0.3;
            }
          }
        }
      }
      mask = Mask<T>::blocked_where_true(std::move(blocked));
    }
    if (c.alibi) slopes = mha::alibi_slopes<T>(H);
  }
  Problem(const Problem&) = delete;
  Problem& operator=(const Problem&) = delete;

  mha::detail::TalkingHeads<T> mix() const {
    return {pre.empty() ? nullptr : pre.data(), post.empty() ? nullptr : post.data()};
  }

  mha::detail::CoreOptions<T> core() const {
    mha::detail::CoreOptions<T> core;
    core.scale = scale;
    core.attn_mask = mha::detail::broadcast_mask_layout(mask, "attn_mask", c.batch, c.heads,
                                                        c.query_len, c.key_len, "");
    core.causal = c.causal;
    core.causal_cols = c.key_len;
    if (c.alibi) core.alibi_slopes = slopes.data();
    core.alibi_alignment = c.alibi_alignment;
    core.softcap = static_cast<T>(c.softcap);
    if (c.dropout > 0) core.dropout = {c.dropout, c.seed + 77, c.heads, c.query_len, c.key_len};
    return core;
  }

  template <class U>
  mha::detail::HeadLayout<U> layout(U* data, Index heads, Index rows, Index cols,
                                    Index group = 1) const {
    auto layout = mha::detail::contiguous_heads(data, heads, rows, cols);
    layout.group = group;
    return layout;
  }
  mha::detail::HeadLayout<const T> q_layout() const {
    return layout(q.data(), c.heads, c.query_len, c.head_dim);
  }
  mha::detail::HeadLayout<const T> k_layout() const {
    return layout(k.data(), c.heads / c.group, c.key_len, c.head_dim, c.group);
  }
  mha::detail::HeadLayout<const T> v_layout() const {
    return layout(v.data(), c.heads / c.group, c.key_len, c.value_dim, c.group);
  }
};

std::string describe(const Config& c) {
  std::ostringstream out;
  out << c.name << ": B " << c.batch << " H " << c.heads << " group " << c.group << " L "
      << c.query_len << " S " << c.key_len << " D " << c.head_dim << " Dv " << c.value_dim
      << " pre " << c.pre << " post " << c.post << " causal " << static_cast<int>(c.causal)
      << " mask " << static_cast<int>(c.mask) << " alibi " << c.alibi << " softcap " << c.softcap
      << " dropout " << c.dropout;
  return out.str();
}

template <class T>
struct Forward {
  Tensor<T> out, weights;  // (B, H, L, Dv), (B, H, L, S)
};

template <class T>
Forward<T> talking_heads(const Problem<T>& p, const mha::detail::TalkingHeads<T>& mix,
                         std::vector<mha::detail::KernelScratch<T>>& scratch) {
  const Config& c = p.c;
  // NaN first: every element must be written.
  const T nan = std::numeric_limits<T>::quiet_NaN();
  Forward<T> result{Tensor<T>({c.batch, c.heads, c.query_len, c.value_dim}, nan),
                    Tensor<T>({c.batch, c.heads, c.query_len, c.key_len}, nan)};
  mha::detail::attention_talking_heads<T>(
      c.batch, c.heads, p.q_layout(), p.k_layout(), p.v_layout(),
      p.layout(result.out.data(), c.heads, c.query_len, c.value_dim), p.core(), mix,
      result.weights.data(), scratch);
  return result;
}

template <class T>
struct Gradients {
  Tensor<T> q, k, v;
  std::vector<T> pre, post;
};

template <class T>
Gradients<T> talking_heads_backward(const Problem<T>& p, const mha::detail::TalkingHeads<T>& mix,
                                    const Tensor<T>& grad_out,
                                    std::vector<mha::detail::KernelScratch<T>>& scratch) {
  const Config& c = p.c;
  const T nan = std::numeric_limits<T>::quiet_NaN();
  const auto mix_size = static_cast<std::size_t>(c.heads * c.heads);
  Gradients<T> g{Tensor<T>(p.q.shape(), nan), Tensor<T>(p.k.shape(), nan),
                 Tensor<T>(p.v.shape(), nan), std::vector<T>(mix_size, nan),
                 std::vector<T>(mix_size, nan)};
  mha::detail::attention_talking_heads_backward<T>(
      c.batch, c.heads, p.q_layout(), p.k_layout(), p.v_layout(),
      p.layout(grad_out.data(), c.heads, c.query_len, c.value_dim),
      p.layout(g.q.data(), c.heads, c.query_len, c.head_dim),
      p.layout(g.k.data(), c.heads / c.group, c.key_len, c.head_dim, c.group),
      p.layout(g.v.data(), c.heads / c.group, c.key_len, c.value_dim, c.group), p.core(), mix,
      g.pre.data(), g.post.data(), scratch);
  return g;
}

// The naive implementation: plain loops in double over the definition (Shazeer et al. 2020,
// with this library's masks, causal masking, ALiBi, softcap and dropout), sharing nothing with
// the kernel but Dropout::keeps.
template <class T>
Forward<double> naive(const Problem<T>& p) {
  const Config& c = p.c;
  const Index B = c.batch, H = c.heads, L = c.query_len, S = c.key_len;
  const double inf = std::numeric_limits<double>::infinity();
  const auto mix_at = [&](const std::vector<T>& mix, Index g, Index h) {
    return mix.empty() ? (g == h ? 1.0 : 0.0)
                       : static_cast<double>(mix[static_cast<std::size_t>(g * H + h)]);
  };
  const auto mask_at = [&](Index b, Index g, Index i, Index j) {
    double m = 0;
    if (c.mask == MaskChoice::additive) m += static_cast<double>(p.mask.values()(b, g, i, j));
    if (c.mask == MaskChoice::boolean && p.mask.booleans()(b, g, i, j)) m = -inf;
    const Index shift = c.causal == Causal::bottom_right ? S - L : 0;
    if (c.causal != Causal::none && j > i + shift) m = -inf;
    if (c.alibi) {
      const Index centre = i + (c.alibi_alignment == mha::Alignment::bottom_right ? S - L : 0);
      m -= static_cast<double>(p.slopes[static_cast<std::size_t>(g)]) *
           std::abs(static_cast<double>(centre - j));
    }
    return m;
  };
  mha::detail::Dropout<double> dropout{c.dropout, c.seed + 77, H, L, S};
  Forward<double> result{Tensor<double>({B, H, L, c.value_dim}), Tensor<double>({B, H, L, S})};
  for (Index b = 0; b < B; ++b) {
    Tensor<double> logits({H, L, S}), probs({H, L, S}), mixed({H, L, S});
    for (Index h = 0; h < H; ++h) {
      for (Index i = 0; i < L; ++i) {
        for (Index j = 0; j < S; ++j) {
          double s = 0;
          for (Index d = 0; d < c.head_dim; ++d) {
            s += static_cast<double>(p.q(b, h, i, d)) *
                 static_cast<double>(p.k(b, h / c.group, j, d));
          }
          s *= static_cast<double>(p.scale);
          if (c.softcap > 0) s = c.softcap * std::tanh(s / c.softcap);
          logits(h, i, j) = s;
        }
      }
    }
    for (Index g = 0; g < H; ++g) {
      for (Index i = 0; i < L; ++i) {
        double row_max = -inf;
        for (Index j = 0; j < S; ++j) {
          double s = mask_at(b, g, i, j);
          for (Index h = 0; h < H; ++h) s += mix_at(p.pre, g, h) * logits(h, i, j);
          mixed(g, i, j) = s;
          row_max = std::max(row_max, s);
        }
        double sum = 0;
        for (Index j = 0; j < S; ++j) {
          probs(g, i, j) = row_max == -inf ? 0.0 : std::exp(mixed(g, i, j) - row_max);
          sum += probs(g, i, j);
        }
        for (Index j = 0; j < S; ++j) probs(g, i, j) = sum > 0 ? probs(g, i, j) / sum : 0.0;
      }
    }
    for (Index g = 0; g < H; ++g) {
      for (Index i = 0; i < L; ++i) {
        for (Index j = 0; j < S; ++j) {
          double w = 0;
          for (Index h = 0; h < H; ++h) w += mix_at(p.post, g, h) * probs(h, i, j);
          if (c.dropout > 0) w = dropout.keeps(b, g, i, j) ? w / (1 - c.dropout) : 0.0;
          result.weights(b, g, i, j) = w;
        }
        for (Index e = 0; e < c.value_dim; ++e) {
          double o = 0;
          for (Index j = 0; j < S; ++j) {
            o += result.weights(b, g, i, j) * static_cast<double>(p.v(b, g / c.group, j, e));
          }
          result.out(b, g, i, e) = o;
        }
      }
    }
  }
  return result;
}

// max |actual - expected| / max |expected|
template <class T>
double relative_to_max(const Tensor<T>& actual, const Tensor<double>& expected) {
  REQUIRE(actual.shape() == expected.shape());
  if (expected.size() == 0) return 0;
  const double scale = expected.flat().cwiseAbs().maxCoeff();
  const double difference =
      (actual.flat().template cast<double>() - expected.flat()).cwiseAbs().maxCoeff();
  return scale > 0 ? difference / scale : difference;
}

template <class T>
constexpr double kNaiveTolerance = std::is_same_v<T, float> ? 1e-5 : 1e-12;

std::vector<Config> naive_configs() {
  std::vector<Config> configs;
  const auto add = [&](const std::string& name, const std::function<void(Config&)>& edit) {
    Config c;
    c.name = name;
    c.seed = 10 * configs.size() + 1;
    edit(c);
    configs.push_back(c);
  };
  add("random pre and post", [](Config&) {});
  add("pre only", [](Config& c) { c.post = false; });
  add("post only", [](Config& c) { c.pre = false; });
  add("causal", [](Config& c) { c.causal = Causal::top_left; });
  add("causal bottom-right, L > S", [](Config& c) {
    c.causal = Causal::bottom_right;
    c.query_len = 8;
    c.key_len = 5;
  });
  add("additive mask with a fully masked row", [](Config& c) { c.mask = MaskChoice::additive; });
  add("boolean mask with a fully masked row", [](Config& c) { c.mask = MaskChoice::boolean; });
  add("ALiBi", [](Config& c) { c.alibi = true; });
  add("ALiBi bottom-right", [](Config& c) {
    c.alibi = true;
    c.alibi_alignment = mha::Alignment::bottom_right;
  });
  add("softcap", [](Config& c) { c.softcap = 1.5; });
  add("GQA", [](Config& c) { c.group = 2; });
  add("GQA, one stored head", [](Config& c) { c.group = 4; });
  add("dropout", [](Config& c) { c.dropout = 0.3; });
  add("L > S", [](Config& c) {
    c.query_len = 9;
    c.key_len = 3;
  });
  add("L < S", [](Config& c) {
    c.query_len = 2;
    c.key_len = 11;
  });
  add("one head", [](Config& c) { c.heads = 1; });
  add("no queries", [](Config& c) { c.query_len = 0; });
  add("no keys: zero output", [](Config& c) { c.key_len = 0; });
  add("no mixing", [](Config& c) { c.pre = c.post = false; });
  add("everything", [](Config& c) {
    c.causal = Causal::top_left;
    c.mask = MaskChoice::additive;
    c.alibi = true;
    c.softcap = 2.0;
    c.group = 2;
    c.dropout = 0.25;
  });
  add("everything, pre only", [](Config& c) {
    c.post = false;
    c.causal = Causal::bottom_right;
    c.mask = MaskChoice::boolean;
    c.softcap = 1.0;
    c.group = 2;
    c.dropout = 0.4;
  });
  add("everything, post only", [](Config& c) {
    c.pre = false;
    c.mask = MaskChoice::additive;
    c.alibi = true;
    c.softcap = 1.0;
    c.group = 4;
    c.dropout = 0.2;
  });
  // L = 149 runs as query blocks of 50, 50 and 49 rows.
  add("several query blocks, everything", [](Config& c) {
    c.query_len = 149;
    c.key_len = 9;
    c.several_blocks = true;
    c.causal = Causal::top_left;
    c.mask = MaskChoice::additive;
    c.alibi = true;
    c.softcap = 2.0;
    c.group = 2;
    c.dropout = 0.25;
  });
  add("several query blocks, pre only", [](Config& c) {
    c.query_len = 149;
    c.key_len = 6;
    c.several_blocks = true;
    c.post = false;
    c.causal = Causal::bottom_right;
    c.mask = MaskChoice::boolean;
    c.softcap = 1.0;
    c.group = 4;
    c.dropout = 0.4;
  });
  add("several query blocks, post only", [](Config& c) {
    c.query_len = 149;
    c.key_len = 11;
    c.several_blocks = true;
    c.pre = false;
    c.mask = MaskChoice::additive;
    c.alibi = true;
    c.alibi_alignment = mha::Alignment::bottom_right;
    c.dropout = 0.2;
  });
  add("several query blocks, no mixing", [](Config& c) {
    c.query_len = 149;
    c.key_len = 7;
    c.several_blocks = true;
    c.pre = c.post = false;
    c.causal = Causal::top_left;
    c.mask = MaskChoice::boolean;
  });
  return configs;
}

}  // namespace

TEMPLATE_TEST_CASE("talking heads equals a naive implementation for every option",
                   "[talking_heads]", float, double) {
  using T = TestType;
  std::vector<mha::detail::KernelScratch<T>> scratch;  // reused across shapes, as a Workspace
  for (const Config& config : naive_configs()) {
    INFO(describe(config));
    require_blocks(config);
    const Problem<T> p(config);
    const auto actual = talking_heads(p, p.mix(), scratch);
    const auto expected = naive(p);
    REQUIRE(actual.out.flat().allFinite());
    REQUIRE(actual.weights.flat().allFinite());
    CHECK(relative_to_max(actual.out, expected.out) <= kNaiveTolerance<T>);
    CHECK(relative_to_max(actual.weights, expected.weights) <= kNaiveTolerance<T>);
    // The fully masked row of mixed head H - 1 has zero probabilities: without post, zero
    // weights and a zero output row; post mixes other heads' probabilities into it.
    if (config.mask != MaskChoice::none && !config.post) {
      const Index H = config.heads, i = config.query_len / 2;
      CHECK(actual.weights[0][H - 1][i].matrix().isZero(0));
      CHECK(actual.out[0][H - 1][i].matrix().isZero(0));
    }
  }
}

TEMPLATE_TEST_CASE("identity and null mixes give attention_reference's results", "[talking_heads]",
                   float, double) {
  using T = TestType;
  std::vector<mha::detail::KernelScratch<T>> scratch;
  std::vector<Config> configs(5);
  configs[0].name = "plain";
  configs[1].name = "causal, boolean mask, softcap, GQA, dropout";
  configs[1].causal = Causal::top_left;
  configs[1].mask = MaskChoice::boolean;
  configs[1].softcap = 1.5;
  configs[1].group = 2;
  configs[1].dropout = 0.3;
  configs[2].name = "additive mask, ALiBi, L > S";
  configs[2].mask = MaskChoice::additive;
  configs[2].alibi = true;
  configs[2].query_len = 9;
  configs[2].key_len = 4;
  configs[3] = configs[1];
  configs[3].name = "everything";
  configs[3].mask = MaskChoice::additive;
  configs[3].alibi = true;
  configs[4] = configs[1];
  configs[4].name = "several query blocks";
  configs[4].query_len = 149;
  configs[4].key_len = 10;
  configs[4].several_blocks = true;
  for (Config& config : configs) {
    config.pre = config.post = false;
    INFO(describe(config));
    require_blocks(config);
    const Problem<T> p(config);
    const Config& c = p.c;
    Forward<T> reference{Tensor<T>({c.batch, c.heads, c.query_len, c.value_dim}),
                         Tensor<T>({c.batch, c.heads, c.query_len, c.key_len})};
    mha::detail::attention_reference<T>(
        c.batch, c.heads, p.q_layout(), p.k_layout(), p.v_layout(),
        p.layout(reference.out.data(), c.heads, c.query_len, c.value_dim), p.core(),
        reference.weights.data(), scratch);
    std::vector<T> identity(static_cast<std::size_t>(c.heads * c.heads), T(0));
    for (Index h = 0; h < c.heads; ++h) identity[static_cast<std::size_t>(h * c.heads + h)] = T(1);
    const struct {
      const char* name;
      mha::detail::TalkingHeads<T> mix;
    } mixes[] = {{"null pre, null post", {}},
                 {"identity pre", {identity.data(), nullptr}},
                 {"identity post", {nullptr, identity.data()}},
                 {"identity pre and post", {identity.data(), identity.data()}}};
    for (const auto& mix : mixes) {
      INFO(mix.name);
      const auto actual = talking_heads(p, mix.mix, scratch);
      INFO("largest differences: output "
           << (actual.out.flat() - reference.out.flat()).cwiseAbs().maxCoeff() << ", weights "
           << (actual.weights.flat() - reference.weights.flat()).cwiseAbs().maxCoeff());
      // An explicit pre rounds scale q kᵀ before the masks are added to the mixed logits, where
      // attention_reference adds scale q kᵀ to the masks in one multiply-add, which the compiler
      // may fuse (GCC does with -march=native; clang and builds without FMA give equal bits):
      // with an additive mask or ALiBi (finite values other than 0) the scores may then differ
      // by an ulp, unless softcap rounds them first in both.
      const bool rounded_twice =
          mix.mix.pre != nullptr && c.softcap == 0 && (c.mask == MaskChoice::additive || c.alibi);
      // With several query blocks, the scores q kᵀ and out are products per block where
      // attention_reference's are one per head. Eigen's GEMM does not promise the same bits for
      // a row of a [50, D] product as for the same row of the [149, D] one: with FMA its
      // micro-kernel and its edge path round differently, and which rows take the edge depends
      // on the shape (measured: 1 score of 1490 an ulp apart with AVX2 or AVX-512, none with
      // SSE2). Both then agree within the float tolerance, not bit for bit.
      if (rounded_twice || c.several_blocks) {
        CHECK_TENSORS_CLOSE(actual.out, reference.out);
        CHECK_TENSORS_CLOSE(actual.weights, reference.weights);
      } else {
        CHECK(actual.out.flat() == reference.out.flat());
        CHECK(actual.weights.flat() == reference.weights.flat());
      }
    }

    // Backward without mixing against attention_reference_backward.
    const auto grad_out = mha_test::random_tensor<T>(reference.out.shape(), c.seed + 5);
    const T nan = std::numeric_limits<T>::quiet_NaN();
    Tensor<T> ref_q(p.q.shape(), nan), ref_k(p.k.shape(), nan), ref_v(p.v.shape(), nan);
    mha::detail::attention_reference_backward<T>(
        c.batch, c.heads, p.q_layout(), p.k_layout(), p.v_layout(),
        p.layout(grad_out.data(), c.heads, c.query_len, c.value_dim),
        p.layout(ref_q.data(), c.heads, c.query_len, c.head_dim),
        p.layout(ref_k.data(), c.heads / c.group, c.key_len, c.head_dim, c.group),
        p.layout(ref_v.data(), c.heads / c.group, c.key_len, c.value_dim, c.group), p.core(),
        scratch);
    const auto grads = talking_heads_backward(p, {}, grad_out, scratch);
    CHECK_GRADIENTS_CLOSE(grads.q, ref_q);
    CHECK_GRADIENTS_CLOSE(grads.k, ref_k);
    CHECK_GRADIENTS_CLOSE(grads.v, ref_v);
  }
}

namespace {

// ||a - b|| / ||b||, or ||a|| when b is 0.
double relative_error(const Eigen::Ref<const Eigen::VectorXd>& actual,
                      const Eigen::Ref<const Eigen::VectorXd>& expected) {
  const double difference = (actual - expected).norm();
  const double scale = expected.norm();
  return scale > 0 ? difference / scale : difference;
}

// d loss / d x[i] for every i by the five-point central difference
//   (8 (f(x+h) - f(x-h)) - (f(x+2h) - f(x-2h))) / 12h,
// truncation error O(h^4) = 1e-16 and rounding error O(1e-16 / h) = 1e-12 relative at h = 1e-4.
Eigen::VectorXd numeric_gradient(double* x, Index size, const std::function<double()>& loss) {
  Eigen::VectorXd gradient(size);
  const double h = 1e-4;
  for (Index i = 0; i < size; ++i) {
    const double x0 = x[i];
    const auto at = [&](double shifted) {
      x[i] = shifted;
      const double result = loss();
      x[i] = x0;
      return result;
    };
    gradient[i] = (8 * (at(x0 + h) - at(x0 - h)) - (at(x0 + 2 * h) - at(x0 - 2 * h))) / (12 * h);
  }
  return gradient;
}

Eigen::Map<const Eigen::VectorXd> as_vector(const std::vector<double>& x) {
  return {x.data(), static_cast<Index>(x.size())};
}

}  // namespace

TEST_CASE("talking heads gradients equal central finite differences", "[talking_heads][backward]") {
  std::vector<mha::detail::KernelScratch<double>> scratch;
  std::vector<Config> configs;
  const auto add = [&](const std::string& name, const std::function<void(Config&)>& edit) {
    Config c;
    c.name = name;
    c.batch = 2;
    c.heads = 4;
    c.query_len = 3;
    c.key_len = 4;
    c.head_dim = 3;
    c.value_dim = 2;
    c.seed = 100 + 10 * configs.size();
    edit(c);
    configs.push_back(c);
  };
  add("pre and post", [](Config&) {});
  add("causal, softcap, GQA", [](Config& c) {
    c.causal = Causal::top_left;
    c.softcap = 1.5;
    c.group = 2;
  });
  add("additive mask with a fully masked row, ALiBi, dropout, pre only", [](Config& c) {
    c.post = false;
    c.mask = MaskChoice::additive;
    c.alibi = true;
    c.dropout = 0.3;
  });
  add("boolean mask with a fully masked row, post only, L > S", [](Config& c) {
    c.pre = false;
    c.mask = MaskChoice::boolean;
    c.query_len = 5;
    c.key_len = 3;
  });
  add("everything", [](Config& c) {
    c.causal = Causal::bottom_right;
    c.mask = MaskChoice::boolean;
    c.alibi = true;
    c.softcap = 1.0;
    c.group = 2;
    c.dropout = 0.25;
    c.key_len = 6;
  });
  add("no mixing, softcap, GQA with one stored head", [](Config& c) {
    c.pre = c.post = false;
    c.softcap = 2.0;
    c.group = 4;
  });
  // L = 67 runs as query blocks of 34 and 33 rows: grad_k, grad_v, dpre and dpost sum over them.
  add("several query blocks, everything", [](Config& c) {
    c.batch = 1;
    c.heads = 2;
    c.query_len = 67;
    c.key_len = 5;
    c.head_dim = 2;
    c.several_blocks = true;
    c.causal = Causal::top_left;
    c.mask = MaskChoice::additive;
    c.alibi = true;
    c.softcap = 1.5;
    c.group = 2;
    c.dropout = 0.25;
  });
  add("several query blocks, two batch rows, boolean mask, pre only", [](Config& c) {
    c.heads = 2;
    c.query_len = 67;
    c.key_len = 4;
    c.head_dim = 2;
    c.several_blocks = true;
    c.post = false;
    c.causal = Causal::bottom_right;
    c.mask = MaskChoice::boolean;
  });
  add("several query blocks, post only, GQA with one stored head", [](Config& c) {
    c.batch = 1;
    c.query_len = 67;
    c.key_len = 3;
    c.head_dim = 2;
    c.several_blocks = true;
    c.pre = false;
    c.group = 4;
    c.softcap = 2.0;
    c.dropout = 0.2;
  });
  constexpr double kBound = 1e-6;
  for (const Config& config : configs) {
    INFO(describe(config));
    require_blocks(config);
    Problem<double> p(config);
    const auto grad_out = mha_test::random_tensor<double>(
        {config.batch, config.heads, config.query_len, config.value_dim}, config.seed + 9);
    const auto loss = [&] {
      return talking_heads(p, p.mix(), scratch).out.flat().dot(grad_out.flat());
    };
    const auto grads = talking_heads_backward(p, p.mix(), grad_out, scratch);
    REQUIRE(grads.q.flat().allFinite());
    REQUIRE(grads.k.flat().allFinite());
    REQUIRE(grads.v.flat().allFinite());
    CHECK(relative_error(grads.q.flat(), numeric_gradient(p.q.data(), p.q.size(), loss)) < kBound);
    CHECK(relative_error(grads.k.flat(), numeric_gradient(p.k.data(), p.k.size(), loss)) < kBound);
    CHECK(relative_error(grads.v.flat(), numeric_gradient(p.v.data(), p.v.size(), loss)) < kBound);
    const auto check_mix = [&](const char* name, std::vector<double>& mix,
                               const std::vector<double>& grad) {
      INFO(name);
      if (mix.empty()) {
        // a null mix's gradient buffer is left alone
        CHECK(std::all_of(grad.begin(), grad.end(), [](double x) { return std::isnan(x); }));
        return;
      }
      const auto numeric = numeric_gradient(mix.data(), static_cast<Index>(mix.size()), loss);
      CHECK(relative_error(as_vector(grad), numeric) < kBound);
    };
    check_mix("pre", p.pre, grads.pre);
    check_mix("post", p.post, grads.post);
  }
}

TEST_CASE("talking heads backward leaves dpre and dpost alone when not asked",
          "[talking_heads][backward]") {
  Config config;
  config.name = "no gradient buffers";
  const Problem<double> p(config);
  std::vector<mha::detail::KernelScratch<double>> scratch;
  const auto grad_out = mha_test::random_tensor<double>(
      {config.batch, config.heads, config.query_len, config.value_dim}, 3);
  const auto with = talking_heads_backward(p, p.mix(), grad_out, scratch);
  Tensor<double> q(p.q.shape()), k(p.k.shape()), v(p.v.shape());
  mha::detail::attention_talking_heads_backward<double>(
      config.batch, config.heads, p.q_layout(), p.k_layout(), p.v_layout(),
      p.layout(grad_out.data(), config.heads, config.query_len, config.value_dim),
      p.layout(q.data(), config.heads, config.query_len, config.head_dim),
      p.layout(k.data(), config.heads, config.key_len, config.head_dim),
      p.layout(v.data(), config.heads, config.key_len, config.value_dim), p.core(), p.mix(),
      nullptr, nullptr, scratch);
  CHECK(q.flat() == with.q.flat());
  CHECK(k.flat() == with.k.flat());
  CHECK(v.flat() == with.v.flat());
}

#ifdef _OPENMP
TEMPLATE_TEST_CASE("talking heads results do not depend on the number of threads",
                   "[talking_heads][threads]", float, double) {
  using T = TestType;
  std::vector<Config> configs(3);
  // Three batch rows over two threads, every option on.
  configs[0].name = "B = 3";
  configs[0].batch = 3;
  configs[0].query_len = 48;
  configs[0].key_len = 64;
  configs[0].head_dim = 16;
  configs[0].value_dim = 16;
  configs[0].group = 2;
  configs[0].causal = Causal::top_left;
  configs[0].mask = MaskChoice::additive;
  configs[0].alibi = true;
  configs[0].softcap = 2.0;
  configs[0].dropout = 0.1;
  // One batch row: one task, with products large enough that Eigen would thread them itself
  // outside a parallel region, choosing a depth blocking from the thread count (measured: with
  // the region skipped for one row, out and grad_q differ between 1 and 2 threads at S = 1024,
  // not at S = 300).
  configs[1].name = "B = 1";
  configs[1].batch = 1;
  configs[1].heads = 2;
  configs[1].query_len = 256;
  configs[1].key_len = 1024;
  configs[1].head_dim = 64;
  configs[1].value_dim = 64;
  // Query blocks of two batch rows spread over the threads (forward), walked in order by each
  // batch row's task (backward).
  configs[2] = configs[0];
  configs[2].name = "B = 2, several query blocks";
  configs[2].batch = 2;
  configs[2].query_len = 211;
  configs[2].key_len = 96;
  configs[2].several_blocks = true;
  const int threads_before = omp_get_max_threads();
  for (const Config& config : configs) {
    INFO(describe(config));
    require_blocks(config);
    const Problem<T> p(config);
    const auto grad_out = mha_test::random_tensor<T>(
        {config.batch, config.heads, config.query_len, config.value_dim}, 8);
    std::vector<Forward<T>> forwards;
    std::vector<Gradients<T>> gradients;
    for (const int threads : {1, 2}) {
      omp_set_num_threads(threads);
      std::vector<mha::detail::KernelScratch<T>> scratch;
      forwards.push_back(talking_heads(p, p.mix(), scratch));
      gradients.push_back(talking_heads_backward(p, p.mix(), grad_out, scratch));
    }
    omp_set_num_threads(threads_before);
    CHECK(forwards[0].out.flat() == forwards[1].out.flat());
    CHECK(forwards[0].weights.flat() == forwards[1].weights.flat());
    CHECK(gradients[0].q.flat() == gradients[1].q.flat());
    CHECK(gradients[0].k.flat() == gradients[1].k.flat());
    CHECK(gradients[0].v.flat() == gradients[1].v.flat());
    CHECK(gradients[0].pre == gradients[1].pre);
    CHECK(gradients[0].post == gradients[1].post);
  }
}
#endif
