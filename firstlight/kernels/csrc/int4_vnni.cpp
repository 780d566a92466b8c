// firstlight w4a8 matmul on a tiled layout: y[M, N] = W~ x^ (int4 weights, activations rounded to int8 per block
// of 32, as int4_mm_a8 in int4_gemv.cpp); on AVX-512 VNNI one vpdpbusd for 64 products, no horizontal sums.
//
// Why a layout of its own: with the weights row-major (int4_gemv.cpp), one integer dot product covers one row's
// block of 32, and the fp32 work per block (convert, scale by d * dx, add) costs as much as the dot product.
// Here 16 output rows sit in the 16 int32 lanes of a register: every vpdpbusd multiplies 4 input channels of 16
// rows by 4 activation bytes broadcast to every lane, so a block of 32 channels is 8 vpdpbusd per 16 rows and
// one convert + one scaled fma for all 16, and the 16 sums are stored as they are (y's rows are contiguous).
//
// Layout (kernels.pack_int4_vnni, from int4's codes, scales and zeros; N a multiple of 16, K of 32):
//   packed uint8 [N/16, K/8, 64]: tile c (rows 16c..16c+15), octet o (channels 8o..8o+7): byte 4r + j holds
//                                 q[16c + r, 8o + j] in its low nibble and q[16c + r, 8o + 4 + j] in its high one
//   d, m   fp32  [N/16, K/G, 16]: d[c, g, r] = scale of row 16c + r in group g (and m its zero term), as int4's
//                                 w = fma(q, d, m), q in 0..15.
// Per tile of MT activation rows x NT row tiles: int32 sums per block (8 vpdpbusd: unsigned nibbles x signed
// activation bytes, at most 32 * 15 * 127 per lane), then acc += float(sum) * d * dx_b per block and
// acc += m * xs_g per group (xs_g: the group's sum of x^). Threads: at::parallel_for over row tiles.
// On AVX-512 VNNI (kernels/__init__.py's avx512vnni ISA) as above; on AVX2 the same layout with maddubs + madd
// per 8 rows (avx2_tile); a scalar build raises (the Python side packs this layout only for those two ISAs).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "firstlight_kernels.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define FIRSTLIGHT_VNNI 1
#elif defined(__AVX2__)
#include <immintrin.h>
#define FIRSTLIGHT_VNNI_AVX2 1
#endif

namespace {

constexpr int64_t kBlock = 32, kTile = 16;

#ifdef FIRSTLIGHT_VNNI
inline __m512i bcast4(const int8_t* p) {  // 4 activation bytes into every int32 lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// y[t, 16 (c0 + c) + r] for t < MT activation rows (qx / sc rows at stride ldq / lds), c < NT row tiles from c0.
template <int MT, int NT>
void vnni_tile(const int8_t* qx, int64_t ldq, const float* sc, int64_t lds, int64_t K, int64_t G,
               const uint8_t* wv, const float* dv, const float* mv, float* y, int64_t ldy, int64_t c0) {
  const int64_t ngroups = K / G, bpg = G / kBlock, nblocks = K / kBlock, octets = K / 8;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[MT][NT];
#pragma GCC unroll 16
  for (int t = 0; t < MT; ++t)
#pragma GCC unroll 16
    for (int c = 0; c < NT; ++c) acc[t][c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < ngroups; ++g) {
    for (int64_t bb = 0; bb < bpg; ++bb) {
      const int64_t b = g * bpg + bb;
      __m512i isum[MT][NT];
#pragma GCC unroll 16
      for (int t = 0; t < MT; ++t)
#pragma GCC unroll 16
        for (int c = 0; c < NT; ++c) isum[t][c] = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int o = 0; o < 4; ++o) {
        const int64_t k = b * kBlock + 8 * o;
        __m512i wlo[NT], whi[NT];
#pragma GCC unroll 16
        for (int c = 0; c < NT; ++c) {
          const __m512i raw = _mm512_loadu_si512(wv + ((c0 + c) * octets + k / 8) * 64);
          wlo[c] = _mm512_and_si512(raw, low);
          whi[c] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
        }
#pragma GCC unroll 16
        for (int t = 0; t < MT; ++t) {
          const __m512i xl = bcast4(qx + t * ldq + k), xh = bcast4(qx + t * ldq + k + 4);
#pragma GCC unroll 16
          for (int c = 0; c < NT; ++c) {
            isum[t][c] = _mm512_dpbusd_epi32(isum[t][c], wlo[c], xl);
            isum[t][c] = _mm512_dpbusd_epi32(isum[t][c], whi[c], xh);
          }
        }
      }
#pragma GCC unroll 16
      for (int c = 0; c < NT; ++c) {
        const __m512 vd = _mm512_loadu_ps(dv + ((c0 + c) * ngroups + g) * kTile);
#pragma GCC unroll 16
        for (int t = 0; t < MT; ++t)
          acc[t][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t][c]), _mm512_mul_ps(vd, _mm512_set1_ps(sc[t * lds + b])),
                                      acc[t][c]);
      }
    }
#pragma GCC unroll 16
    for (int c = 0; c < NT; ++c) {
      const __m512 vm = _mm512_loadu_ps(mv + ((c0 + c) * ngroups + g) * kTile);
#pragma GCC unroll 16
      for (int t = 0; t < MT; ++t)
        acc[t][c] = _mm512_fmadd_ps(vm, _mm512_set1_ps(sc[t * lds + nblocks + g]), acc[t][c]);
    }
  }
#pragma GCC unroll 16
  for (int t = 0; t < MT; ++t)
#pragma GCC unroll 16
    for (int c = 0; c < NT; ++c) _mm512_storeu_ps(y + t * ldy + (c0 + c) * kTile, acc[t][c]);
}

// Row tiles c0..c1 for all M rows: NT tiles at a time, MT activation rows at a time (the tiles' weights, 16 rows
// x K / 2 bytes each, stay in L1 while every activation tile reads them).
template <int NT>
void vnni_rows(const int8_t* qx, const float* sc, int64_t lds, int64_t M, int64_t K, int64_t G, const uint8_t* wv,
               const float* dv, const float* mv, float* y, int64_t N, int64_t c0, int64_t c1) {
  using Fn = void (*)(const int8_t*, int64_t, const float*, int64_t, int64_t, int64_t, const uint8_t*,
                      const float*, const float*, float*, int64_t, int64_t);
  constexpr Fn full[4] = {vnni_tile<1, NT>, vnni_tile<2, NT>, vnni_tile<3, NT>, vnni_tile<4, NT>};
  constexpr Fn one[4] = {vnni_tile<1, 1>, vnni_tile<2, 1>, vnni_tile<3, 1>, vnni_tile<4, 1>};
  for (int64_t c = c0; c < c1; c += NT) {
    const Fn* fn = c + NT <= c1 ? full : one;
    const int64_t step = c + NT <= c1 ? NT : 1;
    for (int64_t cc = c; cc < std::min(c + NT, c1); cc += step)
      for (int64_t r0 = 0; r0 < M; r0 += 4) {
        const int64_t mt = std::min<int64_t>(4, M - r0);
        fn[mt - 1](qx + r0 * K, K, sc + r0 * lds, lds, K, G, wv, dv, mv, y + r0 * N, N, cc);
      }
  }
}
#endif

#ifdef FIRSTLIGHT_VNNI_AVX2
// The same layout on AVX2 (no vpdpbusd): each 64-byte octet is two registers of 8 rows; per row and octet
// maddubs (unsigned nibbles x signed bytes -> int16 pairs) of the low and the high nibbles, summed in int16
// over the whole block (8 maddubs of at most 2 * 15 * 127 each: 30,480 < 32,767, no saturation), then one
// madd with ones to int32 per block: 4 ops per 64 products where fp32 fma does 8 per op.
inline __m256i bcast4_256(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

template <int MT>
void avx2_tile(const int8_t* qx, int64_t ldq, const float* sc, int64_t lds, int64_t K, int64_t G,
               const uint8_t* wv, const float* dv, const float* mv, float* y, int64_t ldy, int64_t c) {
  const int64_t ngroups = K / G, bpg = G / kBlock, nblocks = K / kBlock, octets = K / 8;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const uint8_t* wc = wv + c * octets * 64;
  __m256 acc[MT][2];
#pragma GCC unroll 8
  for (int t = 0; t < MT; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < ngroups; ++g) {
    for (int64_t bb = 0; bb < bpg; ++bb) {
      const int64_t b = g * bpg + bb;
      __m256i s16[MT][2];
#pragma GCC unroll 8
      for (int t = 0; t < MT; ++t) s16[t][0] = s16[t][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int o = 0; o < 4; ++o) {
        const int64_t k = b * kBlock + 8 * o;
        const uint8_t* p = wc + (k / 8) * 64;
        const __m256i r0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
        const __m256i r1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
        const __m256i lo0 = _mm256_and_si256(r0, low), hi0 = _mm256_and_si256(_mm256_srli_epi16(r0, 4), low);
        const __m256i lo1 = _mm256_and_si256(r1, low), hi1 = _mm256_and_si256(_mm256_srli_epi16(r1, 4), low);
#pragma GCC unroll 8
        for (int t = 0; t < MT; ++t) {
          const __m256i xl = bcast4_256(qx + t * ldq + k), xh = bcast4_256(qx + t * ldq + k + 4);
          s16[t][0] = _mm256_add_epi16(s16[t][0], _mm256_add_epi16(_mm256_maddubs_epi16(lo0, xl),
                                                                   _mm256_maddubs_epi16(hi0, xh)));
          s16[t][1] = _mm256_add_epi16(s16[t][1], _mm256_add_epi16(_mm256_maddubs_epi16(lo1, xl),
                                                                   _mm256_maddubs_epi16(hi1, xh)));
        }
      }
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256 vd = _mm256_loadu_ps(dv + (c * ngroups + g) * kTile + 8 * h);
#pragma GCC unroll 8
        for (int t = 0; t < MT; ++t)
          acc[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s16[t][h], ones)),
                                      _mm256_mul_ps(vd, _mm256_set1_ps(sc[t * lds + b])), acc[t][h]);
      }
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256 vm = _mm256_loadu_ps(mv + (c * ngroups + g) * kTile + 8 * h);
#pragma GCC unroll 8
      for (int t = 0; t < MT; ++t)
        acc[t][h] = _mm256_fmadd_ps(vm, _mm256_set1_ps(sc[t * lds + nblocks + g]), acc[t][h]);
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < MT; ++t) {
    _mm256_storeu_ps(y + t * ldy + c * kTile, acc[t][0]);
    _mm256_storeu_ps(y + t * ldy + c * kTile + 8, acc[t][1]);
  }
}

#if defined(__GNUC__) && defined(__x86_64__)
// Four activation rows x one tile, each block's 4 octets in inline asm. avx2_tile<4> holds 8 int16 and 8 fp32 sums in
// 16 ymm registers and GCC spills them (about 150 stack loads and stores a tile); here the 8 int16 sums, the 4
// unpacked weight registers, the 2 activation broadcasts, one product and the nibble mask take the 16 registers
// and nothing spills, and each broadcast feeds 2 maddubs (both halves of the tile); the fp32 sums live in y,
// updated once per block (d * dx_b, and the group's zero term with its last block). At SmolLM2's shapes, 2
// threads, M = 32-2,048: ~1.4-1.5x avx2_tile<4> on a Zen 3 (docs/PERFORMANCE.md, "w4a8's AVX2 tile without spills").
void avx2_tile4(const int8_t* qx, int64_t ldq, const float* sc, int64_t lds, int64_t K, int64_t G,
                const uint8_t* wv, const float* dv, const float* mv, float* y, int64_t ldy, int64_t c) {
  const int64_t ngroups = K / G, bpg = G / kBlock, nblocks = K / kBlock, octets = K / 8;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  float* yc = y + c * kTile;
  for (int t = 0; t < 4; ++t) {
    _mm256_storeu_ps(yc + t * ldy, _mm256_setzero_ps());
    _mm256_storeu_ps(yc + t * ldy + 8, _mm256_setzero_ps());
  }
  const int shift = firstlight::block_group_shift(G);  // block -> group: b >> shift
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t g = b >> shift;
    // s[t][h]: row t's int16 sums for rows 8h..8h+7 of the tile
    __m256i s00 = _mm256_setzero_si256(), s01 = s00, s10 = s00, s11 = s00, s20 = s00, s21 = s00, s30 = s00, s31 = s00;
    const uint8_t* p = wv + (c * octets + b * 4) * 64;
    const int8_t* x = qx + b * kBlock;
    const int8_t* x3 = x + 3 * ldq;
    __m256i lo0, hi0, lo1, hi1, xl, xh, prod;
    // One asm block for the block's 4 octets (addresses by displacement): with an asm block per octet GCC
    // moved the 8 sums between registers and reloaded the mask every octet (+9 instructions on ~58), and
    // with the blocks in a loop over groups and one over a group's blocks it lost the same again: 1.08x each.
    // AT&T order: vpmaddubsw xl, lo0, prod is prod = maddubs(lo0 unsigned, xl signed).
#define FIRSTLIGHT_ROW(XL, XH, S0, S1)                                                                         \
  "vpbroadcastd " XL ", %[xl]\n\t"                                                                             \
  "vpbroadcastd " XH ", %[xh]\n\t"                                                                             \
  "vpmaddubsw %[xl], %[lo0], %[prod]\n\t"                                                                      \
  "vpaddw %[prod], %[" S0 "], %[" S0 "]\n\t"                                                                   \
  "vpmaddubsw %[xh], %[hi0], %[prod]\n\t"                                                                      \
  "vpaddw %[prod], %[" S0 "], %[" S0 "]\n\t"                                                                   \
  "vpmaddubsw %[xl], %[lo1], %[prod]\n\t"                                                                      \
  "vpaddw %[prod], %[" S1 "], %[" S1 "]\n\t"                                                                   \
  "vpmaddubsw %[xh], %[hi1], %[prod]\n\t"                                                                      \
  "vpaddw %[prod], %[" S1 "], %[" S1 "]\n\t"
// octet o: weights at 64 o (W) and 64 o + 32 from p, activations at 8 o (XL) and 8 o + 4 (XH) of each row
#define FIRSTLIGHT_OCTET(W, XL, XH)                                                                            \
  "vpand " W "(%[p]), %[low], %[lo0]\n\t"                                                                      \
  "vmovdqu " W "(%[p]), %[hi0]\n\t"                                                                            \
  "vpsrlw $4, %[hi0], %[hi0]\n\t"                                                                              \
  "vpand 32+" W "(%[p]), %[low], %[lo1]\n\t"                                                                   \
  "vmovdqu 32+" W "(%[p]), %[hi1]\n\t"                                                                         \
  "vpsrlw $4, %[hi1], %[hi1]\n\t"                                                                              \
  "vpand %[hi0], %[low], %[hi0]\n\t"                                                                           \
  "vpand %[hi1], %[low], %[hi1]\n\t"                                                                           \
  FIRSTLIGHT_ROW(XL "(%[x])", XH "(%[x])", "s00", "s01")                                                       \
  FIRSTLIGHT_ROW(XL "(%[x],%[ldq])", XH "(%[x],%[ldq])", "s10", "s11")                                         \
  FIRSTLIGHT_ROW(XL "(%[x],%[ldq],2)", XH "(%[x],%[ldq],2)", "s20", "s21")                                     \
  FIRSTLIGHT_ROW(XL "(%[x3])", XH "(%[x3])", "s30", "s31")
    __asm__(FIRSTLIGHT_OCTET("0", "0", "4") FIRSTLIGHT_OCTET("64", "8", "12")
            FIRSTLIGHT_OCTET("128", "16", "20") FIRSTLIGHT_OCTET("192", "24", "28")
            : [s00] "+x"(s00), [s01] "+x"(s01), [s10] "+x"(s10), [s11] "+x"(s11), [s20] "+x"(s20),
              [s21] "+x"(s21), [s30] "+x"(s30), [s31] "+x"(s31), [lo0] "=&x"(lo0), [hi0] "=&x"(hi0),
              [lo1] "=&x"(lo1), [hi1] "=&x"(hi1), [xl] "=&x"(xl), [xh] "=&x"(xh), [prod] "=&x"(prod)
            : [p] "r"(p), [x] "r"(x), [x3] "r"(x3), [ldq] "r"(ldq), [low] "x"(low));  // reads qx and wv only
#undef FIRSTLIGHT_OCTET
#undef FIRSTLIGHT_ROW
    const int64_t i = (c * ngroups + g) * kTile;
    const __m256 d0 = _mm256_loadu_ps(dv + i), d1 = _mm256_loadu_ps(dv + i + 8);
    const bool last = ((b + 1) & (bpg - 1)) == 0;  // the group's zero term m * xs_g once, with its last block
    const __m256 m0 = last ? _mm256_loadu_ps(mv + i) : _mm256_setzero_ps();
    const __m256 m1 = last ? _mm256_loadu_ps(mv + i + 8) : _mm256_setzero_ps();
    // y[t] += cvt(madd(s, 1)) * d * dx_t (+ m * xs_t), both halves of row t
    const auto update = [&](int t, __m256i s0, __m256i s1) {
      const __m256 dx = _mm256_broadcast_ss(sc + t * lds + b), xs = _mm256_broadcast_ss(sc + t * lds + nblocks + g);
      float* yt = yc + t * ldy;
      _mm256_storeu_ps(yt, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s0, ones)), _mm256_mul_ps(d0, dx),
                                           _mm256_fmadd_ps(m0, xs, _mm256_loadu_ps(yt))));
      _mm256_storeu_ps(yt + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s1, ones)), _mm256_mul_ps(d1, dx),
                                               _mm256_fmadd_ps(m1, xs, _mm256_loadu_ps(yt + 8))));
    };
    update(0, s00, s01);
    update(1, s10, s11);
    update(2, s20, s21);
    update(3, s30, s31);
  }
}
#else
void avx2_tile4(const int8_t* qx, int64_t ldq, const float* sc, int64_t lds, int64_t K, int64_t G,
                const uint8_t* wv, const float* dv, const float* mv, float* y, int64_t ldy, int64_t c) {
  avx2_tile<4>(qx, ldq, sc, lds, K, G, wv, dv, mv, y, ldy, c);
}
#endif

void avx2_rows(const int8_t* qx, const float* sc, int64_t lds, int64_t M, int64_t K, int64_t G, const uint8_t* wv,
               const float* dv, const float* mv, float* y, int64_t N, int64_t c0, int64_t c1) {
  using Fn = decltype(&avx2_tile<1>);
  constexpr Fn fn[4] = {avx2_tile<1>, avx2_tile<2>, avx2_tile<3>, avx2_tile4};
  for (int64_t c = c0; c < c1; ++c)
    for (int64_t r0 = 0; r0 < M; r0 += 4) {
      const int64_t mt = std::min<int64_t>(4, M - r0);
      fn[mt - 1](qx + r0 * K, K, sc + r0 * lds, lds, K, G, wv, dv, mv, y + r0 * N, N, c);
    }
}
#endif

}  // namespace

at::Tensor int4_mm_vnni(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d, const at::Tensor& m,
                        int64_t G) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(2) == 64,
              "firstlight::int4 VNNI packed must be contiguous uint8 [N/16, K/8, 64]");
  const int64_t tiles = packed.size(0), N = tiles * kTile, K = packed.size(1) * 8;
  TORCH_CHECK(G >= kBlock && (G & (G - 1)) == 0 && K % G == 0,
              "firstlight::int4 group_size must be a power of two >= 32 dividing K, got ", G);
  for (const auto* t : {&d, &m})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 && t->size(0) == tiles &&
                    t->size(1) == K / G && t->size(2) == kTile,
                "firstlight::int4 VNNI scales/mins must be contiguous fp32 [N/16, K/G, 16]");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "firstlight::int4_mm_a8 x must be [M, ", K, "], got ", x.sizes());
#if defined(FIRSTLIGHT_VNNI) || defined(FIRSTLIGHT_VNNI_AVX2)
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t M = xf.size(0), lds = K / kBlock + K / G;
  at::Tensor y = at::empty({M, N}, xf.options());
  if (M == 0) return y;
  const auto [qx, sc] = firstlight::quantize_rows_q8(xf, G);  // dx per block, then xs per group
  const int8_t* qp = qx.data_ptr<int8_t>();
  const float* sp = sc.data_ptr<float>();
  const uint8_t* wv = packed.data_ptr<uint8_t>();
  const float *dp = d.data_ptr<float>(), *mp = m.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t grain = M == 1 ? 4 : 2;
  at::parallel_for(0, tiles, grain, [&](int64_t c0, int64_t c1) {
#ifdef FIRSTLIGHT_VNNI
    if (M == 1)
      vnni_rows<4>(qp, sp, lds, M, K, G, wv, dp, mp, yp, N, c0, c1);
    else
      vnni_rows<2>(qp, sp, lds, M, K, G, wv, dp, mp, yp, N, c0, c1);
#else
    avx2_rows(qp, sp, lds, M, K, G, wv, dp, mp, yp, N, c0, c1);
#endif
  });
  return y;
#else
  TORCH_CHECK(false, "firstlight::int4 VNNI layout given to a library built without AVX2 or AVX-512 VNNI");
#endif
}

// The fp32 weight [N, K] of the VNNI layout: fma(q, d, m) per weight, as int4_dequant of the row-major layout.
at::Tensor int4_dequant_vnni(const at::Tensor& packed, const at::Tensor& d, const at::Tensor& m, int64_t G) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.size(2) == 64,
              "firstlight::int4 VNNI packed must be contiguous uint8 [N/16, K/8, 64]");
  const int64_t tiles = packed.size(0), K = packed.size(1) * 8, ngroups = K / G;
  TORCH_CHECK(d.is_contiguous() && m.is_contiguous() && d.numel() == tiles * ngroups * kTile &&
                  m.numel() == d.numel(), "firstlight::int4 VNNI scales/mins must be fp32 [N/16, K/G, 16]");
  at::Tensor w = at::empty({tiles * kTile, K}, d.options());
  const uint8_t* wv = packed.data_ptr<uint8_t>();
  const float *dp = d.data_ptr<float>(), *mp = m.data_ptr<float>();
  float* out = w.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c)
      for (int64_t o = 0; o < K / 8; ++o)
        for (int64_t r = 0; r < kTile; ++r)
          for (int64_t j = 0; j < 8; ++j) {
            const uint8_t byte = wv[(c * (K / 8) + o) * 64 + 4 * r + (j & 3)];
            const int64_t k = 8 * o + j, g = k / G, i = (c * ngroups + g) * kTile + r;
            const float q = static_cast<float>(j < 4 ? (byte & 0xF) : (byte >> 4));
            out[(c * kTile + r) * K + k] = std::fma(q, dp[i], mp[i]);
          }
  });
  return w;
}
