// firstlight categorical draw for CPU: per row, the token whose cumulative probability first exceeds a uniform
// draw (inverse CDF), from the logits directly.
//
//   w_j = exp(s (x_j - max x)) (0 where x_j = -inf: a filtered token), cum_j = sum_{i <= j} w_i in fp64,
//   pick = the first j with cum_j > u cum_V (u in [0, 1)); when rounding leaves none in the chosen block,
//   its last token with w > 0.
//
// What engine/sampler.py's inverse_cdf does over exp(logits / T - max) in torch: a copy, a division, a max,
// a subtraction, an exp, a fp64 sum and two searches, each a pass over [R, V]. Here two read-only passes per
// row: the max, then the weights block by block (256 entries, summed in fp64) and the chosen block's weights
// again, with the same code, for the scan. Threads over rows.
//
// argmax_rows: a greedy step's argmax per row, as torch.argmax (the first maximum; the first NaN where a row has
// one), 8 lanes at a time with each lane's best index, threads over rows. torch's argmax over [32, 49152] took
// ~1 ms on 2 threads here, its amax 0.04: the index tracking is its slow part.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "firstlight_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kBlock = 256;

// w[0 .. n) = exp(s * x - m) (0 for x = -inf); returns their sum in fp64
double block_weights(const float* x, int64_t n, float s, float m, float* w) {
  int64_t j = 0;
  double sum = 0.0;
#ifdef __AVX2__
  const __m256 vs = _mm256_set1_ps(s), vm = _mm256_set1_ps(m), ninf = _mm256_set1_ps(-INFINITY);
  __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
  for (; j + 8 <= n; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    __m256 e = firstlight::exp256(_mm256_fmsub_ps(vs, v, vm));
    e = _mm256_andnot_ps(_mm256_cmp_ps(v, ninf, _CMP_EQ_OQ), e);  // a filtered token weighs 0
    _mm256_storeu_ps(w + j, e);
    acc0 = _mm256_add_pd(acc0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    acc1 = _mm256_add_pd(acc1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
  }
  alignas(32) double t[4];
  _mm256_store_pd(t, _mm256_add_pd(acc0, acc1));
  sum = (t[0] + t[1]) + (t[2] + t[3]);
#endif
  for (; j < n; ++j) {
    w[j] = x[j] == -INFINITY ? 0.f : std::exp(s * x[j] - m);
    sum += w[j];
  }
  return sum;
}

float row_max(const float* x, int64_t n) {
  int64_t j = 0;
  float mx = -INFINITY;
#ifdef __AVX2__
  __m256 acc = _mm256_set1_ps(-INFINITY);
  for (; j + 8 <= n; j += 8) acc = _mm256_max_ps(acc, _mm256_loadu_ps(x + j));
  alignas(32) float t[8];
  _mm256_store_ps(t, acc);
  for (float v : t) mx = std::max(mx, v);
#endif
  for (; j < n; ++j) mx = std::max(mx, x[j]);
  return mx;
}

int64_t draw(const float* x, int64_t V, float s, double u, std::vector<double>& cum, float* w) {
  const float mx = row_max(x, V);
  if (mx == -INFINITY) return 0;  // every token filtered (the filters keep one at least): token 0
  const float m = s * mx;
  const int64_t nb = (V + kBlock - 1) / kBlock;
  cum.resize(static_cast<size_t>(nb));
  double total = 0.0;
  for (int64_t b = 0; b < nb; ++b) {
    total += block_weights(x + b * kBlock, std::min(kBlock, V - b * kBlock), s, m, w);
    cum[b] = total;
  }
  const double target = u * total;
  const int64_t b = std::min<int64_t>(std::upper_bound(cum.begin(), cum.end(), target) - cum.begin(), nb - 1);
  const int64_t n = std::min(kBlock, V - b * kBlock);
  block_weights(x + b * kBlock, n, s, m, w);
  double c = b > 0 ? cum[b - 1] : 0.0;
  int64_t last = -1;
  for (int64_t j = 0; j < n; ++j) {
    if (w[j] <= 0.f) continue;
    c += w[j];
    last = j;
    if (c > target) return b * kBlock + j;
  }
  if (last >= 0) return b * kBlock + last;  // u * total rounded up to the block's total
  for (int64_t j = b * kBlock - 1; j >= 0; --j)  // (a block of zeros only: the last token with weight before it)
    if (x[j] != -INFINITY) return j;
  return 0;
}

// index of the first maximum of x[0 .. V) (the first NaN if any: torch.argmax's order)
int64_t argmax_row(const float* x, int64_t V) {
  int64_t j = 0, best_i = 0;
  float best = V > 0 ? x[0] : 0.f;
#ifdef __AVX2__
  if (V >= 16) {  // two independent chains of 8 lanes (entries 16 i + [0, 8) and 16 i + [8, 16))
    __m256 bv[2] = {_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8)};
    __m256i bi[2] = {_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)};
    __m256 nan = _mm256_or_ps(_mm256_cmp_ps(bv[0], bv[0], _CMP_UNORD_Q), _mm256_cmp_ps(bv[1], bv[1], _CMP_UNORD_Q));
    __m256i idx[2] = {bi[0], bi[1]};
    const __m256i step = _mm256_set1_epi32(16);
    for (j = 16; j + 16 <= V; j += 16)
      for (int c = 0; c < 2; ++c) {
        const __m256 v = _mm256_loadu_ps(x + j + 8 * c);
        idx[c] = _mm256_add_epi32(idx[c], step);
        const __m256 gt = _mm256_cmp_ps(v, bv[c], _CMP_GT_OQ);  // strict: a lane keeps its first maximum
        bv[c] = _mm256_blendv_ps(bv[c], v, gt);
        bi[c] = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(bi[c]), _mm256_castsi256_ps(idx[c]), gt));
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      }
    if (_mm256_movemask_ps(nan) != 0) {
      for (int64_t i = 0; i < j; ++i)
        if (std::isnan(x[i])) return i;
    }
    alignas(32) float vals[16];
    alignas(32) int32_t ids[16];
    for (int c = 0; c < 2; ++c) {
      _mm256_store_ps(vals + 8 * c, bv[c]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(ids + 8 * c), bi[c]);
    }
    best = vals[0], best_i = ids[0];
    for (int l = 1; l < 16; ++l)  // the lanes hold different indices: the smallest among the maxima
      if (vals[l] > best || (vals[l] == best && ids[l] < best_i)) best = vals[l], best_i = ids[l];
  }
#endif
  for (; j < V; ++j) {
    if (std::isnan(x[j])) return j;
    if (x[j] > best) best = x[j], best_i = j;
  }
  return best_i;
}

}  // namespace

// One categorical draw per selected row of logits [N, V] (fp32, rows contiguous): row rows[r] scaled by
// inv_temp[r] (1 / temperature), against the uniform u[r] (fp64, in [0, 1)) -> [R] int64 token ids.
at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& rows, const at::Tensor& inv_temp,
                       const at::Tensor& u) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "firstlight::sample_rows: logits must be fp32 [N, V] with contiguous rows, got ", logits.sizes());
  const int64_t R = rows.numel(), N = logits.size(0), V = logits.size(1);
  TORCH_CHECK(rows.scalar_type() == at::kLong && inv_temp.scalar_type() == at::kFloat && inv_temp.numel() == R &&
                  u.scalar_type() == at::kDouble && u.numel() == R,
              "firstlight::sample_rows: rows int64 [R], inv_temp fp32 [R], u fp64 [R]");
  const at::Tensor rc = rows.contiguous(), tc = inv_temp.contiguous(), uc = u.contiguous();
  const int64_t* rp = rc.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(rp[r] >= 0 && rp[r] < N, "firstlight::sample_rows: row ", rp[r], " out of [0, ", N, ")");
  at::Tensor out = at::empty({R}, rows.options());
  const float* xp = logits.data_ptr<float>();
  const float* tp = tc.data_ptr<float>();
  const double* up = uc.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t ld = logits.stride(0);
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    std::vector<double> cum;
    std::vector<float> w(static_cast<size_t>(kBlock));
    for (int64_t r = r0; r < r1; ++r) op[r] = draw(xp + rp[r] * ld, V, tp[r], up[r], cum, w.data());
  });
  return out;
}

// The first maximum of each row of logits [N, V] (fp32, rows contiguous) -> [N] int64, as torch.argmax(-1).
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "firstlight::argmax_rows: logits must be fp32 [N, V] with contiguous rows, got ", logits.sizes());
  const int64_t N = logits.size(0), V = logits.size(1), ld = logits.stride(0);
  TORCH_CHECK(V > 0 && V < (int64_t{1} << 31), "firstlight::argmax_rows: V = ", V, " outside [1, 2^31)");
  at::Tensor out = at::empty({N}, logits.options().dtype(at::kLong));
  const float* xp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, N, std::max<int64_t>(1, 65536 / V), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = argmax_row(xp + r * ld, V);
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(firstlight, lib) {
  lib.def("sample_rows(Tensor logits, Tensor rows, Tensor inv_temp, Tensor u) -> Tensor");
  lib.def("argmax_rows(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(firstlight, CPU, lib) {
  lib.impl("sample_rows", &sample_rows);
  lib.impl("argmax_rows", &argmax_rows);
}
