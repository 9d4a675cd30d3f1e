// y = W x for a single token, reading 16-bit or 8-bit weights at memory bandwidth.
//
// Decoding one token multiplies every weight matrix by one vector, so its speed is the speed at
// which weights stream from memory. PyTorch's CPU linear either needs fp32 weights (twice the bytes
// of bf16) or, for bf16 weights on CPUs without native bf16, runs far below bandwidth. These plain
// loops are vectorized by the compiler (-O3 -march=native) and split across torch's threads.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float to_float(uint16_t bf16) {  // bf16 is the top half of an fp32
  uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// bf16 weights: y[n] = sum_k w[n, k] * x[k], four rows at a time (four independent sums per k).
void matvec(const uint16_t* w, const float* x, float* y, int64_t n_rows, int64_t k_dim) {
  at::parallel_for(0, (n_rows + 3) / 4, 16, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; block++) {
      const int64_t n = block * 4, rows = std::min<int64_t>(4, n_rows - n);
      const uint16_t* r0 = w + n * k_dim;
      const uint16_t* r1 = rows > 1 ? r0 + k_dim : r0;
      const uint16_t* r2 = rows > 2 ? r0 + 2 * k_dim : r0;
      const uint16_t* r3 = rows > 3 ? r0 + 3 * k_dim : r0;
      float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
      for (int64_t k = 0; k < k_dim; k++) {
        const float xk = x[k];
        s0 += to_float(r0[k]) * xk;
        s1 += to_float(r1[k]) * xk;
        s2 += to_float(r2[k]) * xk;
        s3 += to_float(r3[k]) * xk;
      }
      const float sums[4] = {s0, s1, s2, s3};
      for (int64_t i = 0; i < rows; i++) y[n + i] = sums[i];
    }
  });
}

void check(const at::Tensor& x, const at::Tensor& w, at::ScalarType dtype) {
  TORCH_CHECK(x.dim() == 1 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 (K,)");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == dtype && w.is_contiguous(), "w: contiguous (N, K) of ", dtype);
  TORCH_CHECK(w.size(1) == x.size(0), "w is ", w.sizes(), " but x has ", x.size(0), " elements");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "CPU tensors only");
}

at::Tensor matvec_bf16(const at::Tensor& x, const at::Tensor& w) {
  check(x, w, at::kBFloat16);
  at::Tensor y = at::empty({w.size(0)}, x.options());
  matvec(reinterpret_cast<const uint16_t*>(w.data_ptr()), x.data_ptr<float>(), y.data_ptr<float>(),
         w.size(0), w.size(1));
  return y;
}

// int8 weights: x is rounded to int16 with one scale, so the inner loop is integer multiply-adds
// (twice the throughput of converting each weight to float). Sums of 256 products of
// |w| <= 127 and |x| <= 32767 stay far inside int32; each block's sum then goes to a float.
void matvec_q8(const int8_t* w, const int16_t* xq, float x_scale, const float* scale, float* y,
               int64_t n_rows, int64_t k_dim) {
  constexpr int64_t kBlock = 256;
  at::parallel_for(0, n_rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; n++) {
      const int8_t* r = w + n * k_dim;
      float sum = 0.f;
      for (int64_t k0 = 0; k0 < k_dim; k0 += kBlock) {
        const int64_t k1 = std::min(k0 + kBlock, k_dim);
        int32_t acc = 0;
        for (int64_t k = k0; k < k1; k++) acc += static_cast<int16_t>(r[k]) * xq[k];
        sum += static_cast<float>(acc);
      }
      y[n] = sum * x_scale * scale[n];
    }
  });
}

at::Tensor matvec_int8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  check(x, w, at::kChar);
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == w.size(0) && scale.scalar_type() == at::kFloat &&
              scale.is_contiguous(), "scale: contiguous float32 (N,)");
  const int64_t k_dim = x.size(0);
  const float* xf = x.data_ptr<float>();
  float x_max = 0.f;
  for (int64_t k = 0; k < k_dim; k++) x_max = std::max(x_max, std::abs(xf[k]));
  const float x_scale = x_max > 0.f ? x_max / 32767.f : 1.f;
  std::vector<int16_t> xq(k_dim);
  for (int64_t k = 0; k < k_dim; k++) xq[k] = static_cast<int16_t>(std::nearbyint(xf[k] / x_scale));
  at::Tensor y = at::empty({w.size(0)}, x.options());
  matvec_q8(w.data_ptr<int8_t>(), xq.data(), x_scale, scale.data_ptr<float>(), y.data_ptr<float>(),
            w.size(0), k_dim);
  return y;
}

}  // namespace

TORCH_LIBRARY(llama_kernels, m) {
  m.def("matvec_bf16(Tensor x, Tensor w) -> Tensor");
  m.def("matvec_int8(Tensor x, Tensor w, Tensor scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(llama_kernels, CPU, m) {
  m.impl("matvec_bf16", matvec_bf16);
  m.impl("matvec_int8", matvec_int8);
}
