// Every layer of one decode step in one op: one new token for each of b sequences (b <= 8), its
// hidden state x (b, dim) through each layer's
//
//   h = rms_norm(x);  q|k|v = h (Wq|Wk|Wv)^T;  q, k = apply_rope(q, k);  k, v -> the sequence's cache
//   x = x + attention(q, cached k, cached v) Wo^T
//   h = rms_norm(x);  gate|up = h (W1|W3)^T;  x = x + (silu(gate) * up) W2^T
//
// the maths of Block.decode in model/llama.py, the reference this op is tested against. Run op by
// op, a layer is about 25 small ATen ops of 5-10 us each, as long as reading the layer's weights;
// here the steps between the matrix products are plain loops over a few hundred numbers, and the
// products go to the decode kernel (matvec.h), which streams the weights.
//
// Weights are bf16, int8 with group scales, or int4 with block scales and offsets (model/quantize.py),
// one kind for the matrices of one kernel call (q|k|v, wo, w1|w3, w2) and any kind from call to
// call: an int4 model keeps a matrix whose K is not whole blocks of 32 as int8.
//
// Activations are fp32 or bf16 (T). In bf16 each value is rounded to bf16 where the reference
// stores a bf16 tensor (the norm's output, RoPE's products and their sum, the residual sums, SiLU
// and its product with up, attention's probabilities as ATen's CPU flash attention rounds them)
// and is fp32 in between, as in ATen: both give the same greedy tokens.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "matvec.h"

#ifndef TORCH_EXTENSION_NAME  // set by torch.utils.cpp_extension to the name the build was given
#define TORCH_EXTENSION_NAME llama_kernels
#endif

namespace {

using c10::BFloat16;

// Each layer's matrices, in this order, in the op's `weights` (and `scales`, `offsets`): model/decode_step.py's
// LAYER_MATRICES. q|k|v and w1|w3 are neighbours, so each group is one slice and one kernel call.
enum Matrix : int64_t { kWq, kWk, kWv, kWo, kW1, kW3, kW2, kLayerMatrices };
constexpr int64_t kMaxRows = 8;  // sequences per step: the decode kernel's rows

inline float f32(float v) { return v; }
inline float f32(BFloat16 v) { return static_cast<float>(v); }

// v as a tensor of T holds it: rounded to bf16, or unchanged in fp32.
template <typename T>
inline float stored(float v) { return f32(T(v)); }

// out = x / sqrt(mean(x^2) + eps) * weight, in fp32 (torch.nn.RMSNorm upcasts bf16 the same way).
template <typename T>
void rms_norm(const T* x, const T* weight, int64_t dim, float eps, T* out) {
  float sum_sq = 0.f;
  for (int64_t i = 0; i < dim; i++) sum_sq += f32(x[i]) * f32(x[i]);
  const float rstd = 1.f / std::sqrt(sum_sq / static_cast<float>(dim) + eps);
  for (int64_t i = 0; i < dim; i++) out[i] = T(f32(x[i]) * rstd * f32(weight[i]));
}

// model/rope.py's Rope.rotate on one head, in place: x * cos + rotate_half(x) * sin, where
// rotate_half(x1, x2) = (-x2, x1) for the head's two halves (Hugging Face's layout).
template <typename T>
void apply_rope(T* head, const T* cos, const T* sin, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  for (int64_t i = 0; i < half; i++) {
    const float x1 = f32(head[i]), x2 = f32(head[i + half]);
    const float first = stored<T>(x1 * f32(cos[i])) + stored<T>(-x2 * f32(sin[i]));
    const float second = stored<T>(x2 * f32(cos[i + half])) + stored<T>(x1 * f32(sin[i + half]));
    head[i] = T(first);
    head[i + half] = T(second);
  }
}

// The `groups` query heads q (groups, head_dim) that share one KV head, against its first n keys
// and values k, v (n, head_dim): out (groups, head_dim) = softmax(q k^T / sqrt(head_dim)) v, the
// scores and softmax in fp32. `scratch` holds groups * (head_dim + n) floats.
template <typename T>
void attend_one(const T* q, const T* k, const T* v, int64_t groups, int64_t n, int64_t head_dim, float* scratch,
                T* out) {
  float* q_f = scratch;                       // (groups, head_dim)
  float* scores = scratch + groups * head_dim;  // (groups, n)
  const float scale = 1.f / std::sqrt(static_cast<float>(head_dim));
  for (int64_t i = 0; i < groups * head_dim; i++) q_f[i] = f32(q[i]);
  for (int64_t j = 0; j < n; j++) {
    const T* key = k + j * head_dim;
    for (int64_t g = 0; g < groups; g++) {
      float dot = 0.f;
      for (int64_t d = 0; d < head_dim; d++) dot += q_f[g * head_dim + d] * f32(key[d]);
      scores[g * n + j] = dot * scale;
    }
  }
  for (int64_t g = 0; g < groups; g++) {
    float* p = scores + g * n;
    const float top = *std::max_element(p, p + n);
    float sum = 0.f;
    for (int64_t j = 0; j < n; j++) {
      p[j] = std::exp(p[j] - top);
      sum += p[j];
    }
    float* acc = q_f + g * head_dim;  // this head's query is no longer needed: its weighted sum of values
    std::fill(acc, acc + head_dim, 0.f);
    for (int64_t j = 0; j < n; j++) {
      const float weight = stored<T>(p[j]);
      const T* value = v + j * head_dim;
      for (int64_t d = 0; d < head_dim; d++) acc[d] += weight * f32(value[d]);
    }
    for (int64_t d = 0; d < head_dim; d++) out[g * head_dim + d] = T(acc[d] / sum);
  }
}

// What the op was given, checked once: sizes, and raw pointers to the caches.
struct Step {
  int64_t batch, dim, n_layers, n_heads, n_kv_heads, head_dim, ffn_dim;
  float eps;
  at::TensorList norms, weights, scales;
  std::vector<std::optional<at::Tensor>> offsets;  // none, or one per weight (int4 blocks' offsets)
  std::vector<int64_t> positions, max_len;
  std::vector<void*> k_caches, v_caches;  // per sequence: (n_layers, 1, n_kv_heads, max_len, head_dim)

  // The `count` matrices from `first` of a layer, in a list of one entry per weight (or an empty list).
  template <typename T>
  static c10::ArrayRef<T> matrices(c10::ArrayRef<T> all, int64_t layer, Matrix first, int64_t count) {
    return all.empty() ? all : all.slice(layer * kLayerMatrices + first, count);
  }
  at::Tensor matvec(const at::Tensor& x, int64_t layer, Matrix first, int64_t count) const {
    return llama::matvec(x, matrices(weights, layer, first, count), matrices(scales, layer, first, count),
                         matrices(llama::Offsets(offsets), layer, first, count));
  }
};

// Rotate sequence s's new query and key heads of KV head `kv`, write its key and value at the
// sequence's position, and attend: `qkv` row s is (n_heads + 2 n_kv_heads, head_dim), `out` row s
// (n_heads, head_dim).
template <typename T>
void attention(const Step& st, int64_t layer, int64_t s, int64_t kv, T* qkv, const T* cos, const T* sin,
               std::vector<float>& scratch, T* out) {
  const int64_t d = st.head_dim, groups = st.n_heads / st.n_kv_heads, pos = st.positions[s];
  T* row = qkv + s * (st.n_heads + 2 * st.n_kv_heads) * d;
  T* q = row + kv * groups * d;  // the query heads kv * groups .. (kv + 1) * groups - 1 share this KV head
  T* k_new = row + (st.n_heads + kv) * d;
  const T* v_new = row + (st.n_heads + st.n_kv_heads + kv) * d;
  for (int64_t g = 0; g < groups; g++) apply_rope(q + g * d, cos + s * d, sin + s * d, d);
  apply_rope(k_new, cos + s * d, sin + s * d, d);
  const int64_t head = (layer * st.n_kv_heads + kv) * st.max_len[s] * d;  // this layer's and head's (max_len, d)
  T* k = static_cast<T*>(st.k_caches[s]) + head;
  T* v = static_cast<T*>(st.v_caches[s]) + head;
  std::copy(k_new, k_new + d, k + pos * d);
  std::copy(v_new, v_new + d, v + pos * d);
  scratch.resize(groups * (d + pos + 1));
  attend_one(q, k, v, groups, pos + 1, d, scratch.data(), out + (s * st.n_heads + kv * groups) * d);
}

template <typename T>
at::Tensor run(const Step& st, const at::Tensor& x_in, const at::Tensor& cos_t, const at::Tensor& sin_t) {
  at::Tensor x = x_in.clone();  // (b, dim): the residual stream, updated layer by layer
  at::Tensor h = at::empty_like(x);  // (b, dim): a norm's output
  at::Tensor attn = at::empty({st.batch, st.n_heads * st.head_dim}, x.options());
  at::Tensor act = at::empty({st.batch, st.ffn_dim}, x.options());  // silu(gate) * up
  T* xp = x.data_ptr<T>();
  T* hp = h.data_ptr<T>();
  const T* cos = cos_t.data_ptr<T>();
  const T* sin = sin_t.data_ptr<T>();
  const int64_t b = st.batch, dim = st.dim, ffn = st.ffn_dim;
  auto residual = [&](const at::Tensor& y) {  // x += y, y (b, dim)
    const T* yp = y.data_ptr<T>();
    for (int64_t i = 0; i < b * dim; i++) xp[i] = T(f32(xp[i]) + f32(yp[i]));
  };
  for (int64_t layer = 0; layer < st.n_layers; layer++) {
    const T* attention_norm = st.norms[2 * layer].data_ptr<T>();
    const T* ffn_norm = st.norms[2 * layer + 1].data_ptr<T>();

    for (int64_t s = 0; s < b; s++) rms_norm(xp + s * dim, attention_norm, dim, st.eps, hp + s * dim);
    at::Tensor qkv = st.matvec(h, layer, kWq, 3);  // (b, (n_heads + 2 n_kv_heads) head_dim)
    T* qkv_p = qkv.data_ptr<T>();
    T* attn_p = attn.data_ptr<T>();
    at::parallel_for(0, b * st.n_kv_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch;
      for (int64_t task = begin; task < end; task++)
        attention<T>(st, layer, task / st.n_kv_heads, task % st.n_kv_heads, qkv_p, cos, sin, scratch, attn_p);
    });
    residual(st.matvec(attn, layer, kWo, 1));

    for (int64_t s = 0; s < b; s++) rms_norm(xp + s * dim, ffn_norm, dim, st.eps, hp + s * dim);
    at::Tensor gate_up = st.matvec(h, layer, kW1, 2);  // (b, 2 ffn_dim): gate | up
    const T* gu = gate_up.data_ptr<T>();
    T* act_p = act.data_ptr<T>();
    for (int64_t s = 0; s < b; s++) {
      for (int64_t i = 0; i < ffn; i++) {
        const float gate = f32(gu[s * 2 * ffn + i]), up = f32(gu[s * 2 * ffn + ffn + i]);
        const float silu = stored<T>(gate / (1.f + std::exp(-gate)));
        act_p[s * ffn + i] = T(silu * up);
      }
    }
    residual(st.matvec(act, layer, kW2, 1));
  }
  return x;
}

void check_tensor(const char* what, const at::Tensor& t, at::ScalarType dtype, at::IntArrayRef sizes) {
  TORCH_CHECK(t.scalar_type() == dtype && t.sizes() == sizes && t.is_contiguous() && t.device().is_cpu(),
              "decode_layers: ", what, " must be a contiguous CPU tensor of ", dtype, " and shape ", sizes,
              "; got ", t.scalar_type(), " ", t.sizes(), t.is_contiguous() ? "" : " (not contiguous)", " on ",
              t.device());
}

// x (b, dim) through every layer: norms (2 per layer: attention_norm, ffn_norm), weights (7 per
// layer, Matrix's order), scales (none for bf16 weights, else one per weight: fp32 for int8, fp16
// for int4), offsets (none, or one per weight: an int4 matrix's fp16 offsets or none for Q4_0
// blocks, none for the other kinds), cos and sin (b, head_dim) rows of each sequence's position,
// k_caches and v_caches one per sequence, written at positions[s]. Returns the new x; the caches
// are written in place.
at::Tensor decode_layers(const at::Tensor& x, at::TensorList norms, at::TensorList weights, at::TensorList scales,
                         const c10::List<std::optional<at::Tensor>>& offsets, const at::Tensor& cos,
                         const at::Tensor& sin, at::TensorList k_caches,
                         at::TensorList v_caches, at::IntArrayRef positions, int64_t n_heads, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kMaxRows &&
              (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "decode_layers: x must be float32 or bfloat16 of shape (b, dim) with 1 <= b <= ", kMaxRows, "; got ",
              x.scalar_type(), " ", x.sizes());
  Step st;
  st.batch = x.size(0);
  st.dim = x.size(1);
  st.n_layers = static_cast<int64_t>(norms.size()) / 2;
  st.n_heads = n_heads;
  st.head_dim = cos.dim() == 2 ? cos.size(1) : 0;
  st.eps = static_cast<float>(eps);
  st.norms = norms;
  st.weights = weights;
  st.scales = scales;
  st.offsets = offsets.vec();
  const auto dtype = x.scalar_type();
  TORCH_CHECK(st.n_layers >= 1 && norms.size() == 2 * st.n_layers &&
              weights.size() == kLayerMatrices * st.n_layers &&
              (scales.empty() || scales.size() == weights.size()) &&
              (offsets.empty() || offsets.size() == weights.size()),
              "decode_layers: expected 2 norms and ", kLayerMatrices, " weights a layer (and as many scales and ",
              "offsets, or none); got ", norms.size(), " norms, ", weights.size(), " weights, ", scales.size(),
              " scales, ", offsets.size(), " offsets");
  TORCH_CHECK(st.head_dim >= 2 && st.head_dim % 2 == 0 && n_heads >= 1,
              "decode_layers: cos must be (b, head_dim) with an even head_dim; got ", cos.sizes());
  st.n_kv_heads = k_caches.empty() ? 0 : k_caches[0].size(2);
  st.ffn_dim = weights[kW1].size(0);
  TORCH_CHECK(st.n_kv_heads >= 1 && n_heads % st.n_kv_heads == 0, "decode_layers: ", st.n_kv_heads,
              " KV heads do not divide ", n_heads, " query heads");
  check_tensor("x", x, dtype, {st.batch, st.dim});
  check_tensor("cos", cos, dtype, {st.batch, st.head_dim});
  check_tensor("sin", sin, dtype, {st.batch, st.head_dim});
  for (int64_t layer = 0; layer < st.n_layers; layer++) {
    check_tensor("a norm weight", norms[2 * layer], dtype, {st.dim});
    check_tensor("a norm weight", norms[2 * layer + 1], dtype, {st.dim});
    const int64_t q_rows = n_heads * st.head_dim, kv_rows = st.n_kv_heads * st.head_dim;
    const int64_t rows[kLayerMatrices] = {q_rows, kv_rows, kv_rows, st.dim, st.ffn_dim, st.ffn_dim, st.dim};
    const int64_t cols[kLayerMatrices] = {st.dim, st.dim, st.dim, q_rows, st.dim, st.dim, st.ffn_dim};
    const at::Tensor* w = &weights[layer * kLayerMatrices];  // this layer's matrices
    for (int64_t m = 0; m < kLayerMatrices; m++) {
      const int64_t per_byte = w[m].scalar_type() == at::kByte ? 2 : 1;  // int4: two weights a byte
      TORCH_CHECK(w[m].dim() == 2 && w[m].size(0) == rows[m] && w[m].size(1) * per_byte == cols[m],
                  "decode_layers: layer ", layer, " matrix ", m, " is ", w[m].sizes(), " of ", w[m].scalar_type(),
                  "; expected (", rows[m], ", ", cols[m] / per_byte, ")");
    }
    TORCH_CHECK(w[kWk].scalar_type() == w[kWq].scalar_type() && w[kWv].scalar_type() == w[kWq].scalar_type() &&
                w[kW3].scalar_type() == w[kW1].scalar_type(),
                "decode_layers: layer ", layer, " has wq, wk, wv of ", w[kWq].scalar_type(), ", ",
                w[kWk].scalar_type(), ", ", w[kWv].scalar_type(), " and w1, w3 of ", w[kW1].scalar_type(), ", ",
                w[kW3].scalar_type(), "; expected one kind for the matrices of one kernel call");
  }
  TORCH_CHECK(k_caches.size() == static_cast<size_t>(st.batch) && v_caches.size() == k_caches.size() &&
              positions.size() == k_caches.size(),
              "decode_layers: ", st.batch, " rows of x but ", k_caches.size(), " key caches, ", v_caches.size(),
              " value caches and ", positions.size(), " positions");
  for (int64_t s = 0; s < st.batch; s++) {
    const int64_t max_len = k_caches[s].dim() == 5 ? k_caches[s].size(3) : 0;
    check_tensor("a key cache", k_caches[s], dtype, {st.n_layers, 1, st.n_kv_heads, max_len, st.head_dim});
    check_tensor("a value cache", v_caches[s], dtype, {st.n_layers, 1, st.n_kv_heads, max_len, st.head_dim});
    TORCH_CHECK(positions[s] >= 0 && positions[s] < max_len, "decode_layers: sequence ", s, " writes position ",
                positions[s], " of a cache that holds ", max_len);
    st.positions.push_back(positions[s]);
    st.max_len.push_back(max_len);
    st.k_caches.push_back(k_caches[s].data_ptr());
    st.v_caches.push_back(v_caches[s].data_ptr());
  }
  return dtype == at::kBFloat16 ? run<BFloat16>(st, x, cos, sin) : run<float>(st, x, cos, sin);
}

}  // namespace

// The op namespace is the build's name (see matvec.cpp, which defines the library).
#define FRAGMENT_LIBRARY(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define IMPL_LIBRARY(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

FRAGMENT_LIBRARY(TORCH_EXTENSION_NAME, m) {
  m.def("decode_layers(Tensor x, Tensor[] norms, Tensor[] weights, Tensor[] scales, Tensor?[] offsets, Tensor cos, "
        "Tensor sin, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, int[] positions, int n_heads, float eps) -> Tensor");
}

IMPL_LIBRARY(TORCH_EXTENSION_NAME, CPU, m) { m.impl("decode_layers", decode_layers); }
