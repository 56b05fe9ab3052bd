// Optimisers and gradient clipping (mha/optim.hpp) against PyTorch: every fixture written by
// tests/reference/generate_optim.py holds initial parameters, the gradient of each of 5 steps and
// torch's parameters after each step (or torch's clip_grad_norm_ result). The optimiser is run on
// the same gradients and compared after every step. Then properties: zero_grad, refused options,
// refused parameter lists, parameters owned outside any layer, and no allocation in step().
// To regenerate the fixtures: /usr/bin/python3 tests/reference/generate_optim.py
//
// Eigen's heap allocations are made fatal inside the blocks that forbid them (see
// "step() allocates nothing"): EIGEN_RUNTIME_NO_MALLOC with an eigen_assert that throws, in every
// build type. Both must come before the first Eigen include.
#define EIGEN_RUNTIME_NO_MALLOC
#define eigen_assert(x) \
  ((x) ? static_cast<void>(0) : throw std::logic_error("Eigen assertion failed: " #x))
#include <stdexcept>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "helpers.hpp"
#include "mha/io/safetensors.hpp"
#include "mha/optim.hpp"
#include "mha/parameters.hpp"

using mha::Index;
using mha::ParameterList;
using mha::Shape;
using mha::Tensor;

namespace {

using mha_test::contains;
using mha_test::message_of;

// The same rounding-error bound for every optimiser fixture and both scalar types: an element
// goes through at most about ten roundings of relative size u (the unit roundoff of T) per step,
// on operands no larger than `scale` = max(1, the largest |p| of the case) (the updates,
// lr * m / denom or lr * b, stay below 1 in these fixtures), so after 5 steps one side is within
// about 50 u * scale of the exact trajectory. For double both torch and this library round
// (differently: fused multiply-adds, order), for float the float inputs are torch's float64 values
// rounded once more and torch's side is exact by comparison. 64 u * scale covers either.
// Measured with torch 1.13's fixtures: at most 2.7 u * scale for float (AdamW) and 0.44 u * scale
// for double (SGD with momentum); check_against_torch reports it when the bound is exceeded.
constexpr double kStepBoundInUlps = 64.0;

// clip_grad_norm: a sum of 27 terms is within 26 u of exact on each side (and the scaled pow of
// norm 3 adds a few u), so totals agree within 64 u relative; each clipped gradient adds the
// rounding of the factor to T and of the product: 72 u. Measured: double totals equal torch's bit
// for bit, float ones are within 0.7 u.
constexpr double kNormBoundInUlps = 64.0;
constexpr double kClippedBoundInUlps = 72.0;

template <class T>
constexpr double unit_roundoff() {
  return std::numeric_limits<T>::epsilon() / 2;
}

std::string fixture_path(const std::string& name) {
  return std::string(MHA_REFERENCE_DIR) + "/optim_" + name + ".safetensors";
}

std::vector<std::string> split_names(const std::string& text) {
  std::vector<std::string> out;
  std::size_t begin = 0;
  while (begin <= text.size()) {
    const std::size_t comma = std::min(text.find(',', begin), text.size());
    out.push_back(text.substr(begin, comma - begin));
    begin = comma + 1;
  }
  return out;
}

double option(const mha::io::SafetensorsFile& file, const std::string& key, double fallback) {
  const auto it = file.metadata.find(key);
  return it == file.metadata.end() ? fallback : std::stod(it->second);
}

bool flag(const mha::io::SafetensorsFile& file, const std::string& key) {
  const auto it = file.metadata.find(key);
  return it != file.metadata.end() && it->second == "1";
}

// Parameters owned by the test, as a model's tensors outside any layer would be.
template <class T>
struct OwnedParameters {
  std::vector<std::string> names;
  std::vector<Tensor<T>> values;
  std::vector<Tensor<T>> grads;
  ParameterList<T> list;

  // Views are taken once every tensor is in place, so no vector growth can move them.
  void make_list() {
    list.clear();
    for (std::size_t k = 0; k < names.size(); ++k) {
      list.push_back(mha::make_parameter(names[k], values[k], grads[k]));
    }
  }
};

template <class T>
OwnedParameters<T> load_parameters(const mha::io::SafetensorsFile& file,
                                   const std::string& prefix) {
  OwnedParameters<T> owned;
  owned.names = split_names(file.metadata.at("parameters"));
  for (const auto& name : owned.names) {
    owned.values.push_back(mha::io::to_tensor<T>(file.at(prefix + name), prefix + name));
    owned.grads.emplace_back(owned.values.back().shape());
  }
  owned.make_list();
  return owned;
}

template <class T>
void copy_into(Tensor<T>& destination, const Tensor<T>& source) {
  REQUIRE(destination.shape() == source.shape());
  destination.flat() = source.flat();
}

// Feeds each stored gradient, steps, and compares every parameter with torch's after the step.
template <class T, class Optimizer>
void check_against_torch(const std::string& name, const mha::io::SafetensorsFile& file,
                         OwnedParameters<T>& owned, Optimizer& optimizer) {
  const int steps = std::stoi(file.metadata.at("steps"));
  REQUIRE(steps == 5);
  double scale = 1.0;
  for (const auto& entry : file.tensors) {
    if (entry.first.rfind("grad.", 0) == 0) continue;
    const auto values = mha::io::to_tensor<double>(entry.second, entry.first);
    for (Index i = 0; i < values.size(); ++i) scale = std::max(scale, std::abs(values.data()[i]));
  }
  const double atol = kStepBoundInUlps * unit_roundoff<T>() * scale;
  double worst = 0.0;
  for (int t = 1; t <= steps; ++t) {
    for (std::size_t k = 0; k < owned.names.size(); ++k) {
      const std::string key = "grad." + std::to_string(t) + "." + owned.names[k];
      copy_into(owned.grads[k], mha::io::to_tensor<T>(file.at(key), key));
    }
    optimizer.step();
    CHECK(optimizer.steps() == t);
    for (std::size_t k = 0; k < owned.names.size(); ++k) {
      const std::string key = "expected." + std::to_string(t) + "." + owned.names[k];
      const auto expected = mha::io::to_tensor<double>(file.at(key), key);
      INFO(name << " (" << file.metadata.at("description") << "), step " << t << ", "
                << owned.names[k] << ", atol = " << kStepBoundInUlps << " u * " << scale);
      CHECK_TENSORS_CLOSE_TOL(owned.values[k], expected, 0.0, atol);
      for (Index i = 0; i < expected.size(); ++i) {
        const double diff =
            std::abs(static_cast<double>(owned.values[k].data()[i]) - expected.data()[i]);
        worst = std::max(worst, diff / (unit_roundoff<T>() * scale));
      }
    }
  }
  // Headroom, for whoever revisits kStepBoundInUlps.
  INFO(name << ": largest difference from torch " << worst << " u * scale");
  CHECK(worst <= kStepBoundInUlps);
}

template <class T>
void fill_random(OwnedParameters<T>& owned, std::uint64_t seed) {
  // Copied into the existing storage: assigning a Tensor would move the memory the views see.
  for (auto& grad : owned.grads) copy_into(grad, mha_test::random_tensor<T>(grad.shape(), seed++));
}

template <class T>
OwnedParameters<T> random_parameters(std::uint64_t seed) {
  OwnedParameters<T> owned;
  const std::vector<Shape> shapes = {{3, 4}, {3}, {2, 2, 3}};
  const char* names[] = {"weight", "bias", "embedding"};
  for (std::size_t k = 0; k < shapes.size(); ++k) {
    owned.names.push_back(names[k]);
    owned.values.push_back(mha_test::random_tensor<T>(shapes[k], seed + k));
    owned.grads.push_back(mha_test::random_tensor<T>(shapes[k], seed + 10 + k));
  }
  owned.make_list();
  return owned;
}

}  // namespace

TEMPLATE_TEST_CASE("Sgd follows torch.optim.SGD step by step", "[optim][reference]", float,
                   double) {
  using T = TestType;
  for (const std::string name : {"sgd", "sgd_momentum", "sgd_nesterov"}) {
    const auto file = mha::io::read_safetensors(fixture_path(name));
    REQUIRE(file.metadata.at("kind") == "sgd");
    auto owned = load_parameters<T>(file, "param.");
    mha::SgdOptions options;
    options.lr = option(file, "lr", std::nan(""));
    options.momentum = option(file, "momentum", 0.0);
    options.dampening = option(file, "dampening", 0.0);
    options.weight_decay = option(file, "weight_decay", 0.0);
    options.nesterov = flag(file, "nesterov");
    mha::Sgd<T> optimizer(owned.list, options);
    check_against_torch(name, file, owned, optimizer);
  }
}

template <class Options>
Options adam_options(const mha::io::SafetensorsFile& file) {
  Options options;
  options.lr = option(file, "lr", options.lr);
  options.beta1 = option(file, "beta1", options.beta1);
  options.beta2 = option(file, "beta2", options.beta2);
  options.eps = option(file, "eps", options.eps);
  options.weight_decay = option(file, "weight_decay", options.weight_decay);
  options.amsgrad = flag(file, "amsgrad");
  return options;
}

TEMPLATE_TEST_CASE("Adam follows torch.optim.Adam step by step", "[optim][reference]", float,
                   double) {
  using T = TestType;
  for (const std::string name : {"adam", "adam_wd_amsgrad"}) {
    const auto file = mha::io::read_safetensors(fixture_path(name));
    REQUIRE(file.metadata.at("kind") == "adam");
    auto owned = load_parameters<T>(file, "param.");
    mha::Adam<T> optimizer(owned.list, adam_options<mha::AdamOptions>(file));
    check_against_torch(name, file, owned, optimizer);
  }
}

TEMPLATE_TEST_CASE("AdamW follows torch.optim.AdamW step by step", "[optim][reference]", float,
                   double) {
  using T = TestType;
  const auto file = mha::io::read_safetensors(fixture_path("adamw"));
  REQUIRE(file.metadata.at("kind") == "adamw");
  auto owned = load_parameters<T>(file, "param.");
  mha::AdamW<T> optimizer(owned.list, adam_options<mha::AdamWOptions>(file));
  check_against_torch(std::string("adamw"), file, owned, optimizer);
}

TEMPLATE_TEST_CASE("clip_grad_norm equals torch.nn.utils.clip_grad_norm_", "[optim][reference]",
                   float, double) {
  using T = TestType;
  for (const std::string name : {"clip_norm2", "clip_norm_inf", "clip_norm3", "clip_none"}) {
    const auto file = mha::io::read_safetensors(fixture_path(name));
    REQUIRE(file.metadata.at("kind") == "clip_grad_norm");
    INFO(name << " (" << file.metadata.at("description") << ")");
    auto owned = load_parameters<T>(file, "grad.");
    // The stored gradients go into the grads; the values are irrelevant to clipping.
    for (std::size_t k = 0; k < owned.names.size(); ++k) copy_into(owned.grads[k], owned.values[k]);
    const std::vector<Tensor<T>> before = owned.grads;

    const double total = mha::clip_grad_norm(owned.list, option(file, "max_norm", 0.0),
                                             option(file, "norm_type", 2.0));
    const double expected_total =
        mha::io::to_tensor<double>(file.at("total_norm"), "total_norm")(0);
    INFO("total norm " << total << ", torch " << expected_total);
    CHECK(std::abs(total - expected_total) <=
          kNormBoundInUlps * unit_roundoff<T>() * expected_total);

    for (std::size_t k = 0; k < owned.names.size(); ++k) {
      const std::string key = "clipped." + owned.names[k];
      INFO(owned.names[k]);
      CHECK_TENSORS_CLOSE_TOL(owned.grads[k], mha::io::to_tensor<double>(file.at(key), key),
                              kClippedBoundInUlps * unit_roundoff<T>(), 0.0);
      if (!flag(file, "clipped")) {
        // Below the maximum torch multiplies by exactly 1: the gradients stay bit for bit.
        CHECK(owned.grads[k].flat() == before[k].flat());
      }
    }
  }
}

TEMPLATE_TEST_CASE("clip_grad_norm on an infinite gradient does what torch does",
                   "[optim][reference]", float, double) {
  using T = TestType;
  const auto file = mha::io::read_safetensors(fixture_path("clip_nonfinite"));
  auto owned = load_parameters<T>(file, "grad.");
  for (std::size_t k = 0; k < owned.names.size(); ++k) copy_into(owned.grads[k], owned.values[k]);

  SECTION("error_if_nonfinite refuses, naming the gradient, and leaves the gradients alone") {
    const std::vector<Tensor<T>> before = owned.grads;
    const std::string message = message_of<std::runtime_error>(
        [&] { mha::clip_grad_norm(owned.list, 1.0, 2.0, /*error_if_nonfinite=*/true); });
    INFO(message);
    CHECK(contains(message, "clip_grad_norm: the total norm of order 2 of the gradients is inf"));
    CHECK(contains(message, "'linear.bias'"));
    CHECK(contains(message, "error_if_nonfinite = false"));
    for (std::size_t k = 0; k < owned.names.size(); ++k) {
      CHECK(owned.grads[k].flat() == before[k].flat());
    }
  }
  SECTION("otherwise the gradients are scaled by 1 / inf as in torch: 0 and NaN") {
    const double total = mha::clip_grad_norm(owned.list, option(file, "max_norm", 0.0),
                                             option(file, "norm_type", 2.0));
    CHECK(total == mha::io::to_tensor<double>(file.at("total_norm"), "total_norm")(0));
    for (std::size_t k = 0; k < owned.names.size(); ++k) {
      const std::string key = "clipped." + owned.names[k];
      const auto expected = mha::io::to_tensor<double>(file.at(key), key);
      for (Index i = 0; i < expected.size(); ++i) {
        INFO(key << " element " << i);
        const double actual = static_cast<double>(owned.grads[k].data()[i]);
        if (std::isnan(expected.data()[i])) {
          CHECK(std::isnan(actual));
        } else {
          CHECK(actual == expected.data()[i]);
        }
      }
    }
  }
}

TEMPLATE_TEST_CASE("zero_grad zeroes every gradient and no value", "[optim]", float, double) {
  using T = TestType;
  auto owned = random_parameters<T>(1);
  const std::vector<Tensor<T>> values = owned.values;
  auto check_zeroed = [&] {
    for (std::size_t k = 0; k < owned.names.size(); ++k) {
      CHECK(owned.grads[k].flat().isZero(0));
      CHECK(owned.values[k].flat() == values[k].flat());
    }
  };
  mha::Sgd<T> sgd(owned.list, mha::SgdOptions{0.1, 0.9});
  sgd.zero_grad();
  check_zeroed();
  fill_random(owned, 20);
  mha::Adam<T> adam(owned.list);
  adam.zero_grad();
  check_zeroed();
  fill_random(owned, 30);
  mha::AdamW<T> adamw(owned.list);
  adamw.zero_grad();
  check_zeroed();
}

TEST_CASE("refused options throw ShapeError naming the option", "[optim]") {
  using T = double;
  auto owned = random_parameters<T>(2);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  auto sgd_error = [&](mha::SgdOptions options) {
    return message_of<mha::ShapeError>([&] { mha::Sgd<T>(owned.list, options); });
  };
  CHECK(sgd_error(mha::SgdOptions{-0.1}) == "SgdOptions.lr: must be set and >= 0, got -0.1");
  CHECK(sgd_error(mha::SgdOptions{}) == "SgdOptions.lr: must be set and >= 0, got nan");
  CHECK(contains(sgd_error(mha::SgdOptions{0.1, -0.5}), "SgdOptions.momentum: must be >= 0"));
  CHECK(contains(sgd_error(mha::SgdOptions{0.1, 0.9, nan}), "SgdOptions.dampening"));
  CHECK(contains(sgd_error(mha::SgdOptions{0.1, 0.0, 0.0, -1e-4}),
                 "SgdOptions.weight_decay: must be >= 0"));
  CHECK(sgd_error(mha::SgdOptions{0.1, 0.0, 0.0, 0.0, true}) ==
        "SgdOptions.nesterov: Nesterov momentum needs momentum > 0 and dampening 0, got momentum "
        "0 and dampening 0");
  CHECK(contains(sgd_error(mha::SgdOptions{0.1, 0.9, 0.1, 0.0, true}), "SgdOptions.nesterov"));
  // The boundaries torch accepts are accepted.
  CHECK_NOTHROW(mha::Sgd<T>(owned.list, mha::SgdOptions{0.0, 0.9, 0.0, 0.0, true}));
  CHECK_NOTHROW(mha::Sgd<T>(owned.list, mha::SgdOptions{0.1, 0.0, 2.0}));

  auto adam_error = [&](mha::AdamOptions options) {
    return message_of<mha::ShapeError>([&] { mha::Adam<T>(owned.list, options); });
  };
  auto adamw_error = [&](mha::AdamWOptions options) {
    return message_of<mha::ShapeError>([&] { mha::AdamW<T>(owned.list, options); });
  };
  mha::AdamOptions adam;
  adam.lr = -1e-3;
  CHECK(adam_error(adam) == "AdamOptions.lr: must be >= 0, got -0.001");
  adam = {};
  adam.lr = nan;
  CHECK(contains(adam_error(adam), "AdamOptions.lr"));
  adam = {};
  adam.eps = -1e-8;
  CHECK(contains(adam_error(adam), "AdamOptions.eps: must be >= 0"));
  adam = {};
  adam.beta1 = 1.0;
  CHECK(adam_error(adam) == "AdamOptions.beta1: must be in [0, 1), got 1");
  adam = {};
  adam.beta1 = -0.1;
  CHECK(contains(adam_error(adam), "AdamOptions.beta1"));
  adam = {};
  adam.beta2 = 1.0;
  CHECK(contains(adam_error(adam), "AdamOptions.beta2: must be in [0, 1)"));
  adam = {};
  adam.weight_decay = -0.01;
  CHECK(contains(adam_error(adam), "AdamOptions.weight_decay: must be >= 0"));
  adam = {};
  adam.beta1 = 0.0;
  adam.beta2 = 0.0;
  adam.eps = 0.0;
  adam.lr = 0.0;
  CHECK_NOTHROW(mha::Adam<T>(owned.list, adam));
  mha::AdamWOptions adamw;
  CHECK(adamw.weight_decay == 1e-2);  // torch.optim.AdamW's default, unlike Adam's 0
  adamw.beta2 = 1.5;
  CHECK(contains(adamw_error(adamw), "AdamWOptions.beta2: must be in [0, 1), got 1.5"));

  SECTION("set_lr checks too, and keeps the old rate when it refuses") {
    mha::Sgd<T> sgd(owned.list, mha::SgdOptions{0.1});
    CHECK_THROWS_AS(sgd.set_lr(-1.0), mha::ShapeError);
    CHECK(sgd.options().lr == 0.1);
    sgd.set_lr(0.05);
    CHECK(sgd.options().lr == 0.05);
    mha::AdamW<T> optimizer(owned.list);
    CHECK(contains(message_of<mha::ShapeError>([&] { optimizer.set_lr(nan); }), "AdamWOptions.lr"));
    CHECK(optimizer.options().lr == 1e-3);
  }
  SECTION("clip_grad_norm refuses what is not a norm or not a maximum") {
    CHECK(message_of<mha::ShapeError>([&] { mha::clip_grad_norm(owned.list, 1.0, 0.0); }) ==
          "clip_grad_norm norm_type: must be > 0 (or infinity), got 0");
    CHECK_THROWS_AS(mha::clip_grad_norm(owned.list, 1.0, -2.0), mha::ShapeError);
    CHECK_THROWS_AS(mha::clip_grad_norm(owned.list, 1.0, -std::numeric_limits<double>::infinity()),
                    mha::ShapeError);
    CHECK_THROWS_AS(mha::clip_grad_norm(owned.list, 1.0, nan), mha::ShapeError);
    CHECK(contains(message_of<mha::ShapeError>([&] { mha::clip_grad_norm(owned.list, -1.0); }),
                   "clip_grad_norm max_norm: must be >= 0, got -1"));
  }
}

TEST_CASE("parameter lists with mismatched or no tensors are refused", "[optim]") {
  using T = float;
  Tensor<T> value({3, 4}), grad({4, 3});
  CHECK(message_of<mha::ShapeError>([&] { mha::make_parameter("w", value, grad); }) ==
        "gradient of w: expected [3, 4], got [4, 3]");

  // Built by hand, bypassing make_parameter: every entry point checks the list itself.
  Tensor<T> ok_value({2}), ok_grad({2});
  ParameterList<T> list = {mha::make_parameter("ok", ok_value, ok_grad),
                           mha::ParameterRef<T>{"w", value.view(), grad.view()}};
  const std::string expected = "gradient of w: expected [3, 4], got [4, 3]";
  CHECK(message_of<mha::ShapeError>([&] { mha::Sgd<T>(list, mha::SgdOptions{0.1}); }) == expected);
  CHECK(message_of<mha::ShapeError>([&] { mha::Adam<T>{list}; }) == expected);
  CHECK(message_of<mha::ShapeError>([&] { mha::AdamW<T>{list}; }) == expected);
  CHECK(message_of<mha::ShapeError>([&] { mha::clip_grad_norm(list, 1.0); }) == expected);

  CHECK(message_of<mha::ShapeError>([&] { mha::Adam<T>(ParameterList<T>{}); }) ==
        "parameters: the list is empty, nothing to optimise");
  // Clipping nothing is fine, as in torch: the norm of no gradients is 0.
  CHECK(mha::clip_grad_norm(ParameterList<T>{}, 1.0) == 0.0);
}

TEMPLATE_TEST_CASE("parameters owned outside any layer, in a caller's buffer, are stepped",
                   "[optim]", float, double) {
  using T = TestType;
  // Two parameters packed in one caller-owned buffer, with a guard element around each.
  std::vector<T> values = {-7, 1, 2, 3, 4, 5, 6, -7, 8, 9, -7};
  std::vector<T> grads = {-7, 3, -1, 4, 1, -5, 9, -7, 2, -6, -7};
  const std::vector<T> values_before = values;
  ParameterList<T> list = {
      {"matrix", mha::make_view(values.data() + 1, {2, 3}),
       mha::make_view(grads.data() + 1, {2, 3})},
      {"vector", mha::make_view(values.data() + 8, {2}), mha::make_view(grads.data() + 8, {2})}};
  const T lr = static_cast<T>(0.25);
  mha::Sgd<T> sgd(list, mha::SgdOptions{0.25});
  sgd.step();
  for (std::size_t i = 0; i < values.size(); ++i) {
    INFO("element " << i);
    if (values_before[i] == -7) {
      CHECK(values[i] == -7);  // outside every view: untouched
      CHECK(grads[i] == -7);
    } else {
      // Plain SGD: p - lr * g; small integers times 0.25 are exact in float and double.
      CHECK(values[i] == values_before[i] + (-lr) * grads[i]);
    }
  }
  sgd.zero_grad();
  CHECK(grads == std::vector<T>{-7, 0, 0, 0, 0, 0, 0, -7, 0, 0, -7});

  // clip_grad_norm takes the list by const reference: a temporary list works as well.
  grads = {-7, 3, 0, 0, 0, 0, 0, -7, 4, 0, -7};
  const double total =
      mha::clip_grad_norm(ParameterList<T>{{"vector", mha::make_view(values.data() + 8, {2}),
                                            mha::make_view(grads.data() + 8, {2})}},
                          1.0);
  CHECK(total == 4.0);
  CHECK(grads[1] == 3);  // not in that list
}

TEMPLATE_TEST_CASE("AdamW without weight decay is Adam", "[optim]", float, double) {
  using T = TestType;
  auto a = random_parameters<T>(3);
  auto b = random_parameters<T>(3);
  mha::AdamOptions adam_options;
  adam_options.amsgrad = true;
  mha::AdamWOptions adamw_options;
  adamw_options.weight_decay = 0.0;
  adamw_options.amsgrad = true;
  mha::Adam<T> adam(a.list, adam_options);
  mha::AdamW<T> adamw(b.list, adamw_options);
  for (int step = 0; step < 4; ++step) {
    fill_random(a, 40 + 10 * static_cast<std::uint64_t>(step));
    fill_random(b, 40 + 10 * static_cast<std::uint64_t>(step));
    adam.step();
    adamw.step();
  }
  for (std::size_t k = 0; k < a.names.size(); ++k) CHECK(a.values[k].flat() == b.values[k].flat());
}

TEMPLATE_TEST_CASE("step() allocates nothing", "[optim]", float, double) {
  using T = TestType;
  auto owned = random_parameters<T>(4);
  mha::Sgd<T> sgd(owned.list, mha::SgdOptions{0.1, 0.9, 0.1, 0.01});
  mha::SgdOptions nesterov{0.1, 0.9, 0.0, 0.0, true};
  mha::Sgd<T> sgd_nesterov(owned.list, nesterov);
  mha::AdamOptions amsgrad;
  amsgrad.amsgrad = true;
  amsgrad.weight_decay = 0.01;
  mha::Adam<T> adam(owned.list, amsgrad);
  mha::AdamW<T> adamw(owned.list);

  Eigen::internal::set_is_malloc_allowed(false);
  for (int step = 0; step < 3; ++step) {
    sgd.step();
    sgd_nesterov.step();
    adam.step();
    adamw.step();
    mha::clip_grad_norm(owned.list, 0.5);
    mha::clip_grad_norm(owned.list, 0.5, std::numeric_limits<double>::infinity());
  }
  sgd.zero_grad();
  Eigen::internal::set_is_malloc_allowed(true);

  // The guard itself works: an Eigen heap allocation inside such a block is caught.
  Eigen::internal::set_is_malloc_allowed(false);
  const std::string message = message_of<std::logic_error>([] { mha::Vector<T> v(16); });
  Eigen::internal::set_is_malloc_allowed(true);
  CHECK(contains(message, "Eigen assertion failed"));
}
