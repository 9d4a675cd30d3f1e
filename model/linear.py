"""Linear layers whose weights may be stored as bf16 or int8, with activations in fp32 or bf16.

Prefill (many rows) goes to `F.linear`. Decode (one row per sequence, up to MAX_KERNEL_ROWS) is
bound by memory bandwidth: the decode kernel (model/kernels.py) streams the 16-bit or 8-bit
weights once for all rows, several matrices of the same input in one call (q|k|v, gate|up).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .kernels import kernels
from .quantize import dequantize_int8, quantize_int8

MAX_KERNEL_ROWS = 8  # rows of x (tokens in one decode step) the decode kernel takes; more go to F.linear


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) @ weight (N, K).T, weight in any dtype (int8 with group scales (N, K // group))."""
    return linears(x, [weight], [scale])


def linears(x: torch.Tensor, weights: list[torch.Tensor], scales: list[torch.Tensor | None]) -> torch.Tensor:
    """x (..., K) through several weight matrices (N_i, K) at once: outputs side by side, (..., sum N_i).

    Up to MAX_KERNEL_ROWS rows of x on the CPU go to the decode kernel, which reads each weight once
    for all of them; more rows (prefill) go to F.linear.
    """
    kind, k_dim = weights[0].dtype, x.shape[-1]
    rows = x.numel() // k_dim if k_dim else 0
    if (1 <= rows <= MAX_KERNEL_ROWS and x.device.type == "cpu" and kind in (torch.bfloat16, torch.int8)
            and x.dtype in (torch.float32, torch.bfloat16) and all(w.dtype == kind for w in weights)):
        ops = kernels()
        if ops:  # y comes back in x's dtype
            flat = x.reshape(rows, k_dim).contiguous()  # (M, K)
            y = (ops.matvec_bf16(flat, weights) if kind == torch.bfloat16
                 else ops.matvec_int8(flat, weights, [s.float() for s in scales]))  # (M, sum N_i)
            return y.view(*x.shape[:-1], -1)
    outputs = [F.linear(x, w.to(x.dtype) if s is None else dequantize_int8(w, s, x.dtype))
               for w, s in zip(weights, scales)]
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)


def project(x: torch.Tensor, *layers: Linear) -> torch.Tensor:
    """x through several Linear layers of the same input size, outputs side by side (q|k|v, gate|up)."""
    return linears(x, [layer.weight for layer in layers], [layer.scale for layer in layers])


class Linear(nn.Linear):
    """nn.Linear without bias whose weight may be bf16, or int8 with a `scale` per group of a row.

    `scale` is a buffer (None unless quantized), so `.to()` moves it and `state_dict()` holds it
    (`layers.0.attention.wq.scale`) beside the int8 weight.
    """

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)
        self.register_buffer("scale", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self)


class Embedding(nn.Embedding):
    """nn.Embedding whose weight may be int8 with a `scale` per group of a row (a GGUF's Q8_0 table):
    only the rows looked up are dequantized, so the table is never held twice. `scale` is a buffer, as
    Linear's (a tied output head shares it)."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__(num_embeddings, embedding_dim)
        self.register_buffer("scale", None)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            return super().forward(tokens)
        ids = tokens.reshape(-1)
        rows = dequantize_int8(self.weight[ids], self.scale[ids])  # (tokens, dim) float32
        return rows.view(*tokens.shape, -1)


@torch.no_grad()
def quantize_model(model: nn.Module) -> None:
    """Store every Linear of `model` as int8 (a tied output head gets its own int8 copy)."""
    for module in model.modules():
        if isinstance(module, Linear) and module.weight.dtype != torch.int8:
            q, module.scale = quantize_int8(module.weight)
            module.weight = nn.Parameter(q, requires_grad=False)
