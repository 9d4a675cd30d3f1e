// y = W x for a single token, reading 16-bit or 8-bit weights at memory bandwidth.
//
// Decoding one token multiplies every weight matrix by one vector, so its speed is the speed at
// which weights stream from memory. PyTorch's CPU linear for one row runs well below bandwidth
// (oneDNN's bf16 kernels are tuned for many rows; fp32 weights are twice the bytes). These loops
// read each weight once, split the rows across torch's threads, and take x and give y in x's dtype
// (fp32 or bf16). Built with -march=native: AVX-512 CPUs get the intrinsics paths, others the plain
// loops, which the compiler vectorizes.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_AVX512 1
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using c10::BFloat16;

// Rows per task: at least ~64 KB of weights, so a thread's share is worth waking it for.
int64_t grain(int64_t k_dim, int64_t bytes_per_weight) {
  return std::max<int64_t>(1, (64 * 1024) / std::max<int64_t>(1, k_dim * bytes_per_weight));
}

float to_float(uint16_t bf16) {  // bf16 is the top half of an fp32
  uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// ---- bf16 weights ------------------------------------------------------------------------------
// One row at a time: on AVX-512 a single stream per row measured faster than interleaving rows.

#ifdef HAVE_AVX512
float dot_bf16(const uint16_t* w, const float* x, int64_t k_dim) {  // fp32 x: widen each weight
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= k_dim; k += 32) {
    __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k)));
    __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k + 16)));
    acc0 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(lo, 16)), _mm512_loadu_ps(x + k), acc0);
    acc1 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(hi, 16)), _mm512_loadu_ps(x + k + 16), acc1);
  }
  float sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
  for (; k < k_dim; k++) sum += to_float(w[k]) * x[k];
  return sum;
}
#else
float dot_bf16(const uint16_t* w, const float* x, int64_t k_dim) {
  // 32 running sums, which the compiler turns into several independent vector accumulators: one
  // accumulator would wait on the latency of each multiply-add (measured 15 GB/s instead of 20-37).
  float part[32] = {};
  int64_t k = 0;
  for (; k + 32 <= k_dim; k += 32)
    for (int j = 0; j < 32; j++) part[j] += to_float(w[k + j]) * x[k + j];
  float sum = 0.f;
  for (int j = 0; j < 32; j++) sum += part[j];
  for (; k < k_dim; k++) sum += to_float(w[k]) * x[k];
  return sum;
}
#endif

#if defined(HAVE_AVX512) && defined(__AVX512BF16__)
// bf16 x and bf16 weights: dot products of bf16 pairs accumulated in fp32 (vdpbf16ps), 32 a step.
float dot_bf16_bf16(const uint16_t* w, const uint16_t* x, int64_t k_dim) {
  __m512 acc = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= k_dim; k += 32)
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(w + k), (__m512bh)_mm512_loadu_si512(x + k));
  if (k < k_dim) {
    const __mmask32 tail = static_cast<__mmask32>((1ull << (k_dim - k)) - 1);
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(tail, w + k),
                           (__m512bh)_mm512_maskz_loadu_epi16(tail, x + k));
  }
  return _mm512_reduce_add_ps(acc);
}
#define HAVE_BF16_DOT 1
#endif

// ---- int8 weights ------------------------------------------------------------------------------
// Each run of `group` weights of a row has its own scale. x is rounded to int16 with one scale, so
// within a group the products are integer multiply-adds (|w| <= 127, |x| <= 32767: a group of up to
// 256 sums safely in int32); each group's sum is then scaled in float.

float dot_q8(const int8_t* w, const int16_t* x, const float* scale, int64_t k_dim, int64_t group) {
  int64_t k = 0;
  float sum = 0.f;
#ifdef HAVE_AVX512
  if (group % 32 == 0) {
    __m512 total = _mm512_setzero_ps();
    for (; k < k_dim; k += group) {
      __m512i acc = _mm512_setzero_si512();
      for (int64_t i = k; i < k + group; i += 32) {  // 32 weights widened to int16; pairs multiplied and added
        __m512i wi = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i)));
        acc = _mm512_add_epi32(acc, _mm512_madd_epi16(wi, _mm512_loadu_si512(x + i)));
      }
      total = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(scale[k / group]), total);
    }
    return _mm512_reduce_add_ps(total);
  }
#endif
  for (; k < k_dim; k += group) {
    int32_t acc = 0;
    for (int64_t i = k; i < k + group; i++) acc += static_cast<int16_t>(w[i]) * x[i];
    sum += static_cast<float>(acc) * scale[k / group];
  }
  return sum;
}

// ---- ops ---------------------------------------------------------------------------------------
// Each op takes several matrices with the same K and gives their outputs concatenated (the rows of
// q, k and v, or of gate and up, in one call and one parallel region).

void check(const at::Tensor& x, at::TensorList ws, at::ScalarType dtype) {
  TORCH_CHECK(x.dim() == 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
              x.is_contiguous() && x.device().is_cpu(), "x: contiguous float32 or bfloat16 CPU tensor (K,)");
  TORCH_CHECK(!ws.empty(), "no weight matrices");
  for (const at::Tensor& w : ws) {
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == dtype && w.is_contiguous() && w.device().is_cpu(),
                "w: contiguous (N, K) CPU tensor of ", dtype);
    TORCH_CHECK(w.size(1) == x.size(0), "w is ", w.sizes(), " but x has ", x.size(0), " elements");
  }
}

// y[n] = row(m, r) for output n = row r of matrix m, in parallel; y in x's dtype.
template <typename Row>
at::Tensor rows_to(const at::Tensor& x, at::TensorList ws, int64_t bytes_per_weight, Row row) {
  std::vector<int64_t> first{0};  // first[m]: y index of matrix m's row 0
  for (const at::Tensor& w : ws) first.push_back(first.back() + w.size(0));
  at::Tensor y = at::empty({first.back()}, x.options());
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  float* yf = bf16 ? nullptr : y.data_ptr<float>();
  BFloat16* yb = bf16 ? y.data_ptr<BFloat16>() : nullptr;
  at::parallel_for(0, first.back(), grain(x.size(0), bytes_per_weight), [&](int64_t begin, int64_t end) {
    size_t m = 0;
    for (int64_t n = begin; n < end; n++) {
      while (n >= first[m + 1]) m++;
      const float v = row(m, n - first[m]);
      if (bf16) yb[n] = BFloat16(v); else yf[n] = v;
    }
  });
  return y;
}

at::Tensor matvec_bf16(const at::Tensor& x, at::TensorList ws) {
  check(x, ws, at::kBFloat16);
  const int64_t k_dim = x.size(0);
  std::vector<const uint16_t*> w;
  for (const at::Tensor& t : ws) w.push_back(reinterpret_cast<const uint16_t*>(t.data_ptr()));
#ifdef HAVE_BF16_DOT
  if (x.scalar_type() == at::kBFloat16) {
    const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
    return rows_to(x, ws, 2, [&](size_t m, int64_t r) { return dot_bf16_bf16(w[m] + r * k_dim, xp, k_dim); });
  }
#endif
  const at::Tensor xf = x.to(at::kFloat);
  const float* xp = xf.data_ptr<float>();
  return rows_to(x, ws, 2, [&](size_t m, int64_t r) { return dot_bf16(w[m] + r * k_dim, xp, k_dim); });
}

at::Tensor matvec_int8(const at::Tensor& x, at::TensorList ws, at::TensorList scales) {
  check(x, ws, at::kChar);
  TORCH_CHECK(scales.size() == ws.size(), "one scale vector per matrix");
  std::vector<const int8_t*> w;
  std::vector<const float*> s;
  for (size_t m = 0; m < ws.size(); m++) {
    TORCH_CHECK(scales[m].dim() == 2 && scales[m].size(0) == ws[m].size(0) &&
                scales[m].scalar_type() == at::kFloat && scales[m].is_contiguous(),
                "scale: contiguous float32 (N, K / group)");
    TORCH_CHECK(x.size(0) % scales[m].size(1) == 0 && x.size(0) / scales[m].size(1) <= 256,
                "scale: K / group groups of at most 256 weights; got ", scales[m].sizes(), " for K=", x.size(0));
    w.push_back(ws[m].data_ptr<int8_t>());
    s.push_back(scales[m].data_ptr<float>());
  }
  const int64_t k_dim = x.size(0);
  const at::Tensor xf = x.to(at::kFloat);
  const float* xp = xf.data_ptr<float>();
  float x_max = 0.f;
  for (int64_t k = 0; k < k_dim; k++) x_max = std::max(x_max, std::abs(xp[k]));
  const float x_scale = x_max > 0.f ? x_max / 32767.f : 1.f;
  std::vector<int16_t> xq(k_dim);
  for (int64_t k = 0; k < k_dim; k++) xq[k] = static_cast<int16_t>(std::nearbyint(xp[k] / x_scale));
  std::vector<int64_t> groups;
  for (const at::Tensor& t : scales) groups.push_back(t.size(1));
  return rows_to(x, ws, 1, [&](size_t m, int64_t r) {
    return dot_q8(w[m] + r * k_dim, xq.data(), s[m] + r * groups[m], k_dim, k_dim / groups[m]) * x_scale;
  });
}

}  // namespace

TORCH_LIBRARY(llama_kernels, m) {
  m.def("matvec_bf16(Tensor x, Tensor[] w) -> Tensor");
  m.def("matvec_int8(Tensor x, Tensor[] w, Tensor[] scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(llama_kernels, CPU, m) {
  m.impl("matvec_bf16", matvec_bf16);
  m.impl("matvec_int8", matvec_int8);
}
