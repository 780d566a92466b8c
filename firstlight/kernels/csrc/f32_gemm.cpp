// firstlight fp32 matmul for the few activation rows of a decode step on CPU:
//   y[M, N] = x[M, K] @ w[N, K]^T (+ bias), w in nn.Linear's own [N, K] layout, read in place.
//
// Why: at M = 2..32 a BLAS sgemm packs the weight into its panel layout on every call, so a decode step
// of a dense fp32 model reads and writes every weight twice more than it multiplies (SmolLM2-135M's 30
// layers, cold weights, 2 threads: MKL 9 GFLOP/s at M = 4, 28 at M = 8, against a copy-bandwidth bound
// above 50; benchmarks/f32_gemm.py). Here each weight row streams from memory once per call and stays in
// L1 while every activation row uses it.
//
// Micro-kernel: 4 output rows x MR (<= 3) activation rows, 4 * MR accumulators of 8 lanes along K (one
// x load and one weight load feed several FMAs), the four sums of a row reduced with one transpose-add.
// Threads: at::parallel_for over blocks of 4 output rows. Scalar path without AVX2. Above max_tiled_m
// rows it is at::addmm / at::mm (prefill: the BLAS's packing pays for itself there).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "firstlight_kernels.h"

#include <algorithm>
#include <cstdint>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kNR = 4;  // output rows per micro-kernel

#ifdef __AVX2__
using firstlight::hsum4;

// One weight row's 8 lanes times the MR activation rows' into their accumulators (inlined: they stay registers).
template <int MR>
inline void fma_row(__m256 wv, __m256 v0, __m256 v1, __m256 v2, __m256& a0, __m256& a1, __m256& a2) {
  a0 = _mm256_fmadd_ps(v0, wv, a0);
  if (MR > 1) a1 = _mm256_fmadd_ps(v1, wv, a1);
  if (MR > 2) a2 = _mm256_fmadd_ps(v2, wv, a2);
}

// y[r, 0..3] (+)= for r < MR: four weight rows (w, stride ldw) against MR activation rows (x, stride ldx), over K.
template <int MR>
void tile_avx2(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K, float* y, int64_t ldy,
               const float* pf, bool add) {
  // named accumulators (an array indexed in loops is kept in memory by GCC: one store per FMA)
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00,
         a13 = a00, a20 = a00, a21 = a00, a22 = a00, a23 = a00;
  const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx;
  const float *w0 = w, *w1 = w + ldw, *w2 = w + 2 * ldw, *w3 = w + 3 * ldw;
  const int64_t K8 = K & ~int64_t{7};
  for (int64_t k = 0; k < K8; k += 8) {
    if (pf != nullptr && (k & 15) == 0)  // the next block's four rows, one cache line each per two steps
      for (int n = 0; n < kNR; ++n) _mm_prefetch(reinterpret_cast<const char*>(pf + n * ldw + k), _MM_HINT_T0);
    const __m256 v0 = _mm256_loadu_ps(x0 + k);
    const __m256 v1 = MR > 1 ? _mm256_loadu_ps(x1 + k) : v0;
    const __m256 v2 = MR > 2 ? _mm256_loadu_ps(x2 + k) : v0;
    fma_row<MR>(_mm256_loadu_ps(w0 + k), v0, v1, v2, a00, a10, a20);
    fma_row<MR>(_mm256_loadu_ps(w1 + k), v0, v1, v2, a01, a11, a21);
    fma_row<MR>(_mm256_loadu_ps(w2 + k), v0, v1, v2, a02, a12, a22);
    fma_row<MR>(_mm256_loadu_ps(w3 + k), v0, v1, v2, a03, a13, a23);
  }
  const __m128 sums[3] = {hsum4(a00, a01, a02, a03), hsum4(a10, a11, a12, a13), hsum4(a20, a21, a22, a23)};
  for (int r = 0; r < MR; ++r) {
    alignas(16) float s[kNR];
    _mm_store_ps(s, sums[r]);
    for (int64_t k = K8; k < K; ++k)
      for (int n = 0; n < kNR; ++n) s[n] += x[r * ldx + k] * w[n * ldw + k];
    for (int n = 0; n < kNR; ++n) y[r * ldy + n] = add ? y[r * ldy + n] + s[n] : s[n];
  }
}
#endif

// Portable path, and the last N % 4 output rows: one output row against MR activation rows.
template <int MR>
void tile_scalar(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K, float* y, int64_t ldy,
                 int64_t nr, bool add) {
  for (int64_t n = 0; n < nr; ++n)
    for (int r = 0; r < MR; ++r) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += x[r * ldx + k] * w[n * ldw + k];
      y[r * ldy + n] = add ? y[r * ldy + n] + s : s;
    }
}

template <int MR>
void tile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K, float* y, int64_t ldy, int64_t nr,
          const float* pf, bool add) {
#ifdef __AVX2__
  if (nr == kNR) return tile_avx2<MR>(x, ldx, w, ldw, K, y, ldy, pf, add);
#endif
  tile_scalar<MR>(x, ldx, w, ldw, K, y, ldy, nr, add);
}

}  // namespace

void firstlight::f32_block(const float* x, int64_t ldx, int64_t M, const float* w, int64_t ldw, int64_t K, float* y,
                           int64_t ldy, int64_t nr, bool add, const float* pf) {
  // the first activation tile streams the block from memory (and prefetches pf); the others find it in L1
  const int64_t mr = M % 3 == 0 ? 3 : M % 3;
  if (mr == 3) tile<3>(x, ldx, w, ldw, K, y, ldy, nr, pf, add);
  if (mr == 2) tile<2>(x, ldx, w, ldw, K, y, ldy, nr, pf, add);
  if (mr == 1) tile<1>(x, ldx, w, ldw, K, y, ldy, nr, pf, add);
  for (int64_t r = mr; r < M; r += 3) tile<3>(x + r * ldx, ldx, w, ldw, K, y + r * ldy, ldy, nr, nullptr, add);
}

at::Tensor f32_mm(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                  int64_t max_tiled_m) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous(),
              "firstlight::f32_mm w must be contiguous fp32 [N, K], got ", w.scalar_type(), " ", w.sizes());
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "firstlight::f32_mm x must be [M, ", K, "], got ", x.sizes());
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t M = xf.size(0);
  if (M > max_tiled_m)
    return bias.has_value() ? at::addmm(bias->to(at::kFloat), xf, w.t()) : at::mm(xf, w.t());
  at::Tensor y = at::empty({M, N}, xf.options());
  if (M == 0) return y;
  const float* xp = xf.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t nblocks = (N + kNR - 1) / kNR;
  at::parallel_for(0, nblocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * kNR, nr = std::min(kNR, N - n);
      const float* wb = wp + n * K;
      firstlight::f32_block(xp, K, M, wb, K, K, yp + n, N, nr, false, n + 2 * kNR <= N ? wb + kNR * K : nullptr);
    }
  });
  if (bias.has_value()) y.add_(bias->to(at::kFloat));
  return y;
}

TORCH_LIBRARY_FRAGMENT(firstlight, lib) {
  lib.def("f32_mm(Tensor x, Tensor w, Tensor? bias, int max_tiled_m) -> Tensor");
}

TORCH_LIBRARY_IMPL(firstlight, CPU, lib) {
  lib.impl("f32_mm", &f32_mm);
}
