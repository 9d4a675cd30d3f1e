"""Weight matrices kept in llama.cpp's own blocks, as a GGUF file holds them (csrc/ggml_blocks.h).

The K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K: 256 weights a block, with 16 or 8 scales inside it) and Q5_0 /
Q5_1 (32), the types of llama-quantize's Q4_K_M, Q5_K_M, Q6_K, Q3_K_M and Q2_K files (Q5_0 and Q5_1 where a
row is not whole blocks of 256, as the default model's 576). Such a matrix is a uint8 tensor (N, K / block,
bytes): each row's blocks, byte for byte as in the file, so an import copies them and a load maps them. Its
last dimension names its format: no two of these formats have blocks of the same size. Decode multiplies
the blocks directly (csrc/matvec.cpp matvec_blocks); prefill and the embedding's lookups widen rows of them
(csrc/dequantize.cpp), each weight as the gguf library computes it. On a GPU, Q4_K becomes torch's int4
(q4_k_as_int4, then model/packed.py) and the others are widened at load (model/checkpoint.py).
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


def is_q4_k(weight: torch.Tensor) -> bool:
    return is_blocks(weight) and block_format(weight).name == "Q4_K"


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


def q4_k_as_int4(weight: torch.Tensor, rows: int = 4096) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K blocks (N, K / 256, 144) -> int4 as model/quantize.py keeps it (packed uint8 (N, K // 2), scale and
    offset (N, K // 32)), for torch's int4 op on a GPU (model/packed.py repacks it from there). A Q4_K block is
    eight sub-blocks of 32 weights, each weight d sc q - dmin m (q 4 bits, sc and m 6 bits, d and dmin fp16): so
    scale d sc and offset -dmin m, both exact in fp32 (11 + 6 bits), and the values are the gguf library's bit for
    bit (one rounding, at the addition, in both). The scales stay fp32 here; the repack rounds them once, to
    the activations' dtype."""
    n, blocks = weight.shape[:2]
    packed = torch.empty(n, blocks * 128, dtype=torch.uint8)
    scale = torch.empty(n, blocks * 8)
    offset = torch.empty(n, blocks * 8)
    for i in range(0, n, rows):
        b = weight[i:i + rows].cpu()  # (r, blocks, 144)
        r = b.shape[0]
        d, dmin = (b[..., j:j + 2].contiguous().view(torch.float16).float() for j in (0, 2))  # (r, blocks, 1)
        s = b[..., 4:16].to(torch.int32)  # 12 bytes: sub-blocks 0-3's 6-bit scale and min, then 4-7's low nibbles
        sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 15) | (s[..., 0:4] >> 6 << 4)], dim=-1)  # (r, blocks, 8)
        mn = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | (s[..., 4:8] >> 6 << 4)], dim=-1)
        qs = b[..., 16:].reshape(r, blocks, 4, 1, 32)  # bytes 32c..32c+31: sub-block 2c low, 2c + 1 high
        q = torch.cat([qs & 15, qs >> 4], dim=3).reshape(r, blocks * 8, 32)  # (r, sub-blocks, 32) in order
        packed[i:i + r] = (q[..., :16] | q[..., 16:] << 4).reshape(r, -1)  # quantize.pack_int4's layout
        scale[i:i + r] = (d * sc).reshape(r, -1)
        offset[i:i + r] = (-(dmin * mn)).reshape(r, -1)
    return packed, scale, offset
