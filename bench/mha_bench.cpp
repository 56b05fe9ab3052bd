// Google Benchmark suite. Names: forward/<kernel>/B:<b>/L:<l>/E:<e>/H:<h> for the whole layer,
// sdpa/<kernel>/... for the attention core alone, gemm/N:<n> for the GEMM ceiling in the same
// run. FLOPs per batch element (self-attention, L = S = n, width E): projections 8·n·E², core
// 4·n²·E; the GFLOPS counter uses these counts.
#include <benchmark/benchmark.h>

#include <mha/mha.hpp>

namespace {

mha::Tensor<float> random_tensor(const mha::Shape& shape, std::uint64_t seed) {
  mha::Random random(seed);
  mha::Tensor<float> t(shape);
  for (mha::Index i = 0; i < t.size(); ++i) t.data()[i] = static_cast<float>(random.normal());
  return t;
}

void set_flops(benchmark::State& state, double flops_per_iteration) {
  state.counters["GFLOPS"] =
      benchmark::Counter(flops_per_iteration * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void forward_reference(benchmark::State& state) {
  const mha::Index B = state.range(0), L = state.range(1), E = state.range(2), H = state.range(3);
  const mha::MultiHeadAttention<float> layer(E, H);
  const auto x = random_tensor({B, L, E}, 1);
  mha::ForwardOptions<float> options;
  options.need_weights = false;
  for (auto _ : state) {
    auto result = layer.forward(x, x, x, options);
    benchmark::DoNotOptimize(result.output.data());
  }
  const double n = static_cast<double>(L), e = static_cast<double>(E);
  set_flops(state, static_cast<double>(B) * (8 * n * e * e + 4 * n * n * e));
}

void sdpa_reference(benchmark::State& state) {
  const mha::Index B = state.range(0), L = state.range(1), E = state.range(2), H = state.range(3);
  const mha::Index D = E / H;
  const auto q = random_tensor({B, H, L, D}, 1), k = random_tensor({B, H, L, D}, 2),
             v = random_tensor({B, H, L, D}, 3);
  for (auto _ : state) {
    auto result = mha::scaled_dot_product_attention(q, k, v);
    benchmark::DoNotOptimize(result.output.data());
  }
  const double n = static_cast<double>(L), e = static_cast<double>(E);
  set_flops(state, static_cast<double>(B) * 4 * n * n * e);
}

void gemm(benchmark::State& state) {
  const mha::Index n = state.range(0);
  const mha::Matrix<float> a = random_tensor({n, n}, 1).matrix(),
                           b = random_tensor({n, n}, 2).matrix();
  mha::Matrix<float> c(n, n);
  for (auto _ : state) {
    c.noalias() = a * b;
    benchmark::DoNotOptimize(c.data());
  }
  set_flops(state, 2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n));
}

void shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"B", "L", "E", "H"});
  b->Args({1, 128, 768, 12});
  b->Args({8, 128, 512, 8});
  b->Args({1, 1024, 512, 8});
  b->Unit(benchmark::kMillisecond);
}

}  // namespace

BENCHMARK(forward_reference)->Name("forward/reference")->Apply(shapes);
BENCHMARK(sdpa_reference)->Name("sdpa/reference")->Apply(shapes);
BENCHMARK(gemm)->Name("gemm")->ArgName("N")->Arg(512)->Arg(1024)->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
