// firstlight int4 weight-only matmul for CPU: y[M, N] = x[M, K] @ W~[N, K]^T in fp32.
//
// Layout (built by firstlight/kernels/__init__.py from quantize_groupwise_int4's codes):
//   packed uint8 [N, K/2]: per output row, blocks of 32 input channels, 16 bytes each; byte j of the
//                          block holds code q[32b + j] in its low nibble and q[32b + 16 + j] in its high one.
//   d, m   fp32  [N, K/G]: per group of G (a multiple of 32) input channels, w = fma(q, d, m), q in 0..15
//                          (d = scale, m = zero - 8 * scale of the tinygemm form).
// AVX2 + FMA path under __AVX2__, a scalar path otherwise; both compute each weight as fmaf(q, d, m).
// M = 1: row_avx2_m1. 2 <= M <= 5: each block unpacked in registers once per output row and reused by a tile
// of up to 8 activation rows (rows_avx2). 6 <= M <= max_tiled_m (128 from Python): int4_mm_panel, the
// weights of 24 output rows dequantized once into an L2-resident fp32 panel, then multiplied as fp32 weights by
// f32_mm's micro-kernel (f32_gemm.cpp f32_block: 4 output x 3 activation rows, 12 accumulators). int8_mm, M >= 2:
// register tiles of NR x MR straight from the int8 rows (no dequantization fma to amortize) with software
// prefetch. Figures (benchmarks/int4_kernel.py --threads 1, 1 thread, same-run vs the earlier per-row tiles):
// int4 M = 8: 1.0-1.3x, M = 16-32: 1.1-1.5x (48-61 GFLOP/s; ~70 peak); int8 M = 2-64: 1.2-1.5x (50-65 GFLOP/s).
// Threads: at::parallel_for over output rows. Larger M: dequantize slabs (same fma), each multiplied on our fp32
// panels (AVX-512 builds) or the BLAS (slab_mm).
// Also: int4_mm_a8 (int8 activations per block of 32, integer dot products: the w4a8 format) and int8_mm
// (per-row int8 weights, aten._weight_int8pack_mm's layout: the int8 linears and tied LM head on CPU).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "firstlight_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kRowChunk = 16;  // output rows per cache chunk: every M tile reuses them from L1/L2

#ifdef __AVX2__
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Rows n0..n1 of y for MT activation rows starting at x.
template <int MT>
void rows_avx2(const float* x, int64_t ldx, const uint8_t* wq, const float* d, const float* m, int64_t K,
               int64_t G, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  constexpr int A = MT == 1 ? 4 : (MT == 2 ? 4 : (MT <= 4 ? 2 : 1));  // independent FMA chains per row
  const int64_t ngroups = K / G, bpg = G / kBlock;
  const __m256i mask = _mm256_set1_epi32(0xF);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = wq + n * (K / 2);
    const float* dr = d + n * ngroups;
    const float* mr = m + n * ngroups;
    __m256 acc[MT][A];
    for (int r = 0; r < MT; ++r)
      for (int a = 0; a < A; ++a) acc[r][a] = _mm256_setzero_ps();
    for (int64_t g = 0; g < ngroups; ++g) {
      const __m256 vd = _mm256_set1_ps(dr[g]), vm = _mm256_set1_ps(mr[g]);
      for (int64_t bb = 0; bb < bpg; ++bb) {
        const int64_t b = g * bpg + bb;
        const uint8_t* p = wr + b * (kBlock / 2);
        const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
        const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
        const __m256 w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b0, mask)), vd, vm);
        const __m256 w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b1, mask)), vd, vm);
        const __m256 w2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), vd, vm);
        const __m256 w3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)), vd, vm);
        const int64_t k0 = b * kBlock;
        for (int r = 0; r < MT; ++r) {
          const float* xr = x + r * ldx + k0;
          acc[r][0 % A] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), acc[r][0 % A]);
          acc[r][1 % A] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), acc[r][1 % A]);
          acc[r][2 % A] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xr + 16), acc[r][2 % A]);
          acc[r][3 % A] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xr + 24), acc[r][3 % A]);
        }
      }
    }
    for (int r = 0; r < MT; ++r) {
      __m256 s = acc[r][0];
      for (int a = 1; a < A; ++a) s = _mm256_add_ps(s, acc[r][a]);
      y[r * ldy + n] = hsum(s);
    }
  }
}

// One block of one output row for M = 1 (see row_avx2_m1): acc + d * sum q x over the block's 32 weights.
inline __m256 block_m1(const uint8_t* p, __m256 x0, __m256 x1, __m256 x2, __m256 x3, const float* d, __m256 acc) {
  const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
  __m256 t0 = _mm256_mul_ps(_mm256_cvtepi32_ps(b0), x0);
  __m256 t1 = _mm256_mul_ps(_mm256_cvtepi32_ps(b1), x1);
  t0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), x2, t0);
  t1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)), x3, t1);
  return _mm256_fmadd_ps(_mm256_add_ps(t0, t1), _mm256_broadcast_ss(d), acc);
}

// acc + the zero-point term of one row (sum over groups of m * xs), its scalar tail in `tail`
inline __m256 mins_term(const float* mr, const float* xs, int64_t ngroups, __m256 acc, float* tail) {
  int64_t g = 0;
  for (; g + 8 <= ngroups; g += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(mr + g), _mm256_loadu_ps(xs + g), acc);
  for (; g < ngroups; ++g) *tail += mr[g] * xs[g];
  return acc;
}

// y[n] .. y[n + 3] = the four row sums (acc[r] lanes + tail[r]): one transpose-add for the four rows.
inline void store4(__m256 a0, __m256 a1, __m256 a2, __m256 a3, const float* tail, float* y) {
  _mm_storeu_ps(y, _mm_add_ps(firstlight::hsum4(a0, a1, a2, a3), _mm_loadu_ps(tail)));
}

// The end of the M = 1 kernels: the zero-point terms of R (1 or 4) rows from n, and their sums into y[n..].
template <int R>
inline void finish_m1(__m256 a0, __m256 a1, __m256 a2, __m256 a3, const float* m, const float* xs, int64_t ngroups,
                      float* y, int64_t n) {
  float tail[4] = {};
  const float* mr = m + n * ngroups;
  a0 = mins_term(mr, xs, ngroups, a0, tail);
  if constexpr (R == 4) {
    a1 = mins_term(mr + ngroups, xs, ngroups, a1, tail + 1);
    a2 = mins_term(mr + 2 * ngroups, xs, ngroups, a2, tail + 2);
    a3 = mins_term(mr + 3 * ngroups, xs, ngroups, a3, tail + 3);
    store4(a0, a1, a2, a3, tail, y + n);
  } else {
    y[n] = hsum(a0) + tail[0];
  }
}

// R (1 or 4) output rows at a time: the x loads are shared. Named accumulators, not an array: with an array
// GCC kept them on the stack, a store and a reload around every fma (perf annotate: 1.3x slower).
template <int R>
void rows_avx2_m1(const float* xt, const float* xs, const uint8_t* wq, const float* d, const float* m, int64_t K,
                  int64_t G, float* y, int64_t n) {
  const int64_t ngroups = K / G, nblocks = K / kBlock, ld = K / 2;
  const int shift = firstlight::block_group_shift(G);  // block -> group: b >> shift
  const uint8_t* w = wq + n * ld;
  const float* dr = d + n * ngroups;
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t b = 0; b < nblocks; ++b) {
    const float* xb = xt + b * kBlock;
    const __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8);
    const __m256 x2 = _mm256_loadu_ps(xb + 16), x3 = _mm256_loadu_ps(xb + 24);
    const uint8_t* p = w + b * (kBlock / 2);
    if ((b & 3) == 0)  // next R rows, a line ahead (never faults): +15-21% per streamed step
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(p + (R + r) * ld), _MM_HINT_T0);
    const float* db = dr + (b >> shift);
    a0 = block_m1(p, x0, x1, x2, x3, db, a0);
    if constexpr (R == 4) {
      a1 = block_m1(p + ld, x0, x1, x2, x3, db + ngroups, a1);
      a2 = block_m1(p + 2 * ld, x0, x1, x2, x3, db + 2 * ngroups, a2);
      a3 = block_m1(p + 3 * ld, x0, x1, x2, x3, db + 3 * ngroups, a3);
    }
  }
  finish_m1<R>(a0, a1, a2, a3, m, xs, ngroups, y, n);
}

// M = 1 (single-stream decode): fewer instructions per weight. With byte = lo + 16 * hi of each block,
//   sum q x = sum byte * x_lo + sum hi * (x_hi - 16 x_lo)        (xt holds x_lo and x_hi - 16 x_lo)
//   sum w x = sum_blocks d * sum q x + sum_groups m * (sum of x over the group)   (xs: those sums)
// so a block is 2 zero-extending loads, 2 shifts, 4 converts, 5 multiply-adds and one by d; no mask, no
// per-weight fma(q, d, m). The cancellation in x_hi - 16 x_lo costs at most 4 bits of fp32 mantissa.
void row_avx2_m1(const float* xt, const float* xs, const uint8_t* wq, const float* d, const float* m, int64_t K,
                 int64_t G, float* y, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) rows_avx2_m1<4>(xt, xs, wq, d, m, K, G, y, n);
  for (; n < n1; ++n) rows_avx2_m1<1>(xt, xs, wq, d, m, K, G, y, n);
}

// ---- Batched decode, 6 <= M <= max_tiled_m (kPanelMinM): per chunk of kTileRows output rows (and K chunk),
// the weights are dequantized once (the same fma(q, d, m) per weight) into a per-thread fp32 panel that stays
// in L2, and every activation row reads it there: the unpack is paid once per weight, not once per weight and
// M tile. The panel times x is f32_block's: per 4 panel rows (in L1) every activation row, 3 at a time.
// Below kPanelMinM rows the panel's store and reload (~1.2-1.6 cycles per 8 weights) cost more than
// unpacking in registers per row (rows_avx2, tiles of up to 8 activation rows).

// Sums of the accumulators acc[i], i < C, into out[i].
template <int C>
inline void hsums(const __m256* acc, float* out) {
  int i = 0;
  for (; i + 4 <= C; i += 4) {
    _mm_storeu_ps(out + i, firstlight::hsum4(acc[i], acc[i + 1], acc[i + 2], acc[i + 3]));
  }
  for (; i < C; ++i) out[i] = hsum(acc[i]);
}

// int4 rows n0..n1, blocks kb0..kb1 -> fp32 out [n1 - n0, ldo]: w = fma(q, d, m) (int4_dequant's too).
void dequant_int4_avx2(const uint8_t* wq, const float* d, const float* m, int64_t K, int64_t G, int64_t n0,
                       int64_t n1, int64_t kb0, int64_t kb1, float* out, int64_t ldo) {
  const int64_t ngroups = K / G;
  const int shift = firstlight::block_group_shift(G);  // block -> group: b >> shift
  const __m256i mask = _mm256_set1_epi32(0xF);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = wq + n * (K / 2);
    const float *dr = d + n * ngroups, *mr = m + n * ngroups;
    float* o = out + (n - n0) * ldo - kb0 * kBlock;
    for (int64_t b = kb0; b < kb1; ++b) {
      const __m256 vd = _mm256_broadcast_ss(dr + (b >> shift)), vm = _mm256_broadcast_ss(mr + (b >> shift));
      const uint8_t* p = wr + b * (kBlock / 2);
      const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
      const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
      float* ob = o + b * kBlock;
      _mm256_storeu_ps(ob, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b0, mask)), vd, vm));
      _mm256_storeu_ps(ob + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b1, mask)), vd, vm));
      _mm256_storeu_ps(ob + 16, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), vd, vm));
      _mm256_storeu_ps(ob + 24, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)), vd, vm));
    }
  }
}

constexpr int64_t kPanelMinM = 6;
constexpr int kMaxMR = 4;                   // activation rows per register tile (M split as evenly as possible)
constexpr int64_t kTileRows = 24;           // output rows per panel: a multiple of every NR
constexpr int64_t kPanelBytes = 144 << 10;  // of the 512 KiB L2; longer K is split in chunks of whole groups

constexpr int nr_for(int mr) { return mr <= 2 ? 4 : 3; }

void int4_mm_panel(const float* x, int64_t M, int64_t K, int64_t N, const uint8_t* wq, const float* d,
                   const float* m, int64_t G, float* y) {
  const int64_t nblocks = K / kBlock, bpg = G / kBlock;
  const int64_t fit = kPanelBytes / (kTileRows * kBlock * 4);  // blocks of a full panel
  const int64_t chunks = (nblocks + fit - 1) / fit;
  const int64_t cb = std::max<int64_t>(1, (nblocks / bpg + chunks - 1) / chunks) * bpg;  // whole groups
  at::parallel_for(0, N, kTileRows, [&](int64_t n0, int64_t n1) {
    thread_local std::vector<float> buf;
    buf.resize(static_cast<size_t>(kTileRows * cb * kBlock));
    for (int64_t c0 = n0; c0 < n1; c0 += kTileRows) {
      const int64_t c1 = std::min(c0 + kTileRows, n1);
      for (int64_t kb0 = 0; kb0 < nblocks; kb0 += cb) {
        const int64_t kb1 = std::min(kb0 + cb, nblocks), len = (kb1 - kb0) * kBlock;
        dequant_int4_avx2(wq, d, m, K, G, c0, c1, kb0, kb1, buf.data(), len);
        for (int64_t n = c0; n < c1; n += 4)  // the panel as fp32 weights: f32_mm's micro-kernel
          firstlight::f32_block(x + kb0 * kBlock, K, M, buf.data() + (n - c0) * len, len, len, y + n, N,
                                std::min<int64_t>(4, c1 - n), kb0 > 0, nullptr);
      }
    }
  });
}

// The vector width of int8_tile: 8 lanes (AVX2), or 16 in the avx512vnni build (16 weights converted per
// instruction, twice the fmas per instruction, 32 registers: always 4 output rows).
struct Lanes8 : firstlight::F32x8 {
  static constexpr int nr(int mr) { return nr_for(mr); }
  static T weights(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  template <int C>
  static void sums(const T* acc, float* out) { hsums<C>(acc, out); }
};

#ifdef __AVX512F__
struct Lanes16 : firstlight::F32x16 {
  static constexpr int nr(int) { return 4; }
  static T weights(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  template <int C>
  static void sums(const T* acc, float* out) {
    for (int i = 0; i < C; ++i) out[i] = _mm512_reduce_add_ps(acc[i]);
  }
};
using Int8Lanes = Lanes16;
#else
using Int8Lanes = Lanes8;
#endif

// int8 weights, 2 <= M: register tiles of NR output rows x MR activation rows, each weight vector
// sign-extended and converted once per tile (no fma: the row scale is applied to the sums), software
// prefetch of the next tile's rows (without it, NR interleaved rows streamed from DRAM ran 1.7x slower).
template <class V, int NR, int MR>
void int8_tile(const float* x, int64_t ldx, const int8_t* w, int64_t K, const float* s, float* y, int64_t ldy,
               int64_t n) {
  typename V::T acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < MR; ++t) acc[r][t] = V::zero();
  const int8_t* wr = w + n * K;
  for (int64_t k = 0; k < K; k += kBlock) {
    if ((k & 63) == 0)  // a line ahead (never faults)
      for (int r = 0; r < NR; ++r) _mm_prefetch(reinterpret_cast<const char*>(wr + (NR + r) * K + k), _MM_HINT_T0);
#pragma GCC unroll 4
    for (int i = 0; i < kBlock / V::kLanes; ++i) {
      typename V::T wf[NR];
      for (int r = 0; r < NR; ++r) wf[r] = V::weights(wr + r * K + k + V::kLanes * i);
      for (int t = 0; t < MR; ++t) {
        const typename V::T xv = V::load(x + t * ldx + k + V::kLanes * i);
        for (int r = 0; r < NR; ++r) acc[r][t] = V::fma(wf[r], xv, acc[r][t]);
      }
    }
  }
  float out[NR * MR];
  V::template sums<NR * MR>(&acc[0][0], out);
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < MR; ++t) y[t * ldy + n + r] = out[r * MR + t] * s[n + r];
}

template <int MR>
void int8_rows(const float* x, int64_t ldx, const int8_t* w, int64_t K, const float* s, float* y, int64_t ldy,
               int64_t n0, int64_t n1) {
  constexpr int NR = Int8Lanes::nr(MR);
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) int8_tile<Int8Lanes, NR, MR>(x, ldx, w, K, s, y, ldy, n);
  for (; n < n1; ++n) int8_tile<Int8Lanes, 1, MR>(x, ldx, w, K, s, y, ldy, n);
}

using Int8RowsFn = decltype(&int8_rows<1>);
constexpr Int8RowsFn kInt8Rows[] = {int8_rows<1>, int8_rows<2>, int8_rows<3>, int8_rows<4>};
static_assert(sizeof(kInt8Rows) / sizeof(kInt8Rows[0]) == kMaxMR, "one tile function per M tile height");

void int8_mm_tiles(const float* x, int64_t M, int64_t K, int64_t N, const int8_t* w, const float* s, float* y) {
  const int64_t tiles = (M + kMaxMR - 1) / kMaxMR;
  at::parallel_for(0, N, kTileRows, [&](int64_t n0, int64_t n1) {
    for (int64_t c0 = n0; c0 < n1; c0 += kTileRows) {
      const int64_t c1 = std::min(c0 + kTileRows, n1);
      for (int64_t t = 0, r0 = 0; t < tiles; ++t) {
        const int mt = static_cast<int>(M / tiles + (t < M % tiles ? 1 : 0));
        kInt8Rows[mt - 1](x + r0 * K, K, w, K, s, y + r0 * N, N, c0, c1);
        r0 += mt;
      }
    }
  });
}
#endif

// ---- int8 activations (llama.cpp's Q4_1 x Q8_1 idea): x is rounded once per call to int8 per block of 32,
//   x^[k] = dx_b * qx[k], dx_b = max|x_b| / 127, qx = round(x * 127 / max|x_b|) in -127..127,
// and y = W~ x^ exactly up to fp32 summation: per block an integer dot sum q * qx (maddubs of the unsigned
// nibbles with the signed bytes, then madd with ones: 32 products in int32, no overflow: 32 * 15 * 127),
// times d * dx_b; plus per group m * (sum of x^ over the group). Error vs W~ x: |W~ (x^ - x)| <=
// sum_k |w~_k| dx_b / 2.

}  // namespace

// One activation row -> qx [K] int8, dx [K/32], xs [K/G] = sum over the group of dx_b * sum qx_b. The AVX2 path
// does the scalar path's fp32 operations (x * (127 / amax) rounded to nearest even), eight lanes at a time.
void firstlight::quantize_row_q8(const float* x, int64_t K, int64_t G, int8_t* qx, float* dx, float* xs) {
  const int64_t nblocks = K / kBlock, bpg = G / kBlock;
  for (int64_t g = 0; g < K / G; ++g) xs[g] = 0.f;
  for (int64_t b = 0; b < nblocks; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.f;
    int32_t isum = 0;
#ifdef __AVX2__
    const __m256 sign = _mm256_set1_ps(-0.f);
    const __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8);
    const __m256 v2 = _mm256_loadu_ps(xb + 16), v3 = _mm256_loadu_ps(xb + 24);
    __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                              _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const __m256 id = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, id)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, id));
    const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, id)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, id));
    // packs interleave the 128-bit lanes: dwords come out as i0a i1a i2a i3a i0b i1b i2b i3b (a/b: lane halves)
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qx + b * kBlock),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    const __m256i s = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    isum = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1)));
#else
    for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float id = amax > 0.f ? 127.f / amax : 0.f;
    for (int64_t j = 0; j < kBlock; ++j) {
      const int32_t q = static_cast<int32_t>(std::nearbyint(xb[j] * id));
      qx[b * kBlock + j] = static_cast<int8_t>(q);
      isum += q;
    }
#endif
    dx[b] = amax / 127.f;
    xs[b / bpg] += dx[b] * static_cast<float>(isum);
  }
}

firstlight::RowsQ8 firstlight::quantize_rows_q8(const at::Tensor& xf, int64_t G) {
  const int64_t M = xf.size(0), K = xf.size(1), nblocks = K / kBlock, lds = nblocks + K / G;
  RowsQ8 out{at::empty({M, K}, xf.options().dtype(at::kChar)), at::empty({M, lds}, xf.options())};
  const float* xp = xf.data_ptr<float>();
  int8_t* qp = out.qx.data_ptr<int8_t>();
  float* sp = out.sc.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) quantize_row_q8(xp + r * K, K, G, qp + r * K, sp + r * lds, sp + r * lds + nblocks);
  });
  return out;
}

namespace {

#ifdef __AVX2__
// R output rows x MT activation rows: each weight block is unpacked once (a 16-byte broadcast load, one
// variable shift that moves the high lane's nibbles down, one and) and multiplied with every row's bytes.
template <int R, int MT>
void rows_avx2_a8(const int8_t* qx, const float* sc, int64_t lds, int64_t K, const uint8_t* wq, const float* d,
                  const float* m, int64_t G, float* y, int64_t ldy, int64_t n) {
  const int64_t ngroups = K / G, nblocks = K / kBlock;
  const int shift = firstlight::block_group_shift(G);  // block -> group: b >> shift
  const __m256i low = _mm256_set1_epi8(0xF);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i nib = _mm256_set_epi64x(4, 4, 0, 0);
  __m256 acc[MT][R];
  for (int t = 0; t < MT; ++t)
    for (int r = 0; r < R; ++r) acc[t][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nblocks; ++b) {
    __m256i xv[MT];
    __m256 vdx[MT];
    for (int t = 0; t < MT; ++t) {
      xv[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + t * K + b * kBlock));
      vdx[t] = _mm256_broadcast_ss(sc + t * lds + b);
    }
    if ((b & 3) == 0)  // next R rows, a line ahead (never faults): +15-21% per streamed step
      for (int r = 0; r < R; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(wq + (n + R + r) * (K / 2) + b * (kBlock / 2)), _MM_HINT_T0);
    for (int r = 0; r < R; ++r) {
      const __m256i raw = _mm256_broadcastsi128_si256(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(wq + (n + r) * (K / 2) + b * (kBlock / 2))));
      const __m256i q = _mm256_and_si256(_mm256_srlv_epi64(raw, nib), low);  // q[0..15], q[16..31]
      const __m256 vd = _mm256_broadcast_ss(d + (n + r) * ngroups + (b >> shift));
      for (int t = 0; t < MT; ++t) {
        const __m256i s32 = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv[t]), ones);
        acc[t][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), _mm256_mul_ps(vd, vdx[t]), acc[t][r]);
      }
    }
  }
  for (int t = 0; t < MT; ++t) {
    const float* xs = sc + t * lds + nblocks;
    float tail[R] = {};
    for (int r = 0; r < R; ++r) {
      const float* mr = m + (n + r) * ngroups;
      int64_t g = 0;
      for (; g + 8 <= ngroups; g += 8)
        acc[t][r] = _mm256_fmadd_ps(_mm256_loadu_ps(mr + g), _mm256_loadu_ps(xs + g), acc[t][r]);
      for (; g < ngroups; ++g) tail[r] += mr[g] * xs[g];
    }
    float* yt = y + t * ldy;
    if constexpr (R == 4) {
      store4(acc[t][0], acc[t][1], acc[t][2], acc[t][3], tail, yt + n);
    } else {
      for (int r = 0; r < R; ++r) yt[n + r] = hsum(acc[t][r]) + tail[r];
    }
  }
}

// One block of one output row for M = 1 of int4_mm_a8: acc + d * dx * (q . qx) over the block.
inline __m256 block_a8(const uint8_t* p, __m256i xv, __m256 vdx, const float* d, __m256 acc) {
  const __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i q = _mm256_and_si256(_mm256_srlv_epi64(raw, _mm256_set_epi64x(4, 4, 0, 0)), _mm256_set1_epi8(0xF));
  const __m256i s32 = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), _mm256_set1_epi16(1));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), _mm256_mul_ps(_mm256_broadcast_ss(d), vdx), acc);
}

// rows_avx2_a8 for one activation row, R (1 or 4) output rows, with named accumulators (as rows_avx2_m1).
template <int R>
void rows_avx2_a8_m1(const int8_t* qx, const float* sc, int64_t K, const uint8_t* wq, const float* d,
                     const float* m, int64_t G, float* y, int64_t n) {
  const int64_t ngroups = K / G, nblocks = K / kBlock, ld = K / 2;
  const int shift = firstlight::block_group_shift(G);  // block -> group: b >> shift
  const uint8_t* w = wq + n * ld;
  const float* dr = d + n * ngroups;
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t b = 0; b < nblocks; ++b) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + b * kBlock));
    const __m256 vdx = _mm256_broadcast_ss(sc + b);
    const uint8_t* p = w + b * (kBlock / 2);
    if ((b & 3) == 0)
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(p + (R + r) * ld), _MM_HINT_T0);
    const float* db = dr + (b >> shift);
    a0 = block_a8(p, xv, vdx, db, a0);
    if constexpr (R == 4) {
      a1 = block_a8(p + ld, xv, vdx, db + ngroups, a1);
      a2 = block_a8(p + 2 * ld, xv, vdx, db + 2 * ngroups, a2);
      a3 = block_a8(p + 3 * ld, xv, vdx, db + 3 * ngroups, a3);
    }
  }
  const float* xs = sc + nblocks;
  finish_m1<R>(a0, a1, a2, a3, m, xs, ngroups, y, n);
}

template <int MT>
void rows_avx2_a8_all(const int8_t* qx, const float* sc, int64_t lds, int64_t K, const uint8_t* wq, const float* d,
                      const float* m, int64_t G, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  constexpr int R = MT == 1 ? 4 : 2;
  int64_t n = n0;
  if constexpr (MT == 1) {
    for (; n + 4 <= n1; n += 4) rows_avx2_a8_m1<4>(qx, sc, K, wq, d, m, G, y, n);
    for (; n < n1; ++n) rows_avx2_a8_m1<1>(qx, sc, K, wq, d, m, G, y, n);
    return;
  }
  for (; n + R <= n1; n += R) rows_avx2_a8<R, MT>(qx, sc, lds, K, wq, d, m, G, y, ldy, n);
  for (; n < n1; ++n) rows_avx2_a8<1, MT>(qx, sc, lds, K, wq, d, m, G, y, ldy, n);
}
#endif

// Output rows n0..n1 of MT (<= 4) quantized activation rows: qx [MT, K]; sc [MT, lds] = dx per block, then
// xs per group.
void rows_a8(int64_t MT, const int8_t* qx, const float* sc, int64_t lds, int64_t K, const uint8_t* wq,
             const float* d, const float* m, int64_t G, float* y, int64_t ldy, int64_t n0, int64_t n1) {
#ifdef __AVX2__
  switch (MT) {
    case 1: return rows_avx2_a8_all<1>(qx, sc, lds, K, wq, d, m, G, y, ldy, n0, n1);
    case 2: return rows_avx2_a8_all<2>(qx, sc, lds, K, wq, d, m, G, y, ldy, n0, n1);
    case 3: return rows_avx2_a8_all<3>(qx, sc, lds, K, wq, d, m, G, y, ldy, n0, n1);
    default: return rows_avx2_a8_all<4>(qx, sc, lds, K, wq, d, m, G, y, ldy, n0, n1);
  }
#else
  const int64_t ngroups = K / G, nblocks = K / kBlock;
  for (int64_t t = 0; t < MT; ++t)
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* wr = wq + n * (K / 2);
      const int8_t* xq = qx + t * K;
      const float* dx = sc + t * lds;
      float acc = 0.f;
      for (int64_t b = 0; b < nblocks; ++b) {
        int32_t s = 0;
        for (int64_t j = 0; j < kBlock / 2; ++j) {
          const uint8_t byte = wr[b * (kBlock / 2) + j];
          s += (byte & 0xF) * xq[b * kBlock + j] + (byte >> 4) * xq[b * kBlock + kBlock / 2 + j];
        }
        acc += d[n * ngroups + b * kBlock / G] * dx[b] * static_cast<float>(s);
      }
      for (int64_t g = 0; g < ngroups; ++g) acc += m[n * ngroups + g] * dx[nblocks + g];
      y[t * ldy + n] = acc;
    }
#endif
}

// ---- int8 weight-only (symmetric per output row, as aten._weight_int8pack_mm): y[m, n] = s[n] * sum_k q[n, k] x[m, k].
// float activations: each weight block is widened once (4 x 8 int8 -> fp32) and used by every activation
// row of the tile; int8 activations (as the int4 path): per block the int32 dot product of the row's bytes
// with the activation's (maddubs needs one unsigned operand: |qx| and q carrying qx's sign, as llama.cpp's
// Q8_0 x Q8_0), times dx_b.

template <int MT>
void i8_rows_f32(const float* x, int64_t K, const int8_t* w, const float* s, float* y, int64_t ldy, int64_t n0,
                 int64_t n1) {
#ifdef __AVX2__
  constexpr int A = MT == 1 ? 4 : (MT == 2 ? 2 : 1);
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wr = w + n * K;
    __m256 acc[MT][A];
    for (int t = 0; t < MT; ++t)
      for (int a = 0; a < A; ++a) acc[t][a] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += kBlock) {
      __m256 wf[4];
      for (int i = 0; i < 4; ++i)
        wf[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wr + k + 8 * i))));
      for (int t = 0; t < MT; ++t)
        for (int i = 0; i < 4; ++i)
          acc[t][i % A] = _mm256_fmadd_ps(wf[i], _mm256_loadu_ps(x + t * K + k + 8 * i), acc[t][i % A]);
    }
    for (int t = 0; t < MT; ++t) {
      __m256 v = acc[t][0];
      for (int a = 1; a < A; ++a) v = _mm256_add_ps(v, acc[t][a]);
      y[t * ldy + n] = hsum(v) * s[n];
    }
  }
#else
  for (int64_t n = n0; n < n1; ++n)
    for (int t = 0; t < MT; ++t) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += static_cast<float>(w[n * K + k]) * x[t * K + k];
      y[t * ldy + n] = acc * s[n];
    }
#endif
}

#ifdef __AVX2__
// One output row at a time, two accumulators: at the LM head's 49152 x 576 this streamed faster than
// four interleaved rows (3.2 vs 5.2 ms, same run), unlike the int4 rows (half as long).
void i8_row_a8_avx2(const int8_t* qx, const float* dx, int64_t K, const int8_t* w, const float* s, float* y, int64_t n) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  const int8_t* wr = w + n * K;
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + b * kBlock));
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + b * kBlock));
    const __m256i s32 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(xv, xv), _mm256_sign_epi8(wv, xv)), ones);
    acc[b & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), _mm256_broadcast_ss(dx + b), acc[b & 1]);
  }
  y[n] = hsum(_mm256_add_ps(acc[0], acc[1])) * s[n];
}
#endif

void i8_rows_a8(const int8_t* qx, const float* dx, int64_t K, const int8_t* w, const float* s, float* y, int64_t n0,
                int64_t n1) {
#ifdef __AVX2__
  for (int64_t n = n0; n < n1; ++n) i8_row_a8_avx2(qx, dx, K, w, s, y, n);
#else
  for (int64_t n = n0; n < n1; ++n) {
    float acc = 0.f;
    for (int64_t b = 0; b < K / kBlock; ++b) {
      int32_t d = 0;
      for (int64_t j = 0; j < kBlock; ++j) d += w[n * K + b * kBlock + j] * qx[b * kBlock + j];
      acc += dx[b] * static_cast<float>(d);
    }
    y[n] = acc * s[n];
  }
#endif
}

template <int MT>
void rows_scalar(const float* x, int64_t ldx, const uint8_t* wq, const float* d, const float* m, int64_t K,
                 int64_t G, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t ngroups = K / G;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = wq + n * (K / 2);
    float acc[MT] = {};
    for (int64_t b = 0; b < K / kBlock; ++b) {
      const float dg = d[n * ngroups + b * kBlock / G], mg = m[n * ngroups + b * kBlock / G];
      for (int64_t j = 0; j < kBlock / 2; ++j) {
        const uint8_t byte = wr[b * (kBlock / 2) + j];
        const float lo = std::fma(static_cast<float>(byte & 0xF), dg, mg);
        const float hi = std::fma(static_cast<float>(byte >> 4), dg, mg);
        const int64_t k = b * kBlock + j;
        for (int r = 0; r < MT; ++r) acc[r] += lo * x[r * ldx + k] + hi * x[r * ldx + k + kBlock / 2];
      }
    }
    for (int r = 0; r < MT; ++r) y[r * ldy + n] = acc[r];
  }
}

using RowsFn = void (*)(const float*, int64_t, const uint8_t*, const float*, const float*, int64_t, int64_t,
                        float*, int64_t, int64_t, int64_t);

template <int MT>
RowsFn rows_fn() {
#ifdef __AVX2__
  return rows_avx2<MT>;
#else
  return rows_scalar<MT>;
#endif
}

RowsFn tile_fn(int64_t mt) {
  switch (mt) {
    case 1: return rows_fn<1>();
    case 2: return rows_fn<2>();
    case 3: return rows_fn<3>();
    case 4: return rows_fn<4>();
    case 5: return rows_fn<5>();
    case 6: return rows_fn<6>();
    case 7: return rows_fn<7>();
    default: return rows_fn<8>();
  }
}

void check_args(const at::Tensor& packed, const at::Tensor& d, const at::Tensor& m, int64_t G) {
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "firstlight::int4 packed must be contiguous uint8 [N, K/2]");
  const int64_t N = packed.size(0), K = packed.size(1) * 2;
  TORCH_CHECK(G >= kBlock && (G & (G - 1)) == 0 && K % G == 0,
              "firstlight::int4 group_size must be a power of two >= 32 dividing K, got ", G);
  for (const auto* t : {&d, &m})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == N &&
                    t->size(1) == K / G,
                "firstlight::int4 scales/mins must be contiguous fp32 [N, K/G]");
}

}  // namespace

at::Tensor int4_dequant(const at::Tensor& packed, const at::Tensor& d, const at::Tensor& m, int64_t G) {
  if (packed.dim() == 3) return int4_dequant_vnni(packed, d, m, G);
  check_args(packed, d, m, G);
  const int64_t N = packed.size(0), K = packed.size(1) * 2;
  at::Tensor w = at::empty({N, K}, d.options());
  const uint8_t* wq = packed.data_ptr<uint8_t>();
  const float *dp = d.data_ptr<float>(), *mp = m.data_ptr<float>();
  float* out = w.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
#ifdef __AVX2__
    dequant_int4_avx2(wq, dp, mp, K, G, n0, n1, 0, K / kBlock, out + n0 * K, K);
#else
    const int64_t ngroups = K / G;
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t k = 0; k < K; ++k) {
        const int64_t b = k / kBlock, j = k % kBlock;
        const uint8_t byte = wq[n * (K / 2) + b * (kBlock / 2) + (j % (kBlock / 2))];
        const float q = static_cast<float>(j < kBlock / 2 ? (byte & 0xF) : (byte >> 4));
        out[n * K + k] = std::fma(q, dp[n * ngroups + k / G], mp[n * ngroups + k / G]);
      }
#endif
  });
  return w;
}

// A prefill's product with one dequantized fp32 slab of the weight, x [M, K] @ w [len, K]^T: on AVX-512 builds our
// packed panels (f32_gemm.cpp: the slab packed, then its AVX-512 micro-kernel), since torch's BLAS (MKL) runs its
// AVX2 code on AMD CPUs; elsewhere the BLAS
static at::Tensor slab_mm(const at::Tensor& xf, const at::Tensor& w) {
#ifdef __AVX512F__
  return f32_mm_packed(xf, f32_pack(w), w.size(0), c10::nullopt);
#else
  return at::mm(xf, w.t());
#endif
}

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d, const at::Tensor& m,
                   int64_t G, int64_t max_tiled_m) {
  check_args(packed, d, m, G);
  const int64_t N = packed.size(0), K = packed.size(1) * 2;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "firstlight::int4_mm x must be [M, ", K, "], got ", x.sizes());
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t M = xf.size(0);
  if (M > max_tiled_m) {  // prefill: dequantize (the same fma) a slab of rows at a time, then slab_mm
    const int64_t slab = std::max<int64_t>(64, (int64_t{1} << 20) / K);  // ~4 MiB of fp32 weight
    if (N <= slab) return slab_mm(xf, int4_dequant(packed, d, m, G));
    at::Tensor y = at::empty({M, N}, xf.options());
    for (int64_t n0 = 0; n0 < N; n0 += slab) {
      const int64_t len = std::min(slab, N - n0);
      const at::Tensor w = int4_dequant(packed.narrow(0, n0, len), d.narrow(0, n0, len), m.narrow(0, n0, len), G);
      y.narrow(1, n0, len).copy_(slab_mm(xf, w));
    }
    return y;
  }
  at::Tensor y = at::empty({M, N}, xf.options());
  if (M == 0) return y;
  const float* xp = xf.data_ptr<float>();
  const uint8_t* wq = packed.data_ptr<uint8_t>();
  const float *dp = d.data_ptr<float>(), *mp = m.data_ptr<float>();
  float* yp = y.data_ptr<float>();
#ifdef __AVX2__
  if (M == 1) {
    const int64_t ngroups = K / G;
    at::Tensor xt = at::empty({K + ngroups}, xf.options());  // transformed x, then its per-group sums
    float* xtp = xt.data_ptr<float>();
    float* xsp = xtp + K;
    for (int64_t g = 0; g < ngroups; ++g) {
      float sum = 0.f;
      for (int64_t k = g * G; k < (g + 1) * G; ++k) sum += xp[k];
      xsp[g] = sum;
    }
    for (int64_t b = 0; b < K / kBlock; ++b)
      for (int64_t j = 0; j < kBlock / 2; ++j) {
        const float lo = xp[b * kBlock + j], hi = xp[b * kBlock + kBlock / 2 + j];
        xtp[b * kBlock + j] = lo;
        xtp[b * kBlock + kBlock / 2 + j] = hi - 16.f * lo;
      }
    at::parallel_for(0, N, kRowChunk, [&](int64_t n0, int64_t n1) {
      row_avx2_m1(xtp, xsp, wq, dp, mp, K, G, yp, n0, n1);
    });
    return y;
  }
  if (M >= kPanelMinM) {
    int4_mm_panel(xp, M, K, N, wq, dp, mp, G, yp);
    return y;
  }
#endif
  at::parallel_for(0, N, kRowChunk, [&](int64_t n0, int64_t n1) {
    for (int64_t c0 = n0; c0 < n1; c0 += kRowChunk) {
      const int64_t c1 = std::min(c0 + kRowChunk, n1);
      for (int64_t r0 = 0; r0 < M; r0 += 8) {
        const int64_t mt = std::min<int64_t>(8, M - r0);
        tile_fn(mt)(xp + r0 * K, K, wq, dp, mp, K, G, yp + r0 * N, N, c0, c1);
      }
    }
  });
  return y;
}

at::Tensor int4_mm_a8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d, const at::Tensor& m,
                      int64_t G, int64_t max_tiled_m) {
  if (packed.dim() == 3) return int4_mm_vnni(x, packed, d, m, G);  // kernels.pack_int4_vnni's layout
  check_args(packed, d, m, G);
  const int64_t N = packed.size(0), K = packed.size(1) * 2, ngroups = K / G, nblocks = K / kBlock;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "firstlight::int4_mm_a8 x must be [M, ", K, "], got ", x.sizes());
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t M = xf.size(0);
  at::Tensor y = at::empty({M, N}, xf.options());
  if (M == 0) return y;
  const auto [qx, sc] = firstlight::quantize_rows_q8(xf, G);  // dx per block, then xs per group
  const int8_t* qp = qx.data_ptr<int8_t>();
  const float* sp = sc.data_ptr<float>();
  if (M > max_tiled_m) {  // prefill: the same numerics, W~ x^, through the fp32 path on x^ = dx * qx
    const at::Tensor xh = (qx.to(at::kFloat).view({M, nblocks, kBlock}) *
                           sc.narrow(1, 0, nblocks).unsqueeze(2)).view({M, K});
    return int4_mm(xh, packed, d, m, G, max_tiled_m);
  }
  const uint8_t* wq = packed.data_ptr<uint8_t>();
  const float *dp = d.data_ptr<float>(), *mp = m.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t lds = nblocks + ngroups;
  at::parallel_for(0, N, kRowChunk, [&](int64_t n0, int64_t n1) {
    for (int64_t c0 = n0; c0 < n1; c0 += kRowChunk) {
      const int64_t c1 = std::min(c0 + kRowChunk, n1);
      for (int64_t r0 = 0; r0 < M; r0 += 4) {
        const int64_t mt = std::min<int64_t>(4, M - r0);
        rows_a8(mt, qp + r0 * K, sp + r0 * lds, lds, K, wq, dp, mp, G, yp + r0 * N, N, c0, c1);
      }
    }
  });
  return y;
}

at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, bool act_int8,
                   int64_t max_tiled_m) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous() && q.size(1) % kBlock == 0,
              "firstlight::int8_mm weight must be contiguous int8 [N, K], K a multiple of 32");
  const int64_t N = q.size(0), K = q.size(1), nblocks = K / kBlock;
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == N, "firstlight::int8_mm scales must be [N]");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "firstlight::int8_mm x must be [M, ", K, "], got ", x.sizes());
  at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor sf = scales.to(at::kFloat).contiguous();
  const int64_t M = xf.size(0);
  at::Tensor y = at::empty({M, N}, xf.options());
  if (M == 0) return y;
  // int8 activations: dx per block, then the (unused) sum
  const firstlight::RowsQ8 q8 = act_int8 ? firstlight::quantize_rows_q8(xf, K) : firstlight::RowsQ8{};
  const at::Tensor &qx = q8.qx, &sc = q8.sc;
  if (M > max_tiled_m) {  // prefill: dequantize a slab of rows at a time (exact: int8 * fp32 scale), slab_mm
    if (act_int8)
      xf = (qx.to(at::kFloat).view({M, nblocks, kBlock}) * sc.narrow(1, 0, nblocks).unsqueeze(2)).view({M, K});
    const int64_t slab = std::max<int64_t>(64, (int64_t{1} << 20) / K);
    for (int64_t n0 = 0; n0 < N; n0 += slab) {
      const int64_t len = std::min(slab, N - n0);
      const at::Tensor w = q.narrow(0, n0, len).to(at::kFloat) * sf.narrow(0, n0, len).unsqueeze(1);
      y.narrow(1, n0, len).copy_(slab_mm(xf, w));
    }
    return y;
  }
  const int8_t* wp = q.data_ptr<int8_t>();
  const float* sp = sf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float* xp = xf.data_ptr<float>();
#ifdef __AVX2__
  if (M >= 2 && !act_int8) {
    int8_mm_tiles(xp, M, K, N, wp, sp, yp);
    return y;
  }
#endif
  at::parallel_for(0, N, kRowChunk, [&](int64_t n0, int64_t n1) {
    for (int64_t c0 = n0; c0 < n1; c0 += kRowChunk) {
      const int64_t c1 = std::min(c0 + kRowChunk, n1);
      if (act_int8) {
        for (int64_t r = 0; r < M; ++r)
          i8_rows_a8(qx.data_ptr<int8_t>() + r * K, sc.data_ptr<float>() + r * (nblocks + 1), K, wp, sp,
                     yp + r * N, c0, c1);
        continue;
      }
      for (int64_t r0 = 0; r0 < M; r0 += 4) {
        const int64_t mt = std::min<int64_t>(4, M - r0);
        const float* xr = xp + r0 * K;
        float* yr = yp + r0 * N;
        switch (mt) {
          case 1: i8_rows_f32<1>(xr, K, wp, sp, yr, N, c0, c1); break;
          case 2: i8_rows_f32<2>(xr, K, wp, sp, yr, N, c0, c1); break;
          case 3: i8_rows_f32<3>(xr, K, wp, sp, yr, N, c0, c1); break;
          default: i8_rows_f32<4>(xr, K, wp, sp, yr, N, c0, c1); break;
        }
      }
    }
  });
  return y;
}

// How many threads an at::parallel_for of this library runs on (torch.set_num_threads of them when the library
// was built with OpenMP; 1 when it was not, whatever torch's setting: the check of tests/quant/test_int4_kernel.py).
int64_t parallel_threads() {
  std::vector<char> seen(static_cast<size_t>(at::get_num_threads()) + 1, 0);
  at::parallel_for(0, 1 << 12, 1, [&](int64_t, int64_t) {
    seen[static_cast<size_t>(std::min<int64_t>(at::get_thread_num(), static_cast<int64_t>(seen.size()) - 1))] = 1;
  });
  int64_t n = 0;
  for (char c : seen) n += c;
  return n;
}

TORCH_LIBRARY(firstlight, lib) {
  lib.def("parallel_threads() -> int", &parallel_threads);
  lib.def("int4_mm(Tensor x, Tensor packed, Tensor scales, Tensor mins, int group_size, int max_tiled_m) -> Tensor");
  lib.def("int4_mm_a8(Tensor x, Tensor packed, Tensor scales, Tensor mins, int group_size, int max_tiled_m) -> Tensor");
  lib.def("int8_mm(Tensor x, Tensor qweight, Tensor scales, bool act_int8, int max_tiled_m) -> Tensor");
  lib.def("int4_dequant(Tensor packed, Tensor scales, Tensor mins, int group_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(firstlight, CPU, lib) {
  lib.impl("int4_mm", &int4_mm);
  lib.impl("int4_mm_a8", &int4_mm_a8);
  lib.impl("int8_mm", &int8_mm);
  lib.impl("int4_dequant", &int4_dequant);
}
