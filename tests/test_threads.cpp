// One layer shared by several threads: const calls (forward with each kernel, weights or not,
// decode into per-thread caches, a 16-bit layer) made at the same time give exactly the results
// of the same calls made one after the other. CI runs this under ThreadSanitizer (built without
// OpenMP, whose runtime TSan cannot see into), where a data race fails the test.
#include <thread>
#include <vector>

#include "helpers.hpp"

using mha::Index;
using mha::Kernel;
using mha::MultiHeadAttention;
using mha::Tensor;

namespace {

constexpr Index kEmbed = 32, kHeads = 4, kBatch = 2, kLength = 24;
constexpr int kThreads = 4, kRepeats = 3;

struct Outputs {
  Tensor<float> flash, reference, weights, decoded;
  Tensor<Eigen::half> half;
};

// What thread `t` computes: inputs of its own, so that a result that leaked between threads
// would differ from the serial one.
Outputs run(const MultiHeadAttention<float>& layer, const MultiHeadAttention<Eigen::half>& half,
            int t) {
  const auto seed = static_cast<std::uint64_t>(100 + t);
  const auto x = mha_test::random_tensor<float>({kBatch, kLength, kEmbed}, seed);
  Outputs outputs;
  mha::ForwardOptions<float> options;
  options.is_causal = t % 2 == 0;
  options.need_weights = false;
  options.kernel = Kernel::flash;
  mha::Workspace<float> workspace;  // one per thread, as Workspace's comment asks
  mha::ForwardResult<float> result;
  layer.forward(x.view(), x.view(), x.view(), options, workspace, result);
  outputs.flash = result.output;
  options.kernel = Kernel::reference;
  outputs.reference = layer.forward(x.view(), options).output;
  options.need_weights = true;
  options.average_attn_weights = false;
  outputs.weights = layer.forward(x.view(), options).attn_weights;

  auto cache = layer.make_kv_cache(kBatch, kLength);
  outputs.decoded = Tensor<float>({kBatch, kLength, kEmbed});
  for (Index i = 0; i < kLength; ++i) {
    Tensor<float> token({kBatch, 1, kEmbed});
    for (Index b = 0; b < kBatch; ++b) {
      std::copy_n(x.data() + (b * kLength + i) * kEmbed, kEmbed, token.data() + b * kEmbed);
    }
    const auto step = layer.decode(token.view(), cache);
    for (Index b = 0; b < kBatch; ++b) {
      std::copy_n(step.output.data() + b * kEmbed, kEmbed,
                  outputs.decoded.data() + (b * kLength + i) * kEmbed);
    }
  }

  mha::ForwardOptions<Eigen::half> half_options;
  half_options.need_weights = false;
  outputs.half = half.forward(mha::tensor_cast<Eigen::half>(x).view(), half_options).output;
  return outputs;
}

template <class T>
bool identical(const Tensor<T>& a, const Tensor<T>& b) {
  if (a.shape() != b.shape()) return false;
  for (Index i = 0; i < a.size(); ++i) {
    if (!(a.data()[i] == b.data()[i])) return false;
  }
  return true;
}

}  // namespace

TEST_CASE("const calls on one layer from several threads equal serial calls", "[threads]") {
  MultiHeadAttention<float> layer(kEmbed, kHeads);
  mha_test::randomise(layer, 7);
  MultiHeadAttention<Eigen::half> half(kEmbed, kHeads);
  for (const auto& entry : layer.state_dict()) {
    half.set_parameter(entry.first, mha::tensor_cast<Eigen::half>(entry.second).view());
  }

  std::vector<Outputs> serial;
  for (int t = 0; t < kThreads; ++t) serial.push_back(run(layer, half, t));

  for (int repeat = 0; repeat < kRepeats; ++repeat) {
    std::vector<Outputs> parallel(kThreads);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] { parallel[static_cast<std::size_t>(t)] = run(layer, half, t); });
    }
    for (auto& thread : threads) thread.join();
    for (std::size_t t = 0; t < serial.size(); ++t) {
      INFO("repeat " << repeat << ", thread " << t);
      CHECK(identical(parallel[t].flash, serial[t].flash));
      CHECK(identical(parallel[t].reference, serial[t].reference));
      CHECK(identical(parallel[t].weights, serial[t].weights));
      CHECK(identical(parallel[t].decoded, serial[t].decoded));
      CHECK(identical(parallel[t].half, serial[t].half));
    }
  }
}
