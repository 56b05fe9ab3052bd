// Learnable attention sinks (kernels/sinks.hpp): both kernels against a written-out float64
// reference, their gradients (the sinks' included) against central finite differences, the
// layer's "sinks" parameter through forward, backward and decode (contiguous and paged caches),
// and the refusals.
#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "helpers.hpp"

using mha::Index;
using mha::Tensor;

namespace {

struct Case {
  std::string name;
  Index batch = 2, heads = 4, kv_heads = 2, query_len = 5, key_len = 7, head_dim = 8;
  bool causal = false;  // bottom-right, so that a query may see no key when L > S
  std::uint64_t seed = 1;
};

// The attention of q (B, H, L, D), k, v (B, H_kv, S, D) with one sink logit per head, written
// out in double: each row's softmax over its visible scores and the sink.
Tensor<double> written_out(const Case& c, const Tensor<double>& q, const Tensor<double>& k,
                           const Tensor<double>& v, const std::vector<double>& sinks,
                           Tensor<double>* weights = nullptr) {
  const Index group = c.heads / c.kv_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
  Tensor<double> out({c.batch, c.heads, c.query_len, c.head_dim});
  if (weights != nullptr) *weights = Tensor<double>({c.batch, c.heads, c.query_len, c.key_len});
  for (Index b = 0; b < c.batch; ++b) {
    for (Index h = 0; h < c.heads; ++h) {
      const auto qh = q[b][h].matrix();
      const auto kh = k[b][h / group].matrix();
      const auto vh = v[b][h / group].matrix();
      for (Index i = 0; i < c.query_len; ++i) {
        const Index visible = c.causal ? i + 1 + c.key_len - c.query_len : c.key_len;
        double largest = sinks[static_cast<std::size_t>(h)];
        std::vector<double> scores;
        for (Index j = 0; j < std::max<Index>(visible, 0); ++j) {
          scores.push_back(scale * qh.row(i).dot(kh.row(j)));
          largest = std::max(largest, scores.back());
        }
        double total = std::exp(sinks[static_cast<std::size_t>(h)] - largest);
        for (const double s : scores) total += std::exp(s - largest);
        auto out_row = out[b][h].matrix().row(i);
        out_row.setZero();
        for (Index j = 0; j < static_cast<Index>(scores.size()); ++j) {
          const double p = std::exp(scores[static_cast<std::size_t>(j)] - largest) / total;
          out_row += p * vh.row(j);
          if (weights != nullptr) (*weights)[b][h].matrix()(i, j) = p;
        }
      }
    }
  }
  return out;
}

template <class T>
struct Inputs {
  Tensor<T> q, k, v;
  std::vector<T> sinks;
  explicit Inputs(const Case& c) {
    q = mha_test::random_tensor<T>({c.batch, c.heads, c.query_len, c.head_dim}, c.seed, 1.5);
    k = mha_test::random_tensor<T>({c.batch, c.kv_heads, c.key_len, c.head_dim}, c.seed + 1, 1.5);
    v = mha_test::random_tensor<T>({c.batch, c.kv_heads, c.key_len, c.head_dim}, c.seed + 2);
    // Sinks from well below to well above the scores, so that some heads put most weight on them.
    for (Index h = 0; h < c.heads; ++h)
      sinks.push_back(static_cast<T>(-3.0 + 2.0 * static_cast<double>(h)));
  }
};

std::vector<Case> cases() {
  std::vector<Case> all;
  all.push_back({"small, grouped-query"});
  Case blocks{"several flash blocks, causal"};
  blocks.query_len = 70;
  blocks.key_len = 150;
  blocks.causal = true;
  blocks.head_dim = 32;
  all.push_back(blocks);
  Case empty_rows{"L > S, causal: the first rows see no key"};
  empty_rows.query_len = 9;
  empty_rows.key_len = 4;
  empty_rows.causal = true;
  all.push_back(empty_rows);
  Case wide{"D = 64, one key/value head"};
  wide.kv_heads = 1;
  wide.head_dim = 64;
  wide.query_len = 33;
  wide.key_len = 40;
  all.push_back(wide);
  return all;
}

template <class T>
mha::AttentionOptions<T> options_for(const Case& c, const std::vector<T>& sinks,
                                     mha::Kernel kernel) {
  mha::AttentionOptions<T> options;
  options.sinks = sinks;
  options.enable_gqa = true;
  options.kernel = kernel;
  options.need_weights = kernel == mha::Kernel::reference;
  options.causal = c.causal ? mha::Causal::bottom_right : mha::Causal::none;
  return options;
}

}  // namespace

TEMPLATE_TEST_CASE("sinks: both kernels equal attention with a sink column written out in double",
                   "[sinks]", float, double) {
  using T = TestType;
  for (const Case& c : cases()) {
    for (const auto kernel : {mha::Kernel::reference, mha::Kernel::flash}) {
      INFO(c.name << ", " << mha::kernel_name(kernel));
      const Inputs<T> in(c);
      const Inputs<double> exact_in(c);
      Tensor<double> exact_weights;
      const auto exact =
          written_out(c, mha::tensor_cast<double>(in.q), mha::tensor_cast<double>(in.k),
                      mha::tensor_cast<double>(in.v), exact_in.sinks, &exact_weights);
      const auto result =
          mha::scaled_dot_product_attention(in.q, in.k, in.v, options_for(c, in.sinks, kernel));
      CHECK_TENSORS_CLOSE(result.output, exact);
      if (kernel == mha::Kernel::reference) {
        CHECK_TENSORS_CLOSE(result.weights, exact_weights);
      } else {
        // The flash kernel's log-sum-exp is that of the scores and the sink together.
        const Index rows = c.batch * c.heads * c.query_len;
        for (Index r = 0; r < rows; ++r) REQUIRE(std::isfinite(result.logsumexp.data()[r]));
      }
    }
  }
  // The sinks take weight from every row, and a larger sink more: rows sum to less than 1, the
  // last head's (sink 3) less than the first head's (sink -3).
  const Case c = cases().front();
  const Inputs<T> in(c);
  const auto result = mha::scaled_dot_product_attention(
      in.q, in.k, in.v, options_for(c, in.sinks, mha::Kernel::reference));
  for (Index b = 0; b < c.batch; ++b) {
    const auto first_head = result.weights[b][0].matrix().rowwise().sum();
    const auto last_head = result.weights[b][c.heads - 1].matrix().rowwise().sum();
    CHECK(first_head.maxCoeff() < T(1));
    CHECK(last_head.sum() < first_head.sum());
  }
}

TEST_CASE("sinks: gradients of q, k, v and the sinks equal central finite differences", "[sinks]") {
  for (Case c : cases()) {
    if (c.query_len > 10) continue;  // finite differences cost two forwards per element
    for (const auto kernel : {mha::Kernel::reference, mha::Kernel::flash}) {
      for (const double dropout : {0.0, 0.3}) {
        INFO(c.name << ", " << mha::kernel_name(kernel) << ", dropout " << dropout);
        Inputs<double> in(c);
        auto options = options_for(c, in.sinks, kernel);
        options.need_weights = false;
        options.dropout = dropout;
        options.dropout_seed = 11;
        const auto grad_out = mha_test::random_tensor<double>(
            {c.batch, c.heads, c.query_len, c.head_dim}, c.seed + 7);
        const auto loss = [&](const Inputs<double>& at) {
          auto at_options = options;
          at_options.sinks = at.sinks;
          const auto out = mha::scaled_dot_product_attention(at.q, at.k, at.v, at_options);
          return out.output.flat().dot(grad_out.flat());
        };
        const auto result = mha::scaled_dot_product_attention(in.q, in.k, in.v, options);
        const auto grads = mha::scaled_dot_product_attention_backward(
            std::as_const(in.q).view(), std::as_const(in.k).view(), std::as_const(in.v).view(),
            result, grad_out.view(), options);
        constexpr double kStep = 1e-5;  // rounding noise ~1e-16 |loss| / step, truncation ~step²
        const auto numeric = [&](double& element) {
          const double kept = element;
          element = kept + kStep;
          const double up = loss(in);
          element = kept - kStep;
          const double down = loss(in);
          element = kept;
          return (up - down) / (2 * kStep);
        };
        const auto check_tensor = [&](Tensor<double>& at, const Tensor<double>& analytic) {
          const auto expected = mha_test::central_differences(
              at, [&] { return loss(in); }, kStep);
          CHECK_TENSORS_CLOSE_TOL(analytic, expected, 1e-6, 1e-7);
        };
        check_tensor(in.q, grads.query);
        check_tensor(in.k, grads.key);
        check_tensor(in.v, grads.value);
        Tensor<double> expected_sinks({c.heads});
        for (Index h = 0; h < c.heads; ++h) {
          expected_sinks.data()[h] = numeric(in.sinks[static_cast<std::size_t>(h)]);
        }
        CHECK_TENSORS_CLOSE_TOL(grads.sinks, expected_sinks, 1e-6, 1e-7);
      }
    }
  }
}

TEST_CASE("sinks: the flash backward equals the reference backward over several blocks",
          "[sinks]") {
  // The larger cases, where finite differences would take long: the reference backward, which
  // they check on the small ones, against the flash one, whose blocks these cases cut.
  for (const Case& c : cases()) {
    if (c.query_len <= 10) continue;
    INFO(c.name);
    const Inputs<double> in(c);
    const auto grad_out =
        mha_test::random_tensor<double>({c.batch, c.heads, c.query_len, c.head_dim}, c.seed + 7);
    std::vector<mha::AttentionGradients<double>> grads;
    for (const auto kernel : {mha::Kernel::reference, mha::Kernel::flash}) {
      auto options = options_for(c, in.sinks, kernel);
      options.need_weights = false;
      const auto result = mha::scaled_dot_product_attention(in.q, in.k, in.v, options);
      grads.push_back(mha::scaled_dot_product_attention_backward(
          in.q.view(), in.k.view(), in.v.view(), result, grad_out.view(), options));
    }
    CHECK_TENSORS_CLOSE(grads[1].query, grads[0].query);
    CHECK_TENSORS_CLOSE(grads[1].key, grads[0].key);
    CHECK_TENSORS_CLOSE(grads[1].value, grads[0].value);
    CHECK_TENSORS_CLOSE(grads[1].sinks, grads[0].sinks);
  }
}

TEST_CASE("sinks: the layer's parameter through forward_train and backward", "[sinks]") {
  mha::MultiHeadAttentionConfig config(32, 4);
  config.num_kv_heads = 2;
  config.learnable_sinks = true;
  config.seed = 5;
  mha::MultiHeadAttention<double> layer(config);
  REQUIRE(layer.has_parameter("sinks"));
  REQUIRE(layer.parameter("sinks").shape() == mha::Shape{4});
  CHECK(Tensor<double>(layer.parameter("sinks")).flat().isZero());
  const std::vector<double> sinks{-1.0, 0.5, 2.0, 4.0};
  for (Index h = 0; h < 4; ++h)
    layer.parameter("sinks").data()[h] = sinks[static_cast<std::size_t>(h)];
  const auto x = mha_test::random_tensor<double>({2, 6, 32}, 3);
  const auto grad_out = mha_test::random_tensor<double>({2, 6, 32}, 4);
  for (const auto kernel : {mha::Kernel::reference, mha::Kernel::flash}) {
    INFO(mha::kernel_name(kernel));
    mha::ForwardOptions<double> options;
    options.need_weights = false;
    options.kernel = kernel;
    options.is_causal = true;
    const auto loss = [&] { return layer.forward(x, options).output.flat().dot(grad_out.flat()); };
    mha::SavedForward<double> saved;
    layer.zero_grad();
    layer.forward_train(x, options, saved);
    const auto input_grads = layer.backward(saved, grad_out.view());
    Tensor<double> expected({4});
    for (Index h = 0; h < 4; ++h) {
      double& sink = layer.parameter("sinks").data()[h];
      const double kept = sink;
      sink = kept + 1e-6;
      const double up = loss();
      sink = kept - 1e-6;
      const double down = loss();
      sink = kept;
      expected.data()[h] = (up - down) / 2e-6;
    }
    CHECK_TENSORS_CLOSE_TOL(Tensor<double>(layer.gradient("sinks")), expected, 1e-6, 1e-7);
    // The sinks change the output: the same layer with sinks far below every score is the layer
    // without them.
    auto without = layer.state_dict();
    without.erase("sinks");
    const auto plain = mha::MultiHeadAttention<double>::from_state_dict(without, 4);
    auto drowned = layer;
    for (Index h = 0; h < 4; ++h) drowned.parameter("sinks").data()[h] = -1e4;
    CHECK_TENSORS_CLOSE(drowned.forward(x, options).output, plain.forward(x, options).output);
    CHECK_FALSE(
        mha_test::compare(layer.forward(x, options).output, plain.forward(x, options).output).ok);
    (void)input_grads;
  }
}

TEST_CASE("sinks: decoding with a contiguous or a paged cache gives the causal forward's outputs",
          "[sinks]") {
  // A prompt of 40 tokens (the flash kernel over the cache), then steps of 1 and 3 tokens (the
  // decoding kernel), for 2 sequences, against one causal forward over the whole sequences.
  for (const Index kv_heads : {Index{1}, Index{4}}) {
    INFO("H_kv = " << kv_heads);
    mha::MultiHeadAttentionConfig config(64, 4);
    config.num_kv_heads = kv_heads;
    config.learnable_sinks = true;
    config.seed = 8;
    mha::MultiHeadAttention<float> layer(config);
    const std::vector<float> sinks{-2.0F, 0.0F, 1.5F, 3.0F};
    for (Index h = 0; h < 4; ++h) {
      layer.parameter("sinks").data()[h] = sinks[static_cast<std::size_t>(h)];
    }
    const auto x = mha_test::random_tensor<float>({2, 44, 64}, 9);
    mha::ForwardOptions<float> full_options;
    full_options.is_causal = true;
    full_options.need_weights = false;
    const auto full = layer.forward(x, full_options);
    const double largest = static_cast<double>(full.output.flat().cwiseAbs().maxCoeff());
    const auto options = mha::MultiHeadAttention<float>::decode_options();

    auto cache = layer.make_kv_cache(2, 44);
    auto pool = layer.make_paged_kv_cache(48, 4);
    const std::vector<Index> ids{pool.add_sequence(), pool.add_sequence()};
    Tensor<float> contiguous(x.shape()), paged(x.shape());
    Index first = 0;
    for (const Index count : {40, 1, 3}) {
      Tensor<float> step({2, count, 64});
      for (Index b = 0; b < 2; ++b) step[b].matrix() = x[b].matrix().middleRows(first, count);
      const auto from_cache = layer.decode(step, cache, options);
      const auto from_pool = layer.decode(step, pool, ids, options);
      for (Index b = 0; b < 2; ++b) {
        contiguous[b].matrix().middleRows(first, count) = from_cache.output[b].matrix();
        paged[b].matrix().middleRows(first, count) = from_pool.output[b].matrix();
      }
      first += count;
    }
    CHECK_TENSORS_CLOSE_TOL(contiguous, full.output, 0.0, 1e-5 * largest);
    CHECK_TENSORS_CLOSE_TOL(paged, contiguous, 0.0, 0.0);
  }
}

TEST_CASE("sinks: refusals", "[sinks]") {
  const Case c = cases().front();
  Inputs<float> in(c);
  auto options = options_for(c, in.sinks, mha::Kernel::flash);
  options.sinks.pop_back();
  const std::string wrong_size = mha_test::message_of<mha::ShapeError>(
      [&] { mha::scaled_dot_product_attention(in.q, in.k, in.v, options); });
  CHECK(mha_test::contains(wrong_size, "sinks"));
  CHECK(mha_test::contains(wrong_size, "[4]"));
  CHECK(mha_test::contains(wrong_size, "[3]"));
  options.sinks = in.sinks;
  options.sinks[1] = std::numeric_limits<float>::infinity();
  CHECK(mha_test::contains(mha_test::message_of<mha::ShapeError>([&] {
                             mha::scaled_dot_product_attention(in.q, in.k, in.v, options);
                           }),
                           "sinks"));

  mha::MultiHeadAttentionConfig config(16, 2);
  config.learnable_sinks = true;
  config.talking_heads_pre = true;
  CHECK(mha_test::contains(
      mha_test::message_of<mha::ShapeError>([&] { mha::MultiHeadAttention<float> layer(config); }),
      "learnable_sinks"));
  config.talking_heads_pre = false;
  CHECK(mha_test::contains(mha_test::message_of<mha::ShapeError>(
                               [&] { mha::MultiHeadAttention<Eigen::half> layer(config); }),
                           "learnable_sinks"));
}

TEST_CASE("sinks: a state_dict with sinks makes a layer with them; pruning keeps the kept heads'",
          "[sinks]") {
  mha::MultiHeadAttentionConfig config(16, 4);
  config.learnable_sinks = true;
  mha::MultiHeadAttention<float> layer(config);
  for (Index h = 0; h < 4; ++h) layer.parameter("sinks").data()[h] = static_cast<float>(h);
  const auto copy = mha::MultiHeadAttention<float>::from_state_dict(layer.state_dict(), 4);
  CHECK(copy.config().learnable_sinks);
  layer.prune_heads({0, 2});
  REQUIRE(layer.parameter("sinks").shape() == mha::Shape{2});
  CHECK(layer.parameter("sinks").data()[0] == 1.0F);
  CHECK(layer.parameter("sinks").data()[1] == 3.0F);
}
