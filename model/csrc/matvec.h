// The decode kernel as the other C++ files of the extension call it (decode_step.cpp): one entry for
// every kind of weight matrix, chosen by the weights' dtype, so a new kind is one more case here.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace llama {

// One optional tensor per matrix: int4 blocks' fp16 offsets, none for Q4_0's symmetric blocks.
using Offsets = c10::ArrayRef<std::optional<at::Tensor>>;

// y = x W_i^T for matrices W_i (N_i, K) of one kind, outputs side by side: x (M, K) fp32 or bf16,
// 1 <= M <= 8 -> y (M, sum N_i) in x's dtype (fp32 with fp32_out). bf16 weights take no scales; int8 weights take one
// fp32 scale tensor (N_i, K / group) each; int4 weights (uint8 (N_i, K / 2), model/quantize.py's
// layout) one fp16 scale tensor (N_i, K / 32) each and one offset each (fp16 (N_i, K / 32), or
// none). `offsets` is empty or holds only nones for the other kinds.
at::Tensor matvec(const at::Tensor& x, at::TensorList ws, at::TensorList scales, Offsets offsets = {},
                  bool fp32_out = false);

}  // namespace llama
