// The fp32 GEMMs the library could use, side by side on the layer's shapes: C [M, N] = A [M, K] ·
// B [N, K]ᵀ (x Wᵀ, as the projections), row-major. Candidates: Eigen 3.4 (8 row slabs, each a
// serial product, as kernels/gemm.hpp ran it before the packed GEMM), Debian's OpenBLAS 0.3.21
// and oneDNN 2.6 (each threaded by itself, and each as 8 serial slabs inside OpenMP, which keeps
// results independent of the thread count), and the library's packed GEMM (kernels/gemm.hpp's
// threaded_product over kernels/packed_gemm.hpp). Medians of 7 runs, GFLOP/s.
//
// Not part of the build (it needs libopenblas-dev and libdnnl-dev, which the library does not):
//   g++ -std=c++17 -O3 -march=native -fopenmp -Iinclude -isystem /usr/include/eigen3
//       bench/gemm_candidates.cpp -o /tmp/gemm_candidates -lopenblas -ldnnl   (one line)
//   OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2 /tmp/gemm_candidates
// (State OPENBLAS_CORETYPE with the figures: set to Haswell, it gives OpenBLAS its AVX2 kernels on
// an AVX-512 CPU.)
#include <cblas.h>
#include <dnnl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include <mha/kernels/gemm.hpp>

using RowMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

template <class F>
double median_ms(F&& f) {
  f();
  std::vector<double> times;
  for (int r = 0; r < 7; ++r) {
    const auto start = std::chrono::steady_clock::now();
    f();
    times.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
            .count());
  }
  std::sort(times.begin(), times.end());
  return times[3];
}

// Runs slab(first_row, rows) over 8 row slabs in an OpenMP loop.
template <class Slab>
void in_slabs(int rows, Slab&& slab) {
  constexpr int kSlabs = 8;
  const int width = (rows + kSlabs - 1) / kSlabs;
#pragma omp parallel for schedule(static)
  for (int i = 0; i < kSlabs; ++i) {
    const int first = i * width, count = std::min(width, rows - first);
    if (count > 0) slab(first, count);
  }
}

int main() {
  struct Shape {
    int m, n, k;
  };
  const Shape shapes[] = {{2048, 2048, 2048}, {1024, 1024, 1024}, {2048, 512, 512},
                          {2048, 1536, 512},  {128, 2304, 768},   {4096, 512, 512},
                          {2048, 1024, 1024}, {512, 3072, 1024}};
  std::printf(
      "| M | N | K | Eigen, 8 slabs | OpenBLAS | OpenBLAS, 8 slabs | oneDNN | oneDNN, "
      "8 slabs | packed (mha) |\n|---|---|---|---|---|---|---|---|---|\n");
  for (const Shape s : shapes) {
    const RowMajor a = RowMajor::Random(s.m, s.k), b = RowMajor::Random(s.n, s.k);
    RowMajor c(s.m, s.n);
    const double gflop = 2e-6 * s.m * s.n * s.k;  // per ms
    const double eigen = median_ms([&] {
      in_slabs(s.m, [&](int first, int count) {
        c.middleRows(first, count).noalias() = a.middleRows(first, count) * b.transpose();
      });
    });
    const double blas = median_ms([&] {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, s.m, s.n, s.k, 1.F, a.data(), s.k,
                  b.data(), s.k, 0.F, c.data(), s.n);
    });
    const int blas_threads = openblas_get_num_threads();
    openblas_set_num_threads(1);
    const double blas_slabs = median_ms([&] {
      in_slabs(s.m, [&](int first, int count) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, count, s.n, s.k, 1.F,
                    a.data() + first * s.k, s.k, b.data(), s.k, 0.F, c.data() + first * s.n, s.n);
      });
    });
    openblas_set_num_threads(blas_threads);
    const double dnnl = median_ms([&] {
      dnnl_sgemm('N', 'T', s.m, s.n, s.k, 1.F, a.data(), s.k, b.data(), s.k, 0.F, c.data(), s.n);
    });
    const double dnnl_slabs = median_ms([&] {
      in_slabs(s.m, [&](int first, int count) {
        dnnl_sgemm('N', 'T', count, s.n, s.k, 1.F, a.data() + first * s.k, s.k, b.data(), s.k, 0.F,
                   c.data() + first * s.n, s.n);
      });
    });
    std::vector<mha::detail::KernelScratch<float>> scratch;
    const Eigen::Map<const mha::Matrix<float>> weight(b.data(), s.n, s.k);
    const double packed = median_ms([&] {
      mha::detail::product_transposed<float, float>(mha::detail::strided(c),
                                                    mha::detail::const_strided(a), weight,
                                                    mha::detail::Accumulate::no, scratch);
    });
    std::printf("| %d | %d | %d | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f |\n", s.m, s.n, s.k,
                gflop / eigen, gflop / blas, gflop / blas_slabs, gflop / dnnl, gflop / dnnl_slabs,
                gflop / packed);
  }
}
