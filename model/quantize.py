"""int8 weights: symmetric, with one scale per group of INT8_GROUP weights of a row.

A (N, K) matrix becomes int8 q (N, K) and fp32 scales (N, K // group); weight ~= q * scale of its group.
Decode multiplies q directly (csrc/matvec.cpp); everything else goes through `dequantize_int8`.
"""

from __future__ import annotations

import torch

INT8_GROUP = 64  # weights of a row that share one scale


def int8_group(k: int) -> int:
    """The group size for rows of k weights: INT8_GROUP, or the largest divisor of k below it."""
    return next(g for g in range(min(INT8_GROUP, k), 0, -1) if k % g == 0)


@torch.no_grad()
def quantize_int8(weight: torch.Tensor, rows: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (q int8 (N, K), scale fp32 (N, K // group)): weight ~= dequantize_int8(q, scale).

    Works through `rows` rows at a time, so a large matrix never has a full fp32 copy.
    """
    n, k = weight.shape
    group = int8_group(k)
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scale = torch.empty(n, k // group, dtype=torch.float32, device=weight.device)
    for i in range(0, n, rows):
        w = weight[i:i + rows].float().view(-1, k // group, group)  # (rows, groups, group)
        s = w.abs().amax(dim=-1).clamp(min=1e-8) / 127.0
        q[i:i + rows] = torch.round(w / s[..., None]).clamp_(-127, 127).view(-1, k)
        scale[i:i + rows] = s
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """The (N, K) matrix that int8 q with group scales (N, K // group) stands for."""
    n, k = q.shape
    return (q.view(n, scale.shape[1], -1).to(dtype) * scale.to(dtype)[..., None]).view(n, k)
