// firstlight native decode step for CPU: every layer of a dense decoder (models/dense.py: Llama, Mistral,
// Qwen2, Qwen3, SmolLM2; models/gemma3.py: Gemma 3) for one new token per row, in one call, over the engine's
// paged KV pools.
//
// Per layer, exactly the module graph of models/dense.py DecoderLayer (or gemma3.py Gemma3Layer) at S = 1:
//   h = rmsnorm(x) ; qkv = h W_qkv (+b) ; [q/k rmsnorm per head] ; rope(q), rope(k) ; store k, v at the row's
//   slot ; a = paged attention(q) over the row's keys ; x += [rmsnorm](a W_o (+b))
//   h = rmsnorm(x) ; [g | u] = h W_gu (+b) ; x += [rmsnorm]((act(g) * u) W_down (+b))
// then the final rmsnorm; [rmsnorm]: Gemma 3's norms of the attention and MLP outputs. Every norm is
// w * (x / rms(x)); Gemma's (1 + w) comes in as that w. The matmuls are the same kernels the modules call (int4_mm,
// int4_mm_a8, int8_mm, f32_mm: called here as C++ functions, no dispatcher); the glue (norms, rope, the K/V store
// into fp32 / bf16 / fp16 pools, activation, residual adds, each add in one pass with the norm after it) is plain
// loops over the [B, *] rows. Why: in eager PyTorch the ~30 ops of glue per layer cost more than the matmuls at
// batch 1 (a SmolLM2 int4 step: 15 ms of kernels, 29 ms of Python and dispatch).
//
// The weights are registered once (dense_decode_plan -> a handle, with the runner's pools) and each step
// passes only what changes: the embedded rows, positions, rope tables and the slots of each KV cache group.
//
// The same glue, as ops a prefill's modules call (quant/f32.py): gated_act, rms_norm and rope over [..., rows].
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "firstlight_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace {

enum Kind : int64_t { kF32 = 0, kInt4 = 1, kInt4A8 = 2, kInt8 = 3, kInt8A8 = 4, kF32Panels = 5 };
enum Act : int64_t { kSilu = 0, kGeluTanh = 1 };

struct Linear {
  int64_t kind = kF32, group = 0;  // group: int4's group size; f32 panels: N
  // f32: w, oneDNN's reordered w (or none); f32 panels: f32_pack(w); int4: packed, scales, mins; int8: qweight, scales
  at::Tensor a, b, c, bias;
};

struct Layer {
  int64_t type = 0;  // index of its KV cache group (layer type) in the step's per-group lists
  bool rope = true;
  at::Tensor in_norm, q_norm, k_norm, post_norm;  // q_norm / k_norm undefined without per-head norms
  at::Tensor attn_out_norm, mlp_out_norm;        // Gemma 3's norms of the sublayer outputs (else undefined)
  Linear qkv, o, gate_up, down;
};

struct Plan {
  int64_t E = 0, H = 0, Hkv = 0, D = 0, I = 0, act = kSilu;
  int64_t tiled_f32 = 0, tiled_int4 = 0, tiled_a8 = 0, tiled_int8 = 0;
  int64_t onednn_f32 = 0;  // fp32 linears with a reordered weight run on oneDNN above this many rows (0: never)
  float eps = 1e-6f, scale = 1.f;
  at::Tensor final_norm;
  std::vector<Layer> layers;
  std::vector<at::Tensor> k_pools, v_pools;
};

std::mutex plans_mu;
std::map<int64_t, std::shared_ptr<const Plan>> plans;
int64_t next_plan = 1;

at::Tensor opt(const at::Tensor& t) { return t.numel() ? t : at::Tensor(); }  // empty = absent

// torch's mkldnn::_linear_pointwise (the op F32Linear calls, quant/f32.py) on oneDNN's reordered weight
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x, w, bias.defined() ? c10::IValue(bias) : c10::IValue(), c10::IValue("none"),
                                 c10::IValue(c10::List<std::optional<at::Scalar>>()), c10::IValue()};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// pool[off .. off + n) = x[0 .. n) in the pool's element type (bf16 / fp16 rounded to nearest even, as torch's .to())
void store_kv(const float* x, void* pool, at::ScalarType kv, int64_t off, int64_t n) {
  switch (kv) {
    case at::kFloat: std::memcpy(static_cast<float*>(pool) + off, x, sizeof(float) * n); break;
    case at::kBFloat16: std::copy(x, x + n, static_cast<c10::BFloat16*>(pool) + off); break;
    case at::kHalf: std::copy(x, x + n, static_cast<c10::Half*>(pool) + off); break;
    default: TORCH_CHECK(false, "firstlight::dense_decode: K/V pool of ", kv);
  }
}

at::Tensor run_linear(const Plan& p, const Linear& l, const at::Tensor& x) {
  const c10::optional<at::Tensor> bias = l.bias.defined() ? c10::optional<at::Tensor>(l.bias) : c10::nullopt;
  at::Tensor y;
  switch (l.kind) {
    case kF32:
      if (l.b.defined() && p.onednn_f32 > 0 && x.size(0) > p.onednn_f32) return onednn_linear(x, l.b, l.bias);
      return f32_mm(x, l.a, bias, p.tiled_f32);
    case kF32Panels: return f32_mm_packed(x, l.a, l.group, bias);
    case kInt4: y = int4_mm(x, l.a, l.b, l.c, l.group, p.tiled_int4); break;
    case kInt4A8: y = int4_mm_a8(x, l.a, l.b, l.c, l.group, p.tiled_a8); break;
    case kInt8: y = int8_mm(x, l.a, l.b, false, p.tiled_int8); break;
    case kInt8A8: y = int8_mm(x, l.a, l.b, true, p.tiled_int8); break;
    default: TORCH_CHECK(false, "firstlight::dense_decode: unknown linear kind ", l.kind);
  }
  if (l.bias.defined()) y.add_(l.bias);
  return y;
}

// out[0..n) = w * (x * 1/sqrt(mean(x^2) + eps)), as models/layers.py RMSNorm in fp32
void rmsnorm(const float* x, const float* w, int64_t n, float eps, float* out) {
  float ss = 0.f;
  int64_t i = 0;
#ifdef __AVX2__
  __m256 a0 = _mm256_setzero_ps(), a1 = a0;
  for (; i + 16 <= n; i += 16) {
    const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
    a0 = _mm256_fmadd_ps(v0, v0, a0);
    a1 = _mm256_fmadd_ps(v1, v1, a1);
  }
  alignas(32) float t[8];
  _mm256_store_ps(t, _mm256_add_ps(a0, a1));
  for (float v : t) ss += v;
#endif
  for (; i < n; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (i = 0; i < n; ++i) out[i] = w[i] * (x[i] * r);
}

// out[0..rot) = x[0..rot) rotated by the half-split rotary embedding (cos, sin: [rot]): x * cos + rotate_half(x)
// * sin, rotate_half(x) = [-x2, x1]. out may be x (each step reads and writes the same two lanes: no dependence
// between steps, so the loop vectorizes either way).
void rope(const float* x, const float* cos, const float* sin, int64_t rot, float* out) {
  const int64_t half = rot / 2;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x0 = x[i], x1 = x[i + half];
    out[i] = x0 * cos[i] - x1 * sin[i];
    out[i + half] = x1 * cos[i + half] + x0 * sin[i + half];
  }
}

// y[i] = act(g[i]) * u[i]
void gated_act(const float* g, const float* u, int64_t n, int64_t act, float* y) {
  // silu(v) = v sigmoid(v); tanh-GELU(v) = v sigmoid(2 sqrt(2/pi) (v + 0.044715 v^3)) (0.5 (1 + tanh z) = sigmoid(2z))
  constexpr float kAlpha2 = 2 * 0.7978845608028654f;  // 2 sqrt(2 / pi)
  int64_t i = 0;
#ifdef __AVX512F__
  {
    const __m512 one = _mm512_set1_ps(1.f), a2 = _mm512_set1_ps(kAlpha2), c3 = _mm512_set1_ps(0.044715f);
    for (; i + 16 <= n; i += 16) {
      const __m512 v = _mm512_loadu_ps(g + i);
      const __m512 z =
          act == kSilu ? v : _mm512_mul_ps(a2, _mm512_fmadd_ps(_mm512_mul_ps(c3, v), _mm512_mul_ps(v, v), v));
      const __m512 d = _mm512_add_ps(one, firstlight::exp512(_mm512_sub_ps(_mm512_setzero_ps(), z)));
      __m512 r = _mm512_rcp14_ps(d);  // 1 / d: 14 bits, then one Newton step
      r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.f)));
      _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_mul_ps(v, r), _mm512_loadu_ps(u + i)));
    }
  }
#endif
#ifdef __AVX2__
  const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps(), a2 = _mm256_set1_ps(kAlpha2),
               c3 = _mm256_set1_ps(0.044715f);
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(g + i);
    const __m256 z = act == kSilu ? v : _mm256_mul_ps(a2, _mm256_fmadd_ps(_mm256_mul_ps(c3, v), _mm256_mul_ps(v, v), v));
    const __m256 s = _mm256_div_ps(v, _mm256_add_ps(one, firstlight::exp256(_mm256_sub_ps(zero, z))));
    _mm256_storeu_ps(y + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
  }
#endif
  for (; i < n; ++i) {
    const float v = g[i], z = act == kSilu ? v : kAlpha2 * (v + 0.044715f * v * v * v);
    y[i] = v / (1.f + std::exp(-z)) * u[i];
  }
}

// fn(b) for the rows b < B of a decode step, on the threads once the rows hold enough work (`per_row` floats
// each: ~16K floats per chunk; a single stream's rows stay on the calling thread)
template <class Fn>
void rows(int64_t B, int64_t per_row, const Fn& fn) {
  at::parallel_for(0, B, std::max<int64_t>(1, 16384 / std::max<int64_t>(per_row, 1)), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) fn(b);
  });
}

// The residual add of a sublayer's output and the next norm, one pass over each row: x[b] += [rmsnorm by w_out](y[b])
// (Gemma 3's norm of the sublayer output; none for an undefined w_out), then h[b] = rmsnorm(x[b]) by w. x, y, h:
// [B, E] contiguous fp32 (y is overwritten). Same arithmetic as the norm, torch's add_ and the norm one after another.
void add_norm(int64_t B, int64_t E, float* x, const at::Tensor& y, const at::Tensor& w_out, const float* w, float eps,
              float* h) {
  TORCH_CHECK(y.is_contiguous() && y.size(0) == B && y.size(1) == E, "firstlight::dense_decode: a sublayer output ",
              y.sizes(), " is not [", B, ", ", E, "]");
  float* yp = y.data_ptr<float>();
  const float* wo = w_out.defined() ? w_out.data_ptr<float>() : nullptr;
  rows(B, 2 * E, [&](int64_t b) {
    float *xb = x + b * E, *yb = yp + b * E;
    if (wo != nullptr) rmsnorm(yb, wo, E, eps, yb);
#pragma omp simd
    for (int64_t i = 0; i < E; ++i) xb[i] += yb[i];
    rmsnorm(xb, w, E, eps, h + b * E);
  });
}

}  // namespace

// act(gate) * up over the rows of gate_up [..., 2I] (gate first: GatedMLP's fused projection) -> [..., I], one
// pass and one output (torch's act(gate) * up: two passes, an intermediate the size of the output)
at::Tensor gated_act_rows(const at::Tensor& gate_up, int64_t act) {
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat && gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0 &&
                  (act == kSilu || act == kGeluTanh),
              "firstlight::gated_act: fp32 [..., 2I] and act 0 (silu) or 1 (tanh-GELU), got ", gate_up.scalar_type(),
              " ", gate_up.sizes(), ", act ", act);
  const at::Tensor x = gate_up.contiguous();
  const int64_t I = x.size(-1) / 2, rows = I ? x.numel() / (2 * I) : 0;
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = I;
  at::Tensor y = at::empty(sizes, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) gated_act(xp + r * 2 * I, xp + r * 2 * I + I, I, act, yp + r * I);
  });
  return y;
}

// w * (x / rms(x)) over the rows of x [..., E] -> a new tensor: models/layers.py RMSNorm in one pass per row
// (GemmaRMSNorm with w = 1 + its weight); torch's takes five (square, mean, rsqrt, two products) and four tensors
at::Tensor rms_norm_rows(const at::Tensor& x_in, const at::Tensor& w_in, double eps) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && w_in.scalar_type() == at::kFloat && w_in.dim() == 1 &&
                  x_in.dim() >= 1 && x_in.size(-1) == w_in.numel(),
              "firstlight::rms_norm: fp32 x [..., E] and w [E], got ", x_in.scalar_type(), " ", x_in.sizes(), " and ",
              w_in.scalar_type(), " ", w_in.sizes());
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const int64_t E = w.numel(), rows = E ? x.numel() / E : 0;
  at::Tensor y = at::empty(x.sizes(), x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(E, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rmsnorm(xp + r * E, wp, E, static_cast<float>(eps), yp + r * E);
  });
  return y;
}

// x [B, H, S, D] (any strides, D's 1) rotated by the half-split rotary embedding, cos and sin [B or 1, 1, S, Dr]
// (models/layers.py apply_rope; dims past Dr pass through) -> a new tensor laid out [B, S, H, D], as the module
// path's (its elementwise ops keep the layout of x, a view of the fused qkv projection [B, S, H * D]), so the KV
// store's [B * S, Hkv, D] view of k stays a view. One pass; torch's apply_rope takes five and five tensors.
at::Tensor rope_rows(const at::Tensor& x, const at::Tensor& cos_in, const at::Tensor& sin_in) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 4 && x.stride(3) == 1 && cos_in.dim() == 4 &&
                  cos_in.sizes() == sin_in.sizes() && cos_in.scalar_type() == at::kFloat &&
                  sin_in.scalar_type() == at::kFloat && cos_in.size(1) == 1 && cos_in.size(2) == x.size(2) &&
                  (cos_in.size(0) == x.size(0) || cos_in.size(0) == 1) && cos_in.size(3) <= x.size(3) &&
                  cos_in.size(3) % 2 == 0,
              "firstlight::rope: fp32 x [B, H, S, D] (unit stride in D) and cos, sin [B or 1, 1, S, Dr <= D], got ",
              x.sizes(), " and ", cos_in.sizes());
  const int64_t B = x.size(0), H = x.size(1), S = x.size(2), D = x.size(3), rot = cos_in.size(3);
  const at::Tensor cs = cos_in.contiguous(), sn = sin_in.contiguous();
  const int64_t ldt = cs.size(0) == 1 ? 0 : S * rot;  // one table for every row, or one per row
  at::Tensor y = at::empty({B, S, H, D}, x.options());
  const float* xp = x.data_ptr<float>();
  const float *cp = cs.data_ptr<float>(), *sp = sn.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t sb = x.stride(0), sh = x.stride(1), ss = x.stride(2);
  at::parallel_for(0, B * S, std::max<int64_t>(1, 4096 / std::max<int64_t>(H * D, 1)), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / S, t = i % S, off = b * ldt + t * rot;
      for (int64_t h = 0; h < H; ++h) {
        const float* in = xp + b * sb + h * sh + t * ss;
        float* out = yp + (i * H + h) * D;
        rope(in, cp + off, sp + off, rot, out);
        std::memcpy(out + rot, in + rot, sizeof(float) * (D - rot));
      }
    }
  });
  return y.permute({0, 2, 1, 3});
}

namespace {

std::shared_ptr<const Plan> get_plan(int64_t handle) {
  std::lock_guard<std::mutex> lock(plans_mu);
  auto it = plans.find(handle);
  TORCH_CHECK(it != plans.end(), "firstlight::dense_decode: no plan ", handle, " (freed, or never made)");
  return it->second;
}

}  // namespace

// ints: E, H, Hkv, D, I, act, tiled f32 / int4 / a8 / int8, oneDNN f32 rows, then per layer: type, rope, and (kind, group) of
// qkv, o, gate_up, down. tensors: final norm, then per layer: in norm, q norm, k norm, pre-MLP norm, attention
// output norm, MLP output norm, and (a, b, c, bias) of qkv, o, gate_up, down (empty tensors where absent).
// floats: eps, attention scale.
int64_t dense_decode_plan(at::TensorList tensors, at::IntArrayRef ints, at::ArrayRef<double> floats,
                          at::TensorList k_pools, at::TensorList v_pools) {
  constexpr int64_t kHead = 11, kPerLayerInts = 10, kPerLayerTensors = 22;
  TORCH_CHECK(ints.size() >= kHead && (ints.size() - kHead) % kPerLayerInts == 0 && floats.size() == 2,
              "firstlight::dense_decode_plan: malformed ints/floats");
  const int64_t num_layers = (static_cast<int64_t>(ints.size()) - kHead) / kPerLayerInts;
  TORCH_CHECK(num_layers > 0, "firstlight::dense_decode_plan: a model with no layers");
  TORCH_CHECK(static_cast<int64_t>(tensors.size()) == 1 + num_layers * kPerLayerTensors &&
                  static_cast<int64_t>(k_pools.size()) == num_layers && v_pools.size() == k_pools.size(),
              "firstlight::dense_decode_plan: expected ", 1 + num_layers * kPerLayerTensors, " tensors and ",
              num_layers, " pools per kind");
  auto p = std::make_shared<Plan>();
  p->E = ints[0], p->H = ints[1], p->Hkv = ints[2], p->D = ints[3], p->I = ints[4], p->act = ints[5];
  p->tiled_f32 = ints[6], p->tiled_int4 = ints[7], p->tiled_a8 = ints[8], p->tiled_int8 = ints[9];
  p->onednn_f32 = ints[10];
  p->eps = static_cast<float>(floats[0]), p->scale = static_cast<float>(floats[1]);
  TORCH_CHECK(p->Hkv > 0 && p->H % p->Hkv == 0 && (p->act == kSilu || p->act == kGeluTanh),
              "firstlight::dense_decode_plan: bad head counts or activation");
  auto f32 = [](const at::Tensor& t, int64_t n, const char* what) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n,
                "firstlight::dense_decode_plan: ", what, " must be contiguous fp32 with ", n, " elements");
    return t;
  };
  p->final_norm = f32(tensors[0], p->E, "the final norm");
  for (int64_t l = 0; l < num_layers; ++l) {
    const int64_t* li = ints.data() + kHead + l * kPerLayerInts;
    const at::Tensor* lt = tensors.data() + 1 + l * kPerLayerTensors;
    Layer layer;
    layer.type = li[0], layer.rope = li[1] != 0;
    layer.in_norm = f32(lt[0], p->E, "a norm");
    if (lt[1].numel()) layer.q_norm = f32(lt[1], p->D, "a q norm");
    if (lt[2].numel()) layer.k_norm = f32(lt[2], p->D, "a k norm");
    layer.post_norm = f32(lt[3], p->E, "a norm");
    if (lt[4].numel()) layer.attn_out_norm = f32(lt[4], p->E, "an attention output norm");
    if (lt[5].numel()) layer.mlp_out_norm = f32(lt[5], p->E, "an MLP output norm");
    Linear* lins[4] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
    for (int j = 0; j < 4; ++j) {
      lins[j]->kind = li[2 + 2 * j], lins[j]->group = li[3 + 2 * j];
      lins[j]->a = lt[6 + 4 * j], lins[j]->b = opt(lt[7 + 4 * j]), lins[j]->c = opt(lt[8 + 4 * j]);
      lins[j]->bias = opt(lt[9 + 4 * j]);
    }
    const at::Tensor& kp = k_pools[l];
    TORCH_CHECK(firstlight::kv_pool_type(kp.scalar_type()) && kp.is_contiguous() && kp.dim() == 3 &&
                    kp.size(1) == p->Hkv && kp.size(2) == p->D && v_pools[l].sizes() == kp.sizes() &&
                    v_pools[l].is_contiguous() && v_pools[l].scalar_type() == kp.scalar_type(),
                "firstlight::dense_decode_plan: the pools of layer ", l,
                " must be contiguous fp32, bf16 or fp16 [slots, Hkv, D] of one dtype");
    p->layers.push_back(std::move(layer));
    p->k_pools.push_back(kp);
    p->v_pools.push_back(v_pools[l]);
  }
  std::lock_guard<std::mutex> lock(plans_mu);
  plans[next_plan] = std::move(p);
  return next_plan++;
}

void dense_decode_free(int64_t handle) {
  std::lock_guard<std::mutex> lock(plans_mu);
  plans.erase(handle);
}

// x [B, E] embedded rows; positions [B]; per KV cache group t: cos[t], sin[t] [B, rot], write_slots[t] [B],
// gather_slots[t] / key_positions[t] [B, L_t], windows[t] (0: none) -> the final-normed hidden rows [B, E].
// A key is visible when key_pos >= 0, key_pos <= pos and (window) pos - key_pos < window, as attention_mask.
at::Tensor dense_decode(int64_t handle, const at::Tensor& x_in, const at::Tensor& positions, at::TensorList cos,
                        at::TensorList sin, at::TensorList write_slots, at::TensorList gather_slots,
                        at::TensorList key_positions, at::IntArrayRef windows) {
  const std::shared_ptr<const Plan> plan = get_plan(handle);
  const Plan& p = *plan;
  const int64_t E = p.E, H = p.H, Hkv = p.Hkv, D = p.D, I = p.I;
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == E, "firstlight::dense_decode x must be [B, ", E, "]");
  const int64_t B = x_in.size(0), T = static_cast<int64_t>(cos.size());
  TORCH_CHECK(positions.numel() == B && positions.scalar_type() == at::kLong, "firstlight::dense_decode positions must be int64 [B]");
  TORCH_CHECK(static_cast<int64_t>(sin.size()) == T && static_cast<int64_t>(write_slots.size()) == T &&
                  static_cast<int64_t>(gather_slots.size()) == T && static_cast<int64_t>(key_positions.size()) == T &&
                  static_cast<int64_t>(windows.size()) == T,
              "firstlight::dense_decode: one cos, sin, write/gather slots, key positions and window per KV group");
  at::Tensor x = x_in.to(at::kFloat).contiguous().clone();  // the residual stream, [B, E]
  const at::Tensor pos = positions.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  // per group: visibility [B, L] from the key positions (as models/layers.py attention_mask)
  std::vector<at::Tensor> cs(T), sn(T), ws(T), gs(T), masks(T);
  for (int64_t t = 0; t < T; ++t) {
    cs[t] = cos[t].to(at::kFloat).reshape({B, -1}).contiguous();
    sn[t] = sin[t].to(at::kFloat).reshape({B, -1}).contiguous();
    ws[t] = write_slots[t].contiguous();
    gs[t] = gather_slots[t].contiguous();
    TORCH_CHECK(ws[t].numel() == B && gs[t].dim() == 2 && gs[t].size(0) == B &&
                    key_positions[t].sizes() == gs[t].sizes() && cs[t].sizes() == sn[t].sizes() && cs[t].size(1) <= D,
                "firstlight::dense_decode: group ", t, " slots, key positions or rope tables do not match B = ", B);
    const at::Tensor kpos = key_positions[t].contiguous();
    const int64_t L = gs[t].size(1), window = windows[t];
    masks[t] = at::empty({B, L}, x.options().dtype(at::kBool));
    bool* mp = masks[t].data_ptr<bool>();
    const int64_t* kp = kpos.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t l = 0; l < L; ++l) {
        const int64_t k = kp[b * L + l], q = pp[b];
        mp[b * L + l] = q < 0 || (k >= 0 && k <= q && (window == 0 || q - k < window));
      }
  }
  const int64_t NQKV = (H + 2 * Hkv) * D;
  at::Tensor h = at::empty({B, E}, x.options()), attn = at::empty({B, H * D}, x.options());
  at::Tensor act = at::empty({B, I}, x.options());
  float* xp = x.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  // the first layer's input norm; every later one runs with the residual add that ends the layer before it
  rows(B, E, [&](int64_t b) { rmsnorm(xp + b * E, p.layers[0].in_norm.data_ptr<float>(), E, p.eps, hp + b * E); });
  for (size_t li = 0; li < p.layers.size(); ++li) {
    const Layer& layer = p.layers[li];
    const int64_t t = layer.type;
    TORCH_CHECK(t >= 0 && t < T, "firstlight::dense_decode: layer ", li, " has group ", t, " of ", T);
    const at::Tensor qkv = run_linear(p, layer.qkv, h);  // [B, NQKV]
    TORCH_CHECK(qkv.size(1) == NQKV, "firstlight::dense_decode: qkv of layer ", li, " has ", qkv.size(1), " columns");
    float* qkvp = qkv.data_ptr<float>();
    void* kpool = p.k_pools[li].data_ptr();
    void* vpool = p.v_pools[li].data_ptr();
    const at::ScalarType kv = p.k_pools[li].scalar_type();
    const int64_t nslots = p.k_pools[li].size(0), rot = cs[t].size(1);
    const int64_t* wsp = ws[t].data_ptr<int64_t>();
    rows(B, NQKV, [&](int64_t b) {
      float* q = qkvp + b * NQKV;
      float* k = q + H * D;
      const float* v = k + Hkv * D;
      if (layer.q_norm.defined()) {
        for (int64_t j = 0; j < H; ++j) rmsnorm(q + j * D, layer.q_norm.data_ptr<float>(), D, p.eps, q + j * D);
        for (int64_t j = 0; j < Hkv; ++j) rmsnorm(k + j * D, layer.k_norm.data_ptr<float>(), D, p.eps, k + j * D);
      }
      if (layer.rope) {
        const float *c = cs[t].data_ptr<float>() + b * rot, *s = sn[t].data_ptr<float>() + b * rot;
        for (int64_t j = 0; j < H; ++j) rope(q + j * D, c, s, rot, q + j * D);
        for (int64_t j = 0; j < Hkv; ++j) rope(k + j * D, c, s, rot, k + j * D);
      }
      const int64_t slot = wsp[b];
      TORCH_CHECK(slot >= 0 && slot < nslots, "firstlight::dense_decode: write slot ", slot, " outside the pool");
      store_kv(k, kpool, kv, slot * Hkv * D, Hkv * D);
      store_kv(v, vpool, kv, slot * Hkv * D, Hkv * D);
    });
    firstlight::paged_attention_rows(qkvp, NQKV, B, H, D, kpool, vpool, kv, nslots, Hkv, gs[t].data_ptr<int64_t>(),
                                     gs[t].size(1), masks[t].data_ptr<bool>(), p.scale, attn.data_ptr<float>(), H * D);
    add_norm(B, E, xp, run_linear(p, layer.o, attn), layer.attn_out_norm, layer.post_norm.data_ptr<float>(), p.eps, hp);
    const at::Tensor gu = run_linear(p, layer.gate_up, h);  // [B, 2I]
    rows(B, 4 * I, [&](int64_t b) {  // the exp: ~4x a norm's work per element
      const float* g = gu.data_ptr<float>() + b * 2 * I;
      gated_act(g, g + I, I, p.act, act.data_ptr<float>() + b * I);
    });
    // the residual add, then the next layer's input norm into h, or the final norm into the output
    const bool last = li + 1 == p.layers.size();
    const float* next_norm = last ? p.final_norm.data_ptr<float>() : p.layers[li + 1].in_norm.data_ptr<float>();
    add_norm(B, E, xp, run_linear(p, layer.down, act), layer.mlp_out_norm, next_norm, p.eps, hp);
  }
  return h;  // the final-normed rows
}

TORCH_LIBRARY_FRAGMENT(firstlight, lib) {
  lib.def("dense_decode_plan(Tensor[] tensors, int[] ints, float[] floats, Tensor[] k_pools, Tensor[] v_pools) -> int",
          &dense_decode_plan);
  lib.def("dense_decode_free(int plan) -> ()", &dense_decode_free);
  lib.def("gated_act(Tensor gate_up, int act) -> Tensor");
  lib.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  lib.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  lib.def("dense_decode(int plan, Tensor x, Tensor positions, Tensor[] cos, Tensor[] sin, Tensor[] write_slots, "
          "Tensor[] gather_slots, Tensor[] key_positions, int[] windows) -> Tensor");
}

TORCH_LIBRARY_IMPL(firstlight, CPU, lib) {
  lib.impl("dense_decode", &dense_decode);
  lib.impl("gated_act", &gated_act_rows);
  lib.impl("rms_norm", &rms_norm_rows);
  lib.impl("rope", &rope_rows);
}
