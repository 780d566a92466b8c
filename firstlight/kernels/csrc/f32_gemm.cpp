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
//
// f32_mm_packed: the same product on a copy of w packed once into panels of 32 output columns, [ceil(N / 32), K, 32]
// (f32_pack), for AVX-512 builds at every M. Outer-product micro-kernel: up to 12 activation rows x 32 columns
// (24 accumulators of 16 lanes, two weight loads and one broadcast per k for 24 FMAs, no horizontal sums), the
// rows of a panel in balanced blocks of <= 12 while the panel stays in L1/L2, the next panel prefetched line by
// line during the first block (a decode step's weights are cold: without it each panel's first pass stalls on
// memory), threads over panels, activation rows in chunks of 192 so a prefill's rows stay in L2 across panels.
// SmolLM2-135M's 121 linears, cold, 2 threads: M = 32 28.8 ms vs oneDNN's 39.7 on its reordered weight, M = 8
// 12.8 vs 22.3, M = 1 15.5 vs f32_mm's 19.7 (benchmarks/f32_gemm.py); at 512 rows it ties oneDNN (a whole prefill
// over the model's layers: ~6 % slower), so its copy replaces oneDNN's on AVX-512 builds (quant/f32.py).
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

// ---- packed panels (f32_pack / f32_mm_packed) ----
constexpr int64_t kPanel = 32;   // output columns per panel: two 16-lane vectors
constexpr int64_t kPanelMR = 12; // activation rows per micro-kernel at most (2 x 12 accumulators)
constexpr int64_t kPanelMC = 192;  // activation rows per chunk (a chunk's rows stay in L2 while panels pass)

#ifdef __AVX512F__
// y[r, 0..nr) = x[r, :] . panel columns (+ bias) for r < MR, over K; pf: the next panel, prefetched meanwhile
template <int MR>
void panel_tile(const float* __restrict x, int64_t ldx, const float* __restrict b, int64_t K, float* y, int64_t ldy,
                int64_t nr, const float* bias, const float* pf) {
  __m512 c0[MR], c1[MR];  // fully unrolled: registers
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) c0[r] = c1[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    if (pf != nullptr) {  // the next panel's two lines of this k: it arrives while this one computes
      _mm_prefetch(reinterpret_cast<const char*>(pf + k * kPanel), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(pf + k * kPanel + 16), _MM_HINT_T0);
    }
    const __m512 b0 = _mm512_loadu_ps(b + k * kPanel), b1 = _mm512_loadu_ps(b + k * kPanel + 16);
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * ldx + k]);
      c0[r] = _mm512_fmadd_ps(a, b0, c0[r]);
      c1[r] = _mm512_fmadd_ps(a, b1, c1[r]);
    }
  }
  const __mmask16 m0 = nr >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << nr) - 1);
  const __mmask16 m1 = nr <= 16 ? 0 : nr >= 32 ? 0xFFFF : static_cast<__mmask16>((1u << (nr - 16)) - 1);
  const __m512 bias0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
  const __m512 bias1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) {
    _mm512_mask_storeu_ps(y + r * ldy, m0, _mm512_add_ps(c0[r], bias0));
    _mm512_mask_storeu_ps(y + r * ldy + 16, m1, _mm512_add_ps(c1[r], bias1));
  }
}

// rows [0, M) of one panel in balanced blocks of <= kPanelMR (32 rows: 11 + 11 + 10); the first block prefetches pf
void panel_rows(const float* x, int64_t ldx, int64_t M, const float* b, int64_t K, float* y, int64_t ldy, int64_t nr,
                const float* bias, const float* pf) {
  const int64_t blocks = (M + kPanelMR - 1) / kPanelMR;
  for (int64_t i = 0, m0 = 0; i < blocks; ++i) {
    const int64_t mr = (M - m0 + blocks - i - 1) / (blocks - i);
    const float* xm = x + m0 * ldx;
    float* ym = y + m0 * ldy;
    const float* p = i == 0 ? pf : nullptr;
    switch (mr) {
#define FIRSTLIGHT_TILE(R) \
  case R: panel_tile<R>(xm, ldx, b, K, ym, ldy, nr, bias, p); break;
      FIRSTLIGHT_TILE(12) FIRSTLIGHT_TILE(11) FIRSTLIGHT_TILE(10) FIRSTLIGHT_TILE(9) FIRSTLIGHT_TILE(8)
      FIRSTLIGHT_TILE(7) FIRSTLIGHT_TILE(6) FIRSTLIGHT_TILE(5) FIRSTLIGHT_TILE(4) FIRSTLIGHT_TILE(3)
      FIRSTLIGHT_TILE(2) FIRSTLIGHT_TILE(1)
#undef FIRSTLIGHT_TILE
    }
    m0 += mr;
  }
}
#else
// portable path (builds without AVX-512 do not prefer the packed layout; their tests still run it)
void panel_rows(const float* x, int64_t ldx, int64_t M, const float* b, int64_t K, float* y, int64_t ldy, int64_t nr,
                const float* bias, const float*) {
  for (int64_t r = 0; r < M; ++r) {
    float acc[kPanel] = {};
    for (int64_t k = 0; k < K; ++k)
      for (int64_t j = 0; j < kPanel; ++j) acc[j] += x[r * ldx + k] * b[k * kPanel + j];
    for (int64_t j = 0; j < nr; ++j) y[r * ldy + j] = acc[j] + (bias ? bias[j] : 0.f);
  }
}
#endif
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

at::Tensor f32_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat,
              "firstlight::f32_pack w must be fp32 [N, K], got ", w.scalar_type(), " ", w.sizes());
  const int64_t N = w.size(0), K = w.size(1), P = (N + kPanel - 1) / kPanel;
  at::Tensor padded = at::zeros({P * kPanel, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({P, kPanel, K}).transpose(1, 2).contiguous();  // [P, K, 32]: panel p, input k, column
}

at::Tensor f32_mm_packed(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                         const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.scalar_type() == at::kFloat &&
                  packed.is_contiguous() && packed.size(0) == (N + kPanel - 1) / kPanel,
              "firstlight::f32_mm_packed packed must be f32_pack's [ceil(", N, " / 32), K, 32], got ",
              packed.scalar_type(), " ", packed.sizes());
  const int64_t K = packed.size(1), P = packed.size(0);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "firstlight::f32_mm_packed x must be [M, ", K, "], got ", x.sizes());
  at::Tensor bf;
  if (bias.has_value()) {
    bf = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bf.numel() == N, "firstlight::f32_mm_packed bias must have ", N, " elements, got ", bf.numel());
  }
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t M = xf.size(0);
  at::Tensor y = at::empty({M, N}, xf.options());
  if (M == 0 || N == 0) return y;
  const float* xp = xf.data_ptr<float>();
  const float* bp = packed.data_ptr<float>();
  const float* biasp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t m0 = 0; m0 < M; m0 += kPanelMC) {
      const int64_t mc = std::min(kPanelMC, M - m0);
      for (int64_t p = p0; p < p1; ++p) {
        const float* next = p + 1 < p1 ? bp + (p + 1) * K * kPanel : nullptr;
        panel_rows(xp + m0 * K, K, mc, bp + p * K * kPanel, K, yp + m0 * N + p * kPanel, N,
                   std::min(kPanel, N - p * kPanel), biasp ? biasp + p * kPanel : nullptr, next);
      }
    }
  });
  return y;
}

TORCH_LIBRARY_FRAGMENT(firstlight, lib) {
  lib.def("f32_mm(Tensor x, Tensor w, Tensor? bias, int max_tiled_m) -> Tensor");
  lib.def("f32_pack(Tensor w) -> Tensor");
  lib.def("f32_mm_packed(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(firstlight, CPU, lib) {
  lib.impl("f32_mm", &f32_mm);
  lib.impl("f32_pack", &f32_pack);
  lib.impl("f32_mm_packed", &f32_mm_packed);
}
