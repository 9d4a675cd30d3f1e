// The decode kernel as the other C++ files of the extension call it (decode_step.cpp): one entry for
// every kind of weight matrix, chosen by the weights' dtype, so a new kind is one more case here.
#pragma once

#include <ATen/core/Tensor.h>

namespace llama {

// y = x W_i^T for matrices W_i (N_i, K) of one kind, outputs side by side: x (M, K) fp32 or bf16,
// 1 <= M <= 8 -> y (M, sum N_i) in x's dtype. bf16 weights take no scales; int8 weights take one
// fp32 scale tensor (N_i, K / group) each.
at::Tensor matvec(const at::Tensor& x, at::TensorList ws, at::TensorList scales);

}  // namespace llama
