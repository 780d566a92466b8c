// firstlight paged decode attention for CPU: one query token per row attends to its keys where they lie
// in the paged pools, without gathering them first.
//
//   out[b, h] = sum_l p[l] v[slot(b, l), h / G],  p = softmax_l(scale * q[b, h] . k[slot(b, l), h / G])
//   over the keys l with mask[b, l] (all of them without a mask), G = H / Hkv query heads per KV head.
//
// The engine's gather + SDPA path copies every row's whole context into [B, Hkv, L, D] per layer per
// step, then SDPA reads it again; here each key and value vector is read once per (row, KV head), by all
// G query heads of the group. Threads: at::parallel_for over (row, KV head). A row with no visible key
// (a padding row) gets zeros.
//
// Per (row, KV head): the visible keys' row pointers first; then the scores of up to 4 query heads per key
// (each key vector loaded once for them, the sums of 4 heads reduced together) while the K and V rows 8 keys
// ahead are prefetched; a softmax per head; then the values, NQ heads x a tile of the head dimension in
// registers, each value vector loaded once for the NQ heads. 16 lanes where the build has AVX-512, 8 with
// AVX2, scalar without.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "firstlight_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

// p[0..L) = softmax(p), in place (L >= 1: the scores of the visible keys)
inline void softmax(float* p, int64_t L) {
  const float mx = *std::max_element(p, p + L);
  int64_t l = 0;
  float sum = 0.f;
#ifdef __AVX2__
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
  for (; l + 8 <= L; l += 8) {
    const __m256 e = firstlight::exp256(_mm256_sub_ps(_mm256_loadu_ps(p + l), vmx));
    _mm256_storeu_ps(p + l, e);
    acc = _mm256_add_ps(acc, e);
  }
  alignas(32) float t[8];
  _mm256_store_ps(t, acc);
  for (float v : t) sum += v;
#endif
  for (; l < L; ++l) {
    p[l] = std::exp(p[l] - mx);
    sum += p[l];
  }
  const float inv = 1.f / sum;
  for (l = 0; l < L; ++l) p[l] *= inv;
}

#ifdef __AVX2__
using firstlight::F32x8;
using firstlight::F32xWide;
using firstlight::hsum4;

constexpr int64_t kAhead = 12;  // keys prefetched ahead (K and V rows: the value pass then reads V from cache)

inline void prefetch_row(const float* r, int64_t D) {
  for (int64_t off = 0; off < D; off += 16) _mm_prefetch(reinterpret_cast<const char*>(r + off), _MM_HINT_T0);
}

// p[j * n + i] = scale * q_j . k_i for NQ query heads (rows of q, stride D) and the n keys kr[i]; D % lanes == 0.
template <class F, int NQ>
void scores(const float* q, int64_t D, const float* const* kr, const float* const* vr, int64_t n, float scale,
            float* p) {
  const __m128 vs = _mm_set1_ps(scale);
  alignas(16) float r[4];
  for (int64_t i = 0; i < std::min(n, kAhead); ++i) {
    prefetch_row(kr[i], D);
    prefetch_row(vr[i], D);
  }
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n) {
      prefetch_row(kr[i + kAhead], D);
      prefetch_row(vr[i + kAhead], D);
    }
    typename F::T a[4] = {F::zero(), F::zero(), F::zero(), F::zero()};
    const float* k = kr[i];
    for (int64_t d = 0; d < D; d += F::kLanes) {
      const typename F::T kv = F::load(k + d);
      for (int j = 0; j < NQ; ++j) a[j] = F::fma(F::load(q + j * D + d), kv, a[j]);
    }
    _mm_store_ps(r, _mm_mul_ps(vs, hsum4(F::half(a[0]), F::half(a[1]), F::half(a[2]), F::half(a[3]))));
    for (int j = 0; j < NQ; ++j) p[j * n + i] = r[j];
  }
}

// o_j[c0 .. c0 + CT vectors) = sum_i p[j * n + i] v_i for NQ heads: NQ x CT accumulators in registers, each
// value vector loaded once for the NQ heads.
template <class F, int NQ, int CT>
void values_tile(const float* p, int64_t n, const float* const* vr, int64_t c0, float* o, int64_t D) {
  typename F::T a[NQ][CT];
  for (auto& row : a)
    for (auto& x : row) x = F::zero();
  for (int64_t i = 0; i < n; ++i) {
    const float* v = vr[i] + c0;
    typename F::T vv[CT];
    for (int c = 0; c < CT; ++c) vv[c] = F::load(v + c * F::kLanes);
    for (int j = 0; j < NQ; ++j) {
      const typename F::T pj = F::set1(p[j * n + i]);
      for (int c = 0; c < CT; ++c) a[j][c] = F::fma(pj, vv[c], a[j][c]);
    }
  }
  for (int j = 0; j < NQ; ++j)
    for (int c = 0; c < CT; ++c) F::store(o + j * D + c0 + c * F::kLanes, a[j][c]);
}

template <class F, int NQ>
void values(const float* p, int64_t n, const float* const* vr, float* o, int64_t D) {
  // tiles of CT vectors while NQ x CT accumulators fit the registers (16 ymm / 32 zmm, less the loads)
  constexpr int CT = F::kLanes == 16 ? 4 : (NQ == 1 ? 8 : NQ == 2 ? 4 : NQ == 3 ? 3 : 2);
  int64_t c0 = 0;
  for (; c0 + CT * F::kLanes <= D; c0 += CT * F::kLanes) values_tile<F, NQ, CT>(p, n, vr, c0, o, D);
  for (; c0 < D; c0 += F::kLanes) values_tile<F, NQ, 1>(p, n, vr, c0, o, D);
}

template <class F>
void attend_group(const float* q, int64_t nq, int64_t D, const float* const* kr, const float* const* vr, int64_t n,
                  float scale, float* p, float* o) {
  switch (nq) {
    case 1: scores<F, 1>(q, D, kr, vr, n, scale, p); break;
    case 2: scores<F, 2>(q, D, kr, vr, n, scale, p); break;
    case 3: scores<F, 3>(q, D, kr, vr, n, scale, p); break;
    default: scores<F, 4>(q, D, kr, vr, n, scale, p); break;
  }
  for (int64_t j = 0; j < nq; ++j) softmax(p + j * n, n);
  switch (nq) {
    case 1: values<F, 1>(p, n, vr, o, D); break;
    case 2: values<F, 2>(p, n, vr, o, D); break;
    case 3: values<F, 3>(p, n, vr, o, D); break;
    default: values<F, 4>(p, n, vr, o, D); break;
  }
}
#endif

}  // namespace

void firstlight::paged_attention_rows(const float* qp, int64_t ldq, int64_t B, int64_t H, int64_t D,
                                      const float* kp, const float* vp, int64_t nslots, int64_t Hkv,
                                      const int64_t* sp, int64_t L, const bool* mp, float scale, float* op,
                                      int64_t ldo) {
  const int64_t G = H / Hkv;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> p(static_cast<size_t>(std::max<int64_t>(G, 4) * L));
    std::vector<const float*> kr(static_cast<size_t>(L)), vr(static_cast<size_t>(L));
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / Hkv, g = i % Hkv;
      const int64_t* rs = sp + b * L;
      int64_t n = 0;  // the visible keys
      for (int64_t l = 0; l < L; ++l)
        if ((mp == nullptr || mp[b * L + l]) && rs[l] >= 0 && rs[l] < nslots) {
          kr[n] = kp + (rs[l] * Hkv + g) * D;
          vr[n++] = vp + (rs[l] * Hkv + g) * D;
        }
      const float* q = qp + b * ldq + g * G * D;
      float* o = op + b * ldo + g * G * D;
      if (n == 0) {
        std::fill(o, o + G * D, 0.f);
        continue;
      }
#ifdef __AVX2__
      if (D % F32x8::kLanes == 0) {
        for (int64_t j0 = 0; j0 < G; j0 += 4) {
          const int64_t nq = std::min<int64_t>(4, G - j0);
          if (D % F32xWide::kLanes == 0)
            attend_group<F32xWide>(q + j0 * D, nq, D, kr.data(), vr.data(), n, scale, p.data(), o + j0 * D);
          else
            attend_group<F32x8>(q + j0 * D, nq, D, kr.data(), vr.data(), n, scale, p.data(), o + j0 * D);
        }
        continue;
      }
#endif
      for (int64_t j = 0; j < G; ++j) {
        float* pj = p.data() + j * n;
        for (int64_t l = 0; l < n; ++l) {
          float acc = 0.f;
          for (int64_t d = 0; d < D; ++d) acc += q[j * D + d] * kr[l][d];
          pj[l] = scale * acc;
        }
        softmax(pj, n);
        for (int64_t d = 0; d < D; ++d) {
          float acc = 0.f;
          for (int64_t l = 0; l < n; ++l) acc += pj[l] * vr[l][d];
          o[j * D + d] = acc;
        }
      }
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                  const at::Tensor& slots, const c10::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "firstlight::paged_decode_attention q must be fp32 [B, H, D]");
  TORCH_CHECK(k_pool.dim() == 3 && k_pool.scalar_type() == at::kFloat && k_pool.is_contiguous() &&
                  v_pool.sizes() == k_pool.sizes() && v_pool.scalar_type() == at::kFloat && v_pool.is_contiguous(),
              "firstlight::paged_decode_attention pools must be contiguous fp32 [slots, Hkv, D], equal shapes");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_pool.size(1);
  TORCH_CHECK(k_pool.size(2) == D && Hkv > 0 && H % Hkv == 0, "firstlight::paged_decode_attention: q ", q.sizes(),
              " does not match pools ", k_pool.sizes());
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == B && slots.scalar_type() == at::kLong,
              "firstlight::paged_decode_attention slots must be int64 [B, L]");
  const int64_t L = slots.size(1), nslots = k_pool.size(0);
  at::Tensor mk;
  if (mask.has_value()) mk = mask->to(at::kBool).reshape({B, L}).contiguous();
  const at::Tensor qc = q.contiguous(), sc = slots.contiguous();
  at::Tensor out = at::zeros({B, H, D}, q.options());
  firstlight::paged_attention_rows(qc.data_ptr<float>(), H * D, B, H, D, k_pool.data_ptr<float>(),
                                   v_pool.data_ptr<float>(), nslots, Hkv, sc.data_ptr<int64_t>(), L,
                                   mk.defined() ? mk.data_ptr<bool>() : nullptr, static_cast<float>(scale),
                                   out.data_ptr<float>(), H * D);
  return out;
}

TORCH_LIBRARY_FRAGMENT(firstlight, lib) {
  lib.def("paged_decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor slots, Tensor? mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(firstlight, CPU, lib) {
  lib.impl("paged_decode_attention", &paged_decode_attention);
}
