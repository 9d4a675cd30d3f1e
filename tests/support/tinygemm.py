"""What torch's int4 matmul (tinygemm) computes, written out in fp32 on the CPU, for each device's kernel.

Both kernels take the 4-bit values q (0..15) and, per block of 32 k, a (scale, zero) pair in the activations'
dtype (model/packed.py), and compute y = x @ ((q - 8) * scale + zero).T:

- CUDA (aten/src/ATen/native/cuda/int4mm.cu): each weight is dequantized by one bf16 fused multiply-add
  (`__hfma2`), so it is rounded to bf16 once; the tensor cores multiply bf16 x by those bf16 weights and sum
  in fp32; y is rounded to bf16.
- CPU (`_weight_int4pack_mm_for_cpu`): the weight is formed in fp32 (not rounded), the sums are fp32, y is
  rounded to bf16 (checked against the op in tests/model/test_packed.py).

Only the order of the fp32 sums is not reproduced, so a kernel's y and its emulation differ by at most one
bf16 step of y (plus fp32 rounding). The tests' tolerances on a GPU are derived from these emulations.
"""

from __future__ import annotations

import torch

from model.quantize import INT4_GROUP


def dequantized(q: torch.Tensor, scales_and_zeros: torch.Tensor, device_type: str) -> torch.Tensor:
    """q (N, K) in 0..15 and scales_and_zeros (K // 32, N, 2) -> the weights (N, K) in fp32 as the kernel of
    `device_type` ("cuda" or "cpu") forms them before it multiplies."""
    pairs = scales_and_zeros.float().cpu().transpose(0, 1)  # (N, K // 32, 2)
    scale = pairs[..., 0].repeat_interleave(INT4_GROUP, dim=1)  # (N, K)
    zero = pairs[..., 1].repeat_interleave(INT4_GROUP, dim=1)
    w = (q.float().cpu() - 8) * scale + zero  # exact in fp32 for 4-bit q and bf16 scale and zero
    return w.bfloat16().float() if device_type == "cuda" else w


def product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (M, K) @ w (N, K).T as the kernels do it: x in bf16, sums in fp32, y rounded to bf16 -> (M, N) fp32."""
    return (x.bfloat16().float().cpu() @ w.T).bfloat16().float()


def bf16_steps(y: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """|y - reference| in units of the bf16 step (2^-7 relative) at each reference value's size."""
    step = torch.ldexp(torch.ones_like(reference), torch.frexp(reference)[1] - 8)  # 2^(exponent - 7)
    return (y.float() - reference).abs() / step.clamp(min=2.0**-126)


def emulate_cuda_int4(monkeypatch) -> None:
    """From here on, the int4 matrices of unpacked models on the CPU multiply as CUDA's tinygemm would multiply
    them once packed (bf16 scale and zero, each weight rounded to bf16, bf16 x, y rounded to bf16); nothing
    goes to the decode kernel, so every product of a few rows takes that path too."""
    import model.linear
    from model.quantize import Q4_0_ZERO, int4_offset, unpack_int4

    unpacked = model.linear.blockwise_linear

    def blockwise_linear(x, weight, scale, offset):
        if weight.dtype != torch.uint8:
            return unpacked(x, weight, scale, offset)
        n, k = weight.shape[0], weight.shape[1] * 2
        zero = int4_offset(scale, offset).float() + Q4_0_ZERO * scale.float()  # model/packed.py's repack_int4
        pairs = torch.stack([scale.float(), zero], dim=-1).transpose(0, 1).bfloat16()  # (K // 32, N, 2)
        w = dequantized(unpack_int4(weight).view(n, k), pairs, "cuda")
        return product(x.reshape(-1, k), w).to(x.dtype).view(*x.shape[:-1], n)

    monkeypatch.setattr(model.linear, "blockwise_linear", blockwise_linear)
    monkeypatch.setattr(model.linear, "kernels", lambda: None)
