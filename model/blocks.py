"""Weight matrices kept in llama.cpp's own blocks, as a GGUF file holds them (csrc/ggml_blocks.h).

The K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K: 256 weights a block, with 16 or 8 scales inside it) and Q5_0 /
Q5_1 (32), the types of llama-quantize's Q4_K_M, Q5_K_M, Q6_K, Q3_K_M and Q2_K files (Q5_0 and Q5_1 where a
row is not whole blocks of 256, as the default model's 576). Such a matrix is a uint8 tensor (N, K / block,
bytes): each row's blocks, byte for byte as in the file, so an import copies them and a load maps them. Its
last dimension names its format: no two of these formats have blocks of the same size. Decode multiplies
the blocks directly (csrc/matvec.cpp matvec_blocks); prefill and the embedding's lookups widen rows of them
(csrc/dequantize.cpp), each weight as the gguf library computes it.
"""

from __future__ import annotations

import numpy as np
import torch

from .block_formats import FORMATS, BlockFormat




def is_blocks(weight: torch.Tensor | None) -> bool:
    """Whether `weight` is a matrix in llama.cpp's blocks (not int4's uint8 (N, K // 2))."""
    return weight is not None and weight.dtype == torch.uint8 and weight.dim() == 3 and weight.shape[2] in FORMATS


def block_format(weight: torch.Tensor) -> BlockFormat:
    return FORMATS[weight.shape[2]]


def in_features(weight: torch.Tensor) -> int:
    """K of a matrix in blocks."""
    return weight.shape[1] * block_format(weight).block


def dequantize_blocks(weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The (N, K) matrix that blocks (N, K / block, bytes) stand for, in `dtype`: the kernel's loop where it is
    built, else the gguf library's (the reference that loop is tested against)."""
    from .kernels import kernels

    ops = kernels() if weight.device.type == "cpu" else None
    if ops is not None and dtype in (torch.float32, torch.bfloat16):
        return ops.dequantize_blocks(weight.contiguous(), dtype)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    kind = GGMLQuantizationType[block_format(weight).name]
    values = dequantize(weight.cpu().numpy().reshape(weight.shape[0], -1), kind)  # (N, K) float32
    return torch.from_numpy(np.ascontiguousarray(values)).to(device=weight.device, dtype=dtype)
