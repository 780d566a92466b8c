// firstlight paged decode attention for CPU: one query token per row attends to its keys where they lie
// in the paged pools, without gathering them first.
//
//   out[b, h] = sum_l p[l] v[slot(b, l), h / G],  p = softmax_l(scale * q[b, h] . k[slot(b, l), h / G])
//   over the keys l with mask[b, l] (all of them without a mask), G = H / Hkv query heads per KV head.
//
// The engine's gather + SDPA path copies every row's whole context into [B, Hkv, L, D] per layer per
// step, then SDPA reads it again; here each key and value vector is read once per (row, KV head), by all
// G query heads of the group. Threads: at::parallel_for over (row, KV head). A row with no visible key
// (a padding row) gets zeros. Scalar path without AVX2.
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

#ifdef __AVX2__
inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}
#endif

// s[j] = scale * q_j . k for up to 4 query heads j < nq (rows of q, stride D)
inline void dots(const float* q, int64_t nq, const float* k, int64_t D, float scale, float* s) {
  int64_t d = 0;
  float r[4] = {0.f, 0.f, 0.f, 0.f};
#ifdef __AVX2__
  if (D % 8 == 0) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    for (; d + 16 <= D; d += 16) {  // two chains per head
      const __m256 k0 = _mm256_loadu_ps(k + d), k1 = _mm256_loadu_ps(k + d + 8);
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), k0, a0);
      b0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), k1, b0);
      if (nq > 1) a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + D + d), k0, a1);
      if (nq > 1) b1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + D + d + 8), k1, b1);
      if (nq > 2) a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 2 * D + d), k0, a2);
      if (nq > 2) b2 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 2 * D + d + 8), k1, b2);
      if (nq > 3) a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 3 * D + d), k0, a3);
      if (nq > 3) b3 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 3 * D + d + 8), k1, b3);
    }
    for (; d < D; d += 8) {
      const __m256 kv = _mm256_loadu_ps(k + d);
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), kv, a0);
      if (nq > 1) a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + D + d), kv, a1);
      if (nq > 2) a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 2 * D + d), kv, a2);
      if (nq > 3) a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 3 * D + d), kv, a3);
    }
    a0 = _mm256_add_ps(a0, b0), a1 = _mm256_add_ps(a1, b1), a2 = _mm256_add_ps(a2, b2), a3 = _mm256_add_ps(a3, b3);
    _mm_storeu_ps(r, hsum4(a0, a1, a2, a3));
  }
#endif
  for (; d < D; ++d)
    for (int64_t j = 0; j < nq; ++j) r[j] += q[j * D + d] * k[d];
  for (int64_t j = 0; j < nq; ++j) s[j] = scale * r[j];
}

// p[0..L) = softmax(p), in place; entries of -inf get 0. False when every entry is -inf.
inline bool softmax(float* p, int64_t L) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const float mx = *std::max_element(p, p + L);
  if (mx == ninf) {
    std::fill(p, p + L, 0.f);
    return false;
  }
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
  return true;
}

}  // namespace

void firstlight::paged_attention_rows(const float* qp, int64_t ldq, int64_t B, int64_t H, int64_t D,
                                      const float* kp, const float* vp, int64_t nslots, int64_t Hkv,
                                      const int64_t* sp, int64_t L, const bool* mp, float scale, float* op,
                                      int64_t ldo) {
  const int64_t G = H / Hkv;
  const float s = scale, ninf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, B * Hkv, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> p(static_cast<size_t>(G * L));
    float row[4];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / Hkv, g = i % Hkv;
      const int64_t* rs = sp + b * L;
      for (int64_t l = 0; l < L; ++l) {  // scores, p [G, L]
        if (l + 4 < L && rs[l + 4] >= 0 && rs[l + 4] < nslots) {  // the key four ahead: another block, maybe
          const char* nk = reinterpret_cast<const char*>(kp + (rs[l + 4] * Hkv + g) * D);
          for (int64_t off = 0; off < D * 4; off += 64) __builtin_prefetch(nk + off);
        }
        const bool visible = (mp == nullptr || mp[b * L + l]) && rs[l] >= 0 && rs[l] < nslots;
        const float* kv = kp + (rs[l] * Hkv + g) * D;
        for (int64_t j0 = 0; j0 < G; j0 += 4) {
          const int64_t nq = std::min<int64_t>(4, G - j0);
          if (visible) dots(qp + b * ldq + (g * G + j0) * D, nq, kv, D, s, row);
          for (int64_t j = 0; j < nq; ++j) p[(j0 + j) * L + l] = visible ? row[j] : ninf;
        }
      }
      for (int64_t j = 0; j < G; ++j) softmax(p.data() + j * L, L);
      for (int64_t j = 0; j < G; ++j) {  // out_j = sum_l p[j, l] v_l
        float* o = op + b * ldo + (g * G + j) * D;
        const float* pj = p.data() + j * L;
        int64_t d = 0;
#ifdef __AVX2__
        // 64 output lanes in 8 accumulators (independent chains), each value row read once per 64 lanes
        for (; d + 64 <= D; d += 64) {
          __m256 a[8];
          for (auto& x : a) x = _mm256_setzero_ps();
          for (int64_t l = 0; l < L; ++l) {
            if (pj[l] == 0.f) continue;
            const float* vv = vp + (rs[l] * Hkv + g) * D + d;
            const __m256 pl = _mm256_set1_ps(pj[l]);
            for (int c = 0; c < 8; ++c) a[c] = _mm256_fmadd_ps(pl, _mm256_loadu_ps(vv + 8 * c), a[c]);
          }
          for (int c = 0; c < 8; ++c) _mm256_storeu_ps(o + d + 8 * c, a[c]);
        }
        for (; d + 8 <= D; d += 8) {
          __m256 a0 = _mm256_setzero_ps();
          for (int64_t l = 0; l < L; ++l)
            if (pj[l] != 0.f)
              a0 = _mm256_fmadd_ps(_mm256_set1_ps(pj[l]), _mm256_loadu_ps(vp + (rs[l] * Hkv + g) * D + d), a0);
          _mm256_storeu_ps(o + d, a0);
        }
#endif
        for (; d < D; ++d) {
          float acc = 0.f;
          for (int64_t l = 0; l < L; ++l)
            if (pj[l] != 0.f) acc += pj[l] * vp[(rs[l] * Hkv + g) * D + d];
          o[d] = acc;
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
