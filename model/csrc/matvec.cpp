// y = W x for a single token, reading 16-bit or 8-bit weights at memory bandwidth.
//
// Decoding one token multiplies every weight matrix by one vector, so its speed is the speed at
// which weights stream from memory. PyTorch's CPU linear either needs fp32 weights (twice the bytes
// of bf16) or, for bf16 weights on CPUs without native bf16, runs far below bandwidth. These loops
// convert each weight to fp32 in registers and accumulate in fp32; the compiler vectorizes them.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

namespace {

inline float to_float(uint16_t bf16) {  // bf16 is the top half of an fp32
  uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float to_float(int8_t q) { return static_cast<float>(q); }

// y[n] = scale[n] * sum_k w[n, k] * x[k], four rows at a time (four independent sums per k).
template <typename T>
void matvec(const T* w, const float* x, const float* scale, float* y, int64_t n_rows, int64_t k_dim) {
  at::parallel_for(0, (n_rows + 3) / 4, 16, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; block++) {
      const int64_t n = block * 4, rows = std::min<int64_t>(4, n_rows - n);
      const T* r0 = w + n * k_dim;
      const T* r1 = rows > 1 ? r0 + k_dim : r0;
      const T* r2 = rows > 2 ? r0 + 2 * k_dim : r0;
      const T* r3 = rows > 3 ? r0 + 3 * k_dim : r0;
      float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
      for (int64_t k = 0; k < k_dim; k++) {
        const float xk = x[k];
        s0 += to_float(r0[k]) * xk;
        s1 += to_float(r1[k]) * xk;
        s2 += to_float(r2[k]) * xk;
        s3 += to_float(r3[k]) * xk;
      }
      const float sums[4] = {s0, s1, s2, s3};
      for (int64_t i = 0; i < rows; i++) y[n + i] = scale ? sums[i] * scale[n + i] : sums[i];
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
  matvec(reinterpret_cast<const uint16_t*>(w.data_ptr()), x.data_ptr<float>(), nullptr,
         y.data_ptr<float>(), w.size(0), w.size(1));
  return y;
}

at::Tensor matvec_int8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  check(x, w, at::kChar);
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == w.size(0) && scale.scalar_type() == at::kFloat &&
              scale.is_contiguous(), "scale: contiguous float32 (N,)");
  at::Tensor y = at::empty({w.size(0)}, x.options());
  matvec(w.data_ptr<int8_t>(), x.data_ptr<float>(), scale.data_ptr<float>(), y.data_ptr<float>(),
         w.size(0), w.size(1));
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
