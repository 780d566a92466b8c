// What firstlight's CPU kernel sources share: the entry points one source calls in another (dense_decode.cpp
// runs the matmul and attention kernels of the others without a dispatcher hop) and the vector helpers.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#ifdef __AVX2__
#include <immintrin.h>
#endif

// int4_gemv.cpp
at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d, const at::Tensor& m,
                   int64_t G, int64_t max_tiled_m);
at::Tensor int4_mm_a8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d, const at::Tensor& m,
                      int64_t G, int64_t max_tiled_m);
at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, bool act_int8,
                   int64_t max_tiled_m);
// int4_vnni.cpp: int4_mm_a8 on the AVX-512 VNNI layout (int4_pack_vnni's; int4_mm_a8 routes 3-D packed weights here)
at::Tensor int4_mm_vnni(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d, const at::Tensor& m,
                        int64_t G);
at::Tensor int4_dequant_vnni(const at::Tensor& packed, const at::Tensor& d, const at::Tensor& m, int64_t G);
// f32_gemm.cpp
at::Tensor f32_mm(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                  int64_t max_tiled_m);
// w [N, K] fp32 -> [ceil(N / 32), K, 32]; x [M, K] @ w^T (+ bias) on f32_pack(w)
at::Tensor f32_pack(const at::Tensor& w);
at::Tensor f32_mm_packed(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                         const c10::optional<at::Tensor>& bias);

namespace firstlight {

// The group of block b (blocks of 32 input channels, groups of G) is b >> block_group_shift(G): G / 32 is a power
// of two (the ops check it), so no division per block.
inline int block_group_shift(int64_t G) {
  int shift = 0;
  while ((int64_t{32} << shift) < G) ++shift;
  return shift;
}

// int4_gemv.cpp: one activation row x [K] -> qx [K] int8 per block of 32 (qx = round(x * 127 / max|x_b|)),
// dx [K/32] = max|x_b| / 127, xs [K/G] = per group of G the sum of dx_b * sum(qx_b).
void quantize_row_q8(const float* x, int64_t K, int64_t G, int8_t* qx, float* dx, float* xs);

// Every row of x [M, K] (fp32, contiguous) as quantize_row_q8, threads over rows: qx [M, K] int8 and
// sc [M, K/32 + K/G] (each row: dx, then xs).
struct RowsQ8 {
  at::Tensor qx, sc;
};
RowsQ8 quantize_rows_q8(const at::Tensor& xf, int64_t G);

// f32_gemm.cpp: y[t, n] (+= with add) sum_k w[n, k] x[t, k] for n < nr (<= 4 output rows, stride ldw) and t < M
// (activation rows, stride ldx), k < K, in register tiles of 4 x 3; pf: rows to prefetch meanwhile (or nullptr).
void f32_block(const float* x, int64_t ldx, int64_t M, const float* w, int64_t ldw, int64_t K, float* y,
               int64_t ldy, int64_t nr, bool add, const float* pf);

// paged_attention.cpp: out[b, h] (row stride ldo) = softmax over the visible keys of row b of
// scale * q[b, h] . k, times v; q row b at q + b * ldq ([H, D] contiguous), keys/values at pools
// [nslots, Hkv, D] of element type kv (kv_pool_type) rows slots[b * L + l], mask [B, L] (nullptr: all visible).
// Threads over (row, KV head).
void paged_attention_rows(const float* q, int64_t ldq, int64_t B, int64_t H, int64_t D, const void* k_pool,
                          const void* v_pool, at::ScalarType kv, int64_t nslots, int64_t Hkv, const int64_t* slots,
                          int64_t L, const bool* mask, float scale, float* out, int64_t ldo);

// the K/V pool element types the paged kernels read and write: fp32, bf16, fp16
inline bool kv_pool_type(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

#ifdef __AVX2__
// [sum(a0), sum(a1), sum(a2), sum(a3)]
inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// Cephes' expf (as in avx_mathfun): e^x = 2^n * poly(r), r = x - n ln 2 with ln 2 in two parts; the
// polynomial's coefficients, highest degree first
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// e^x for 8 floats (~1 ulp over the softmax range; x <= 0 here, and exp of very negative x flushes to 0)
inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3f)), _mm256_set1_ps(-87.3f));
  const __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(kLog2e), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(kLn2Lo), _mm256_fnmadd_ps(fx, _mm256_set1_ps(kLn2Hi), x));
  __m256 y = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kExpPoly[i]));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(0x7f)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

#ifdef __AVX512F__
// exp256 on 16 lanes
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3f)), _mm512_set1_ps(-87.3f));
  const __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), _mm512_set1_ps(0.5f)),
                                         _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kLn2Lo), _mm512_fnmadd_ps(fx, _mm512_set1_ps(kLn2Hi), x));
  __m512 y = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kExpPoly[i]));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
  const __m512i n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(0x7f)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(n));
}
#endif

// fp32 vectors of 8 lanes (AVX2) and 16 (builds with AVX-512), for kernels templated on the width; `half`
// folds a vector to 8 lanes for hsum4.
struct F32x8 {
  using T = __m256;
  static constexpr int kLanes = 8;
  static T zero() { return _mm256_setzero_ps(); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  // 8 bf16 / fp16 values widened to fp32 (bf16: its 16 bits are fp32's high half; fp16: F16C)
  static T load_bf16(const void* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p))), 16));
  }
  static T load_f16(const void* p) { return _mm256_cvtph_ps(_mm_loadu_si128(static_cast<const __m128i*>(p))); }
  static void store(float* p, T a) { _mm256_storeu_ps(p, a); }
  static T set1(float a) { return _mm256_set1_ps(a); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static T max(T a, T b) { return _mm256_max_ps(a, b); }
  static T exp(T a) { return exp256(a); }
  static float reduce_add(T a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static float reduce_max(T a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
  }
  static __m256 half(T a) { return a; }
};

#ifdef __AVX512F__
struct F32x16 {
  using T = __m512;
  static constexpr int kLanes = 16;
  static T zero() { return _mm512_setzero_ps(); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static T load_bf16(const void* p) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(p))), 16));
  }
  static T load_f16(const void* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i*>(p))); }
  static void store(float* p, T a) { _mm512_storeu_ps(p, a); }
  static T set1(float a) { return _mm512_set1_ps(a); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static T max(T a, T b) { return _mm512_max_ps(a, b); }
  static T exp(T a) { return exp512(a); }
  static float reduce_add(T a) { return _mm512_reduce_add_ps(a); }
  static float reduce_max(T a) { return _mm512_reduce_max_ps(a); }
  static __m256 half(T a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  }
};
using F32xWide = F32x16;  // the widest this build has
#else
using F32xWide = F32x8;
#endif

#endif

}  // namespace firstlight
