// firstlight attention kernels for CPU. First, paged decode attention: one query token per row attends to its
// keys where they lie in the paged pools, without gathering them first (below; prefill attention over gathered
// keys, `attention`, is the second half of this file).
//
//   out[b, h] = sum_l p[l] v[slot(b, l), h / G],  p = softmax_l(scale * q[b, h] . k[slot(b, l), h / G])
//   over the keys l with mask[b, l] (all of them without a mask), G = H / Hkv query heads per KV head.
//
// The engine's gather + SDPA path copies every row's whole context into [B, Hkv, L, D] per layer per
// step, then SDPA reads it again; here each key and value vector is read once per (row, KV head), by all
// G query heads of the group. Threads: at::parallel_for over (row, KV head); with fewer such pairs than two
// per thread (a single stream: SmolLM2's 3 KV heads on 2 threads ran 2 : 1), over (row, KV head, chunk of its
// keys), each chunk's unnormalized sums merged after, as flash-decoding does. A row with no visible key (a
// padding row) gets zeros.
//
// Per (row, KV head): the visible keys' row pointers first; then the scores of up to 4 query heads for two keys
// at a time (each key vector loaded once for them, 2 x 4 independent FMA chains, the sums of 4 heads reduced
// together) while the K and V rows 12 keys ahead (24 in 16-bit pools) are prefetched; exp(score - max) per
// head; then the values, NQ heads x a tile of the head dimension in registers, each value vector loaded once
// for the NQ heads, scaled by 1 / the sum at the end. 16 lanes where the build has AVX-512, 8 with
// AVX2, scalar without. The pools hold fp32, bf16 or fp16 (`kv_cache_dtype`): a key or value vector is widened
// to fp32 as it is loaded (a shift for bf16, F16C's conversion for fp16), the arithmetic is fp32 either way.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "firstlight_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <vector>

namespace {

#ifdef __AVX2__
// p[0..L) = exp(p - max) on F's vectors (L >= F::kLanes), in place; returns the sum, the max in *mx
template <class F>
float exp_sum_vec(float* p, int64_t L, float* mx_out) {
  constexpr int64_t W = F::kLanes;
  int64_t l = W;
  typename F::T v = F::load(p);
  for (; l + W <= L; l += W) v = F::max(v, F::load(p + l));
  float mx = F::reduce_max(v);
  for (; l < L; ++l) mx = std::max(mx, p[l]);
  v = F::set1(mx);
  typename F::T acc = F::zero();
  for (l = 0; l + W <= L; l += W) {
    const typename F::T e = F::exp(F::sub(F::load(p + l), v));
    F::store(p + l, e);
    acc = F::add(acc, e);
  }
  float sum = F::reduce_add(acc);
  for (; l < L; ++l) {
    p[l] = std::exp(p[l] - mx);
    sum += p[l];
  }
  *mx_out = mx;
  return sum;
}

#endif

// p[0..L) = exp(p - max), in place (L >= 1); returns the sum, the max in *mx (softmax = p / the sum)
inline float exp_sum(float* p, int64_t L, float* mx) {
#ifdef __AVX2__
  if (L >= firstlight::F32xWide::kLanes) return exp_sum_vec<firstlight::F32xWide>(p, L, mx);
  if (L >= firstlight::F32x8::kLanes) return exp_sum_vec<firstlight::F32x8>(p, L, mx);
#endif
  *mx = *std::max_element(p, p + L);
  float sum = 0.f;
  for (int64_t l = 0; l < L; ++l) {
    p[l] = std::exp(p[l] - *mx);
    sum += p[l];
  }
  return sum;
}

// p[0..L) = softmax(p), in place (L >= 1: the scores of the visible keys)
inline void softmax(float* p, int64_t L) {
  float mx;
  const float inv = 1.f / exp_sum(p, L, &mx);
  for (int64_t l = 0; l < L; ++l) p[l] *= inv;
}

#ifdef __AVX2__
using firstlight::F32x8;
using firstlight::F32xWide;
using firstlight::hsum4;

// keys prefetched ahead (K and V rows: the value pass then reads V from cache): 12 fp32 rows, and as many bytes of
// 16-bit rows (24; measured at 12 / 24 / 36 / 48 keys, 16 rows x 1024 keys: 17.2 / 14.5 / 15.2 / 15.4 ms)
template <class E>
constexpr int64_t kAhead = 12 * 4 / static_cast<int64_t>(sizeof(E));

template <class E>
inline void prefetch_row(const E* r, int64_t D) {
  const char* c = reinterpret_cast<const char*>(r);
  for (int64_t off = 0; off < D * static_cast<int64_t>(sizeof(E)); off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}

// F's vector of fp32 from F::kLanes K/V elements of type E (fp32, bf16 or fp16)
template <class F>
inline typename F::T load_kv(const float* p) {
  return F::load(p);
}
template <class F>
inline typename F::T load_kv(const c10::BFloat16* p) {
  return F::load_bf16(p);
}
template <class F>
inline typename F::T load_kv(const c10::Half* p) {
  return F::load_f16(p);
}

// p[j * n + i] = scale * q_j . k_i for NQ query heads (rows of q, stride D) and the n keys kr[i]; D % lanes == 0.
// Two keys at a time: 2 x NQ independent accumulators (one key's NQ chains of D / lanes dependent FMAs left the
// FMA units idle: the latency, not the throughput, set the pace).
template <class F, int NQ, class E>
void scores(const float* q, int64_t D, const E* const* kr, const E* const* vr, int64_t n, float scale, float* p) {
  const __m128 vs = _mm_set1_ps(scale);
  alignas(16) float r[4];
  constexpr int64_t kAh = kAhead<E>;
  for (int64_t i = 0; i < std::min(n, kAh); ++i) {
    prefetch_row(kr[i], D);
    prefetch_row(vr[i], D);
  }
  auto store = [&](__m128 sums, int64_t i) {
    _mm_store_ps(r, _mm_mul_ps(vs, sums));
    for (int j = 0; j < NQ; ++j) p[j * n + i] = r[j];
  };
  int64_t i = 0;
  for (; i + 2 <= n; i += 2) {
    for (int64_t ahead = i + kAh; ahead < std::min(n, i + kAh + 2); ++ahead) {
      prefetch_row(kr[ahead], D);
      prefetch_row(vr[ahead], D);
    }
    typename F::T a[4] = {F::zero(), F::zero(), F::zero(), F::zero()}, b[4] = {a[0], a[0], a[0], a[0]};
    const E *k0 = kr[i], *k1 = kr[i + 1];
    for (int64_t d = 0; d < D; d += F::kLanes) {
      const typename F::T kv0 = load_kv<F>(k0 + d), kv1 = load_kv<F>(k1 + d);
      for (int j = 0; j < NQ; ++j) {
        const typename F::T qv = F::load(q + j * D + d);
        a[j] = F::fma(qv, kv0, a[j]);
        b[j] = F::fma(qv, kv1, b[j]);
      }
    }
    store(hsum4(F::half(a[0]), F::half(a[1]), F::half(a[2]), F::half(a[3])), i);
    store(hsum4(F::half(b[0]), F::half(b[1]), F::half(b[2]), F::half(b[3])), i + 1);
  }
  if (i < n) {
    typename F::T a[4] = {F::zero(), F::zero(), F::zero(), F::zero()};
    for (int64_t d = 0; d < D; d += F::kLanes) {
      const typename F::T kv = load_kv<F>(kr[i] + d);
      for (int j = 0; j < NQ; ++j) a[j] = F::fma(F::load(q + j * D + d), kv, a[j]);
    }
    store(hsum4(F::half(a[0]), F::half(a[1]), F::half(a[2]), F::half(a[3])), i);
  }
}

// o_j[c0 .. c0 + CT vectors) = sum_i p[j * n + i] v_i for NQ heads: NQ x CT accumulators in registers, each
// value vector loaded once for the NQ heads.
template <class F, int NQ, int CT, class E>
void values_tile(const float* p, int64_t n, const E* const* vr, int64_t c0, float* o, int64_t D) {
  typename F::T a[NQ][CT];
  for (auto& row : a)
    for (auto& x : row) x = F::zero();
  for (int64_t i = 0; i < n; ++i) {
    const E* v = vr[i] + c0;
    typename F::T vv[CT];
    for (int c = 0; c < CT; ++c) vv[c] = load_kv<F>(v + c * F::kLanes);
    for (int j = 0; j < NQ; ++j) {
      const typename F::T pj = F::set1(p[j * n + i]);
      for (int c = 0; c < CT; ++c) a[j][c] = F::fma(pj, vv[c], a[j][c]);
    }
  }
  for (int j = 0; j < NQ; ++j)
    for (int c = 0; c < CT; ++c) F::store(o + j * D + c0 + c * F::kLanes, a[j][c]);
}

template <class F, int NQ, class E>
void values(const float* p, int64_t n, const E* const* vr, float* o, int64_t D) {
  // tiles of CT vectors while NQ x CT accumulators fit the registers (16 ymm / 32 zmm, less the loads)
  constexpr int CT = F::kLanes == 16 ? 4 : (NQ == 1 ? 8 : NQ == 2 ? 4 : NQ == 3 ? 3 : 2);
  int64_t c0 = 0;
  for (; c0 + CT * F::kLanes <= D; c0 += CT * F::kLanes) values_tile<F, NQ, CT, E>(p, n, vr, c0, o, D);
  for (; c0 < D; c0 += F::kLanes) values_tile<F, NQ, 1, E>(p, n, vr, c0, o, D);
}

// o_j = sum_i exp(s_ji - mx_j) v_i (not normalized) for nq <= 4 heads; mx[j], sum[j]: the max and the sum of
// those weights (softmax = the weights / sum)
template <class F, class E>
void attend_group(const float* q, int64_t nq, int64_t D, const E* const* kr, const E* const* vr, int64_t n,
                  float scale, float* p, float* o, float* mx, float* sum) {
  switch (nq) {
    case 1: scores<F, 1, E>(q, D, kr, vr, n, scale, p); break;
    case 2: scores<F, 2, E>(q, D, kr, vr, n, scale, p); break;
    case 3: scores<F, 3, E>(q, D, kr, vr, n, scale, p); break;
    default: scores<F, 4, E>(q, D, kr, vr, n, scale, p); break;
  }
  for (int64_t j = 0; j < nq; ++j) sum[j] = exp_sum(p + j * n, n, mx + j);
  switch (nq) {
    case 1: values<F, 1, E>(p, n, vr, o, D); break;
    case 2: values<F, 2, E>(p, n, vr, o, D); break;
    case 3: values<F, 3, E>(p, n, vr, o, D); break;
    default: values<F, 4, E>(p, n, vr, o, D); break;
  }
}
#endif

}  // namespace

namespace {

// The G heads of one (row, KV head) over its n visible keys kr / vr: o [G, D] = sum_i exp(s_i - mx) v_i per head,
// not normalized; mx, sum [G] (sum 0 and o 0 where n is 0)
template <class E>
void attend_keys(const float* q, int64_t G, int64_t D, const E* const* kr, const E* const* vr, int64_t n, float scale,
                 float* p, float* o, float* mx, float* sum) {
  if (n == 0) {
    std::fill(o, o + G * D, 0.f);
    std::fill(mx, mx + G, -INFINITY);
    std::fill(sum, sum + G, 0.f);
    return;
  }
#ifdef __AVX2__
  if (D % F32x8::kLanes == 0) {
    for (int64_t j0 = 0; j0 < G; j0 += 4) {
      const int64_t nq = std::min<int64_t>(4, G - j0);
      if (D % F32xWide::kLanes == 0)
        attend_group<F32xWide, E>(q + j0 * D, nq, D, kr, vr, n, scale, p, o + j0 * D, mx + j0, sum + j0);
      else
        attend_group<F32x8, E>(q + j0 * D, nq, D, kr, vr, n, scale, p, o + j0 * D, mx + j0, sum + j0);
    }
    return;
  }
#endif
  for (int64_t j = 0; j < G; ++j) {
    for (int64_t l = 0; l < n; ++l) {
      float acc = 0.f;
      for (int64_t d = 0; d < D; ++d) acc += q[j * D + d] * static_cast<float>(kr[l][d]);
      p[l] = scale * acc;
    }
    sum[j] = exp_sum(p, n, mx + j);
    for (int64_t d = 0; d < D; ++d) {
      float acc = 0.f;
      for (int64_t l = 0; l < n; ++l) acc += p[l] * static_cast<float>(vr[l][d]);
      o[j * D + d] = acc;
    }
  }
}

constexpr int64_t kMinChunkKeys = 32;

template <class E>
void attention_rows(const float* qp, int64_t ldq, int64_t B, int64_t H, int64_t D, const E* kp, const E* vp,
                    int64_t nslots, int64_t Hkv, const int64_t* sp, int64_t L, const bool* mp, float scale, float* op,
                    int64_t ldo) {
  const int64_t G = H / Hkv, pairs = B * Hkv;
  // Fewer (row, KV head) pairs than two per thread (a single stream: 3 pairs on 2 threads ran 2 : 1): each
  // pair's visible keys split into C chunks, each chunk's unnormalized sums merged after (as flash-decoding).
  const int64_t T = at::get_num_threads();
  const int64_t C =
      pairs >= 2 * T ? 1 : std::max<int64_t>(1, std::min((2 * T + pairs - 1) / pairs, L / kMinChunkKeys));
  std::vector<float> part_o, part_m, part_s;  // [pairs * C, G, D], [pairs * C, G] x 2
  if (C > 1) {
    part_o.resize(static_cast<size_t>(pairs * C * G * D));
    part_m.resize(static_cast<size_t>(pairs * C * G));
    part_s.resize(static_cast<size_t>(pairs * C * G));
  }
  at::parallel_for(0, pairs * C, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> p(static_cast<size_t>(std::max<int64_t>(G, 4) * L)), m(G), s(G);
    std::vector<const E*> kr(static_cast<size_t>(L)), vr(static_cast<size_t>(L));
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t pair = i / C, c = i % C, b = pair / Hkv, g = pair % Hkv;
      const int64_t* rs = sp + b * L;
      int64_t n = 0;  // the visible keys
      for (int64_t l = 0; l < L; ++l)
        if ((mp == nullptr || mp[b * L + l]) && rs[l] >= 0 && rs[l] < nslots) {
          kr[n] = kp + (rs[l] * Hkv + g) * D;
          vr[n++] = vp + (rs[l] * Hkv + g) * D;
        }
      const int64_t lo = n * c / C, hi = n * (c + 1) / C;  // this chunk's share of them
      const float* q = qp + b * ldq + g * G * D;
      if (C > 1) {
        attend_keys(q, G, D, kr.data() + lo, vr.data() + lo, hi - lo, scale, p.data(), &part_o[i * G * D],
                    &part_m[i * G], &part_s[i * G]);
        continue;
      }
      float* o = op + b * ldo + g * G * D;
      attend_keys(q, G, D, kr.data(), vr.data(), n, scale, p.data(), o, m.data(), s.data());
      for (int64_t j = 0; j < G; ++j) {
        const float inv = s[j] > 0.f ? 1.f / s[j] : 0.f;
        for (int64_t d = 0; d < D; ++d) o[j * D + d] *= inv;
      }
    }
  });
  if (C == 1) return;
  for (int64_t pair = 0; pair < pairs; ++pair) {  // o = sum_c e^(m_c - M) o_c / sum_c e^(m_c - M) s_c
    const int64_t b = pair / Hkv, g = pair % Hkv;
    for (int64_t j = 0; j < G; ++j) {
      float M = -INFINITY, S = 0.f;
      for (int64_t c = 0; c < C; ++c) M = std::max(M, part_m[(pair * C + c) * G + j]);
      float* o = op + b * ldo + (g * G + j) * D;
      std::fill(o, o + D, 0.f);
      for (int64_t c = 0; c < C; ++c) {
        const int64_t at = (pair * C + c) * G + j;
        if (part_s[at] == 0.f) continue;  // a chunk with no visible key
        const float w = std::exp(part_m[at] - M);
        S += w * part_s[at];
        const float* oc = &part_o[at * D];
        for (int64_t d = 0; d < D; ++d) o[d] += w * oc[d];
      }
      const float inv = S > 0.f ? 1.f / S : 0.f;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  }
}

}  // namespace

void firstlight::paged_attention_rows(const float* qp, int64_t ldq, int64_t B, int64_t H, int64_t D,
                                      const void* kp, const void* vp, at::ScalarType kv, int64_t nslots, int64_t Hkv,
                                      const int64_t* sp, int64_t L, const bool* mp, float scale, float* op,
                                      int64_t ldo) {
  switch (kv) {
    case at::kFloat:
      return attention_rows(qp, ldq, B, H, D, static_cast<const float*>(kp), static_cast<const float*>(vp), nslots,
                            Hkv, sp, L, mp, scale, op, ldo);
    case at::kBFloat16:
      return attention_rows(qp, ldq, B, H, D, static_cast<const c10::BFloat16*>(kp),
                            static_cast<const c10::BFloat16*>(vp), nslots, Hkv, sp, L, mp, scale, op, ldo);
    case at::kHalf:
      return attention_rows(qp, ldq, B, H, D, static_cast<const c10::Half*>(kp), static_cast<const c10::Half*>(vp),
                            nslots, Hkv, sp, L, mp, scale, op, ldo);
    default: TORCH_CHECK(false, "firstlight::paged_attention: K/V pools of ", kv, ": expected fp32, bf16 or fp16");
  }
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                  const at::Tensor& slots, const c10::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "firstlight::paged_decode_attention q must be fp32 [B, H, D]");
  TORCH_CHECK(k_pool.dim() == 3 && firstlight::kv_pool_type(k_pool.scalar_type()) && k_pool.is_contiguous() &&
                  v_pool.sizes() == k_pool.sizes() && v_pool.scalar_type() == k_pool.scalar_type() &&
                  v_pool.is_contiguous(),
              "firstlight::paged_decode_attention pools must be contiguous fp32, bf16 or fp16 [slots, Hkv, D], equal "
              "shapes and dtypes; got ", k_pool.scalar_type(), " ", k_pool.sizes(), " and ", v_pool.scalar_type(), " ",
              v_pool.sizes());
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
  firstlight::paged_attention_rows(qc.data_ptr<float>(), H * D, B, H, D, k_pool.const_data_ptr(),
                                   v_pool.const_data_ptr(), k_pool.scalar_type(), nslots, Hkv, sc.data_ptr<int64_t>(), L,
                                   mk.defined() ? mk.data_ptr<bool>() : nullptr, static_cast<float>(scale),
                                   out.data_ptr<float>(), H * D);
  return out;
}

// ---- attention over gathered K/V: a prefill chunk's queries, every key in rows ------------------------------
//
//   out[b, i, h] = sum_j p[j] v[b, h / G, j],  p = softmax_j(scale * q[b, h, i] . k[b, h / G, j])
//   over the keys j that query i sees: mask[b, i, j] where a mask is given, else j <= L - S + i (causal, the
//   queries being the last S of the L keys' positions).
//
// What SDPA's CPU flash kernel does, for the shapes prefill has here (S and L of tens to thousands, D = 64,
// GQA), at 1.4-3.3x its speed (benchmarks/prefill_attention.py): per (row, KV head, block of query positions) the
// visible keys are packed transposed once ([D][keys]), then micro-tiles of R query rows (the G heads of
// neighbouring positions, which see almost the same keys) get their scores as a small GEMM in registers
// (R rows x C vectors of keys, a broadcast of q per step of d), a softmax per row, and P x V in registers
// (R rows x a tile of D). Scores past a row's last visible key are computed (up to the micro-tile's last one,
// rounded up to a vector) and dropped by the softmax. A query that sees no key gets zeros.
namespace {

constexpr int kRows = 6;  // query rows per micro-tile
// vectors of keys (scores) and of the head dimension (values) per micro-tile: kRows x kVecs accumulators plus
// the loads fit the registers (32 zmm / 16 ymm)
template <class F>
constexpr int kVecs = F::kLanes == 16 ? 4 : 2;

struct RowSpan {
  int64_t lo, hi;  // visible keys of one query position: [lo, hi) (lo >= hi: none)
  bool holes;      // some key inside [lo, hi) is masked
};

// p[0 .. n) of one row: softmax over [lo, hi) where mask (nullptr: all of it) allows, zero elsewhere
void masked_softmax(float* p, int64_t n, int64_t lo, int64_t hi, const bool* mask) {
  hi = std::min(hi, n);
  if (lo >= hi) {
    std::fill(p, p + n, 0.f);
    return;
  }
  std::fill(p, p + lo, 0.f);
  std::fill(p + hi, p + n, 0.f);
  if (mask != nullptr)  // (rare: a mask with holes inside a row's span) exp(-inf) is ~1e-38 here, then 0
    for (int64_t j = lo; j < hi; ++j)
      if (!mask[j]) p[j] = -INFINITY;
  softmax(p + lo, hi - lo);
  if (mask != nullptr)
    for (int64_t j = lo; j < hi; ++j)
      if (!mask[j]) p[j] = 0.f;
}

#ifdef __AVX2__
// s[r * lds + j] = scale * q_r . kt[:, j] for R rows and key columns [j0, j1) (multiples of C vectors) of the
// transposed keys kt [D][ldkt]
template <class F, int R, int C>
void score_cols(const float* const* qr, int64_t D, const float* kt, int64_t ldkt, int64_t j0, int64_t j1,
                float scale, float* s, int64_t lds) {
  for (int64_t j = j0; j < j1; j += C * F::kLanes) {
    typename F::T a[R][C];
    for (auto& row : a)
      for (auto& x : row) x = F::zero();
    const float* kp = kt + j;
    for (int64_t d = 0; d < D; ++d, kp += ldkt) {
      typename F::T kv[C];
      for (int c = 0; c < C; ++c) kv[c] = F::load(kp + c * F::kLanes);
      for (int r = 0; r < R; ++r) {
        const typename F::T qb = F::set1(qr[r][d]);  // a broadcast load: the scale is applied to the sums
        for (int c = 0; c < C; ++c) a[r][c] = F::fma(qb, kv[c], a[r][c]);
      }
    }
    const typename F::T vs = F::set1(scale);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) F::store(s + r * lds + j + c * F::kLanes, F::mul(vs, a[r][c]));
  }
}

// score_cols over [j0, j1) (multiples of one vector): C vectors of keys at a time, the last few one at a time
template <class F, int R, int C>
void score_tile(const float* const* qr, int64_t D, const float* kt, int64_t ldkt, int64_t j0, int64_t j1,
                float scale, float* s, int64_t lds) {
  const int64_t jc = j0 + (j1 - j0) / (C * F::kLanes) * (C * F::kLanes);
  score_cols<F, R, C>(qr, D, kt, ldkt, j0, jc, scale, s, lds);
  score_cols<F, R, 1>(qr, D, kt, ldkt, jc, j1, scale, s, lds);
}

// o_r[c0 .. c0 + CT vectors) = sum_{j in [j0, j1)} p[r * ldp + j] v_j for R rows, v_j at v + j * ldv: decode's
// values_tile over strided rows (that one reads a gathered row's pointer per key: 30% slower here, measured)
template <class F, int R, int CT>
void pv_tile(const float* p, int64_t ldp, int64_t j0, int64_t j1, const float* v, int64_t ldv, int64_t c0,
             float* const* o) {
  typename F::T a[R][CT];
  for (auto& row : a)
    for (auto& x : row) x = F::zero();
  for (int64_t j = j0; j < j1; ++j) {
    const float* vj = v + j * ldv + c0;
    typename F::T vv[CT];
    for (int c = 0; c < CT; ++c) vv[c] = F::load(vj + c * F::kLanes);
    for (int r = 0; r < R; ++r) {
      const typename F::T pb = F::set1(p[r * ldp + j]);
      for (int c = 0; c < CT; ++c) a[r][c] = F::fma(pb, vv[c], a[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CT; ++c) F::store(o[r] + c0 + c * F::kLanes, a[r][c]);
}

template <class F, int R>
void rows_tile(const float* const* qr, float* const* o, int64_t D, const float* kt, int64_t ldkt, int64_t j0,
               int64_t j1, int64_t jv, const float* v, int64_t ldv, float scale, float* p, int64_t ldp,
               const RowSpan* spans, const bool* const* masks) {
  constexpr int C = kVecs<F>, CT = kVecs<F>;
  score_tile<F, R, C>(qr, D, kt, ldkt, j0, j1, scale, p, ldp);
  for (int r = 0; r < R; ++r) masked_softmax(p + r * ldp, j1, spans[r].lo, spans[r].hi, masks[r]);
  int64_t c0 = 0;
  for (; c0 + CT * F::kLanes <= D; c0 += CT * F::kLanes) pv_tile<F, R, CT>(p, ldp, j0, jv, v, ldv, c0, o);
  for (; c0 < D; c0 += F::kLanes) pv_tile<F, R, 1>(p, ldp, j0, jv, v, ldv, c0, o);
}

template <class F>
void rows_any(int R, const float* const* qr, float* const* o, int64_t D, const float* kt, int64_t ldkt, int64_t j0,
              int64_t j1, int64_t jv, const float* v, int64_t ldv, float scale, float* p, int64_t ldp,
              const RowSpan* spans, const bool* const* masks) {
  switch (R) {
    case 1: rows_tile<F, 1>(qr, o, D, kt, ldkt, j0, j1, jv, v, ldv, scale, p, ldp, spans, masks); break;
    case 2: rows_tile<F, 2>(qr, o, D, kt, ldkt, j0, j1, jv, v, ldv, scale, p, ldp, spans, masks); break;
    case 3: rows_tile<F, 3>(qr, o, D, kt, ldkt, j0, j1, jv, v, ldv, scale, p, ldp, spans, masks); break;
    case 4: rows_tile<F, 4>(qr, o, D, kt, ldkt, j0, j1, jv, v, ldv, scale, p, ldp, spans, masks); break;
    case 5: rows_tile<F, 5>(qr, o, D, kt, ldkt, j0, j1, jv, v, ldv, scale, p, ldp, spans, masks); break;
    default: rows_tile<F, 6>(qr, o, D, kt, ldkt, j0, j1, jv, v, ldv, scale, p, ldp, spans, masks); break;
  }
}
#endif

// One (row b, KV head g, query positions [i0, i1)) of `attention`, all G heads of the group.
template <class F>
void attend_block(const float* qb, int64_t qsH, int64_t qsS, const float* kb, const float* vb, int64_t ksL,
                  int64_t vsL, int64_t D, int64_t G, int64_t g, int64_t i0, int64_t i1, const RowSpan* span,
                  const bool* mb, int64_t L, float scale, float* ob, int64_t osS, std::vector<float>& kt,
                  std::vector<float>& p) {
  int64_t klo = L, khi = 0;
  for (int64_t i = i0; i < i1; ++i)
    if (span[i].lo < span[i].hi) {
      klo = std::min(klo, span[i].lo);
      khi = std::max(khi, span[i].hi);
    }
  constexpr int64_t W = F::kLanes;  // key columns come in vectors
  const int64_t nk = std::max<int64_t>(khi - klo, 0), ldkt = (nk + W - 1) / W * W;
  constexpr int kR = kRows;
  if (kt.size() < static_cast<size_t>(D * ldkt)) kt.resize(static_cast<size_t>(D * ldkt));
  if (p.size() < static_cast<size_t>(kR * ldkt)) p.resize(static_cast<size_t>(kR * ldkt));
  for (int64_t j = 0; j < nk; ++j) {  // transposed keys [D][ldkt], zero past the last
    const float* kj = kb + (klo + j) * ksL;
    for (int64_t d = 0; d < D; ++d) kt[d * ldkt + j] = kj[d];
  }
  for (int64_t d = 0; d < D; ++d) std::fill(kt.data() + d * ldkt + nk, kt.data() + (d + 1) * ldkt, 0.f);
  // rows: (position i, head j of the group) in order, R at a time
  const int64_t rows = (i1 - i0) * G;
  for (int64_t r0 = 0; r0 < rows; r0 += kR) {
    const int R = static_cast<int>(std::min<int64_t>(kR, rows - r0));
    const float* qr[kR];
    float* o[kR];
    RowSpan sp[kR];
    const bool* mk[kR];
    int64_t tlo = nk, thi = 0;
    for (int r = 0; r < R; ++r) {
      const int64_t i = i0 + (r0 + r) / G, h = g * G + (r0 + r) % G;
      qr[r] = qb + h * qsH + i * qsS;
      o[r] = ob + i * osS + h * D;
      sp[r] = {span[i].lo - klo, span[i].hi - klo, span[i].holes};
      mk[r] = span[i].holes ? mb + i * L + klo : nullptr;
      if (sp[r].lo < sp[r].hi) {
        tlo = std::min(tlo, sp[r].lo);
        thi = std::max(thi, sp[r].hi);
      }
    }
    if (tlo >= thi) {
      for (int r = 0; r < R; ++r) std::fill(o[r], o[r] + D, 0.f);
      continue;
    }
#ifdef __AVX2__
    if constexpr (F::kLanes > 1) {
      const int64_t j0 = tlo / W * W, j1 = (thi + W - 1) / W * W;
      // scores and p for columns [j0, j1); p is indexed from column 0 (its row stride ldkt)
      rows_any<F>(R, qr, o, D, kt.data(), ldkt, j0, j1, thi, vb + klo * vsL, vsL, scale, p.data(), ldkt, sp, mk);
      continue;
    }
#endif
    for (int r = 0; r < R; ++r) {  // portable path
      float* pr = p.data() + r * ldkt;
      for (int64_t j = 0; j < nk; ++j) {
        float acc = 0.f;
        for (int64_t d = 0; d < D; ++d) acc += qr[r][d] * kt[d * ldkt + j];
        pr[j] = scale * acc;
      }
      masked_softmax(pr, nk, sp[r].lo, sp[r].hi, mk[r]);
      for (int64_t d = 0; d < D; ++d) {
        float acc = 0.f;
        for (int64_t j = 0; j < nk; ++j) acc += pr[j] * vb[(klo + j) * vsL + d];
        o[r][d] = acc;
      }
    }
  }
}

struct Scalar {
  static constexpr int kLanes = 1;
};

}  // namespace

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& mask,
                     bool causal, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.scalar_type() == at::kFloat &&
                  k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "firstlight::attention takes fp32 q [B, H, S, D], k and v [B, Hkv, L, D]");
  const int64_t B = q.size(0), H = q.size(1), S = q.size(2), D = q.size(3), Hkv = k.size(1), L = k.size(2);
  TORCH_CHECK(k.size(0) == B && v.sizes() == k.sizes() && k.size(3) == D && Hkv > 0 && H % Hkv == 0,
              "firstlight::attention: q ", q.sizes(), " does not match k ", k.sizes(), " and v ", v.sizes());
  const at::Tensor qc = q.stride(3) == 1 ? q : q.contiguous(), kc = k.stride(3) == 1 ? k : k.contiguous(),
                   vc = v.stride(3) == 1 ? v : v.contiguous();
  at::Tensor mk;
  if (mask.has_value()) {
    TORCH_CHECK(mask->numel() == B * S * L, "firstlight::attention mask must be [B, S, L] (or [B, 1, S, L]), got ",
                mask->sizes());
    mk = mask->to(at::kBool).reshape({B, S, L}).contiguous();
  }
  at::Tensor out = at::empty({B, S, H, D}, q.options());
  const bool* mp = mk.defined() ? mk.data_ptr<bool>() : nullptr;
  // each query position's visible key span (the mask's first and last allowed key)
  std::vector<RowSpan> spans(static_cast<size_t>(B * S));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < S; ++i) {
      RowSpan& sp = spans[b * S + i];
      if (mp == nullptr) {
        sp = {0, causal ? std::min(L, std::max<int64_t>(L - S + i + 1, 0)) : L, false};
        continue;
      }
      const bool* row = mp + (b * S + i) * L;
      int64_t lo = 0, hi = L;
      while (lo < L && !row[lo]) ++lo;
      while (hi > lo && !row[hi - 1]) --hi;
      // causal and sliding-window rows see every key of their span: no per-key test below
      sp = {lo, hi, std::memchr(row + lo, 0, static_cast<size_t>(hi - lo)) != nullptr};
    }
  const int64_t G = H / Hkv;
  // blocks of query positions: enough tasks for every thread, each block packs its keys once
  const int64_t want = 4 * at::get_num_threads(), per_head = std::max<int64_t>(1, (want + B * Hkv - 1) / (B * Hkv));
  const int64_t nblk = std::min<int64_t>(per_head, std::max<int64_t>(1, S * G / 48)), blk = (S + nblk - 1) / nblk;
  const float* qp = qc.data_ptr<float>();
  const float* kp = kc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * Hkv * nblk, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> kt, p;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / (Hkv * nblk), g = (t / nblk) % Hkv, i0 = (t % nblk) * blk, i1 = std::min(S, i0 + blk);
      if (i0 >= i1) continue;
      const float* kb = kp + b * kc.stride(0) + g * kc.stride(1);
      const float* vb = vp + b * vc.stride(0) + g * vc.stride(1);
      const bool* mb = mp == nullptr ? nullptr : mp + b * S * L;
      const auto run = [&](auto lanes) {  // on the widest vectors D divides into
        attend_block<decltype(lanes)>(qp + b * qc.stride(0), qc.stride(1), qc.stride(2), kb, vb, kc.stride(2),
                                      vc.stride(2), D, G, g, i0, i1, spans.data() + b * S, mb, L, sc,
                                      op + b * S * H * D, H * D, kt, p);
      };
#ifdef __AVX2__
      if (D % firstlight::F32xWide::kLanes == 0) {
        run(firstlight::F32xWide());
        continue;
      }
      if (D % firstlight::F32x8::kLanes == 0) {
        run(firstlight::F32x8());
        continue;
      }
#endif
      run(Scalar());
    }
  });
  return out.permute({0, 2, 1, 3});  // [B, H, S, D], laid out [B, S, H, D]
}

// The slots of one forward's KV cache group (engine/runner.py ModelRunner._group_view, the same arithmetic in
// one pass instead of ~20 small tensor ops): table [B, nb] block ids, context / lo [B] (a row's keys are its
// positions lo .. context - 1), pos [B, S] the new tokens' positions, L keys per row, `pad` rows more. Slot of
// position t: table[b, t / bs] * bs + t % bs. -> write [(B + pad) * S] (padding rows: `scratch`), gather [B + pad, L]
// (0 past a row's keys), key positions [B + pad, L] (-1 there).
std::vector<at::Tensor> paged_slots(const at::Tensor& table_in, const at::Tensor& context_in, const at::Tensor& lo_in,
                                    const at::Tensor& pos_in, int64_t L, int64_t bs, int64_t pad, int64_t scratch) {
  TORCH_CHECK(table_in.dim() == 2 && table_in.scalar_type() == at::kLong && context_in.scalar_type() == at::kLong &&
                  lo_in.scalar_type() == at::kLong && pos_in.scalar_type() == at::kLong && pos_in.dim() == 2 &&
                  context_in.numel() == table_in.size(0) && lo_in.numel() == table_in.size(0) &&
                  pos_in.size(0) == table_in.size(0) && L >= 0 && bs > 0 && pad >= 0,
              "firstlight::paged_slots: int64 table [B, blocks], context and lo [B], positions [B, S]; got ",
              table_in.sizes(), ", ", context_in.sizes(), ", ", lo_in.sizes(), ", ", pos_in.sizes());
  const at::Tensor table = table_in.contiguous(), context = context_in.contiguous(), lo = lo_in.contiguous(),
                   pos = pos_in.contiguous();
  const int64_t B = table.size(0), nb = table.size(1), S = pos.size(1), R = B + pad;
  const int64_t *tp = table.data_ptr<int64_t>(), *cp = context.data_ptr<int64_t>(), *lp = lo.data_ptr<int64_t>(),
                *pp = pos.data_ptr<int64_t>();
  at::Tensor write = at::empty({R * S}, table.options()), gather = at::zeros({R, L}, table.options()),
             keys = at::full({R, L}, -1, table.options());
  int64_t *wp = write.data_ptr<int64_t>(), *gp = gather.data_ptr<int64_t>(), *kp = keys.data_ptr<int64_t>();
  auto slot = [&](int64_t b, int64_t t) {
    TORCH_CHECK(t >= 0 && t / bs < nb, "firstlight::paged_slots: position ", t, " of row ", b, " is past its ", nb,
                " blocks");
    return tp[b * nb + t / bs] * bs + t % bs;
  };
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t s = 0; s < S; ++s) wp[b * S + s] = slot(b, pp[b * S + s]);
    const int64_t n = std::min(L, cp[b] - lp[b]);  // this row's keys
    for (int64_t l = 0; l < n; ++l) {
      gp[b * L + l] = slot(b, lp[b] + l);
      kp[b * L + l] = lp[b] + l;
    }
  }
  std::fill(wp + B * S, wp + R * S, scratch);
  return {write, gather, keys};
}

TORCH_LIBRARY_FRAGMENT(firstlight, lib) {
  lib.def("paged_decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor slots, Tensor? mask, float scale) -> Tensor");
  lib.def("paged_slots(Tensor table, Tensor context, Tensor lo, Tensor positions, int num_keys, int block_size, "
          "int pad, int scratch) -> Tensor[]");
  lib.def("attention(Tensor q, Tensor k, Tensor v, Tensor? mask, bool causal, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(firstlight, CPU, lib) {
  lib.impl("paged_decode_attention", &paged_decode_attention);
  lib.impl("paged_slots", &paged_slots);
  lib.impl("attention", &attention);
}
