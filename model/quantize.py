"""Quantized weights: int8 (one scale per group of a row) and int4 (one scale and offset per 32 weights).

int8: symmetric. A (N, K) matrix becomes int8 q (N, K) and fp32 scales (N, K // group); weight ~=
q * scale of its group.

int4: the layout of a GGUF's Q4_1 and Q4_0 blocks, so those import without quantizing again.
A (N, K) matrix (K a multiple of INT4_GROUP = 32) becomes
- `packed` uint8 (N, K // 2): each block of 32 weights of a row is 16 bytes, and byte j of block b
  holds weight 32 b + j in its low nibble and weight 32 b + 16 + j in its high nibble (llama.cpp's
  order: the low nibbles of the 16 bytes are the block's first half, in order, the high nibbles its
  second half, so a kernel unpacks a block with one mask and one shift);
- `scale` fp16 (N, K // 32) and `offset` fp16 (N, K // 32): weight = q * scale + offset, q in 0..15
  (asymmetric, Q4_1). `offset` None means Q4_0's symmetric blocks: weight = (q - 8) * scale, that is
  offset = -8 * scale, which fp16 holds exactly (a power of two times a fp16 number).
Decode multiplies the packed weights directly (csrc/matvec.cpp); everything else dequantizes.
"""

from __future__ import annotations

import torch

INT8_GROUP = 64  # weights of a row that share one scale
INT4_GROUP = 32  # weights of a row that share one scale and offset (a GGUF Q4_0/Q4_1 block)
INT4_LEVELS = 15  # q in 0..INT4_LEVELS
Q4_0_ZERO = 8  # a symmetric block's q of weight 0: offset = -Q4_0_ZERO * scale


def int8_group(k: int) -> int:
    """The group size for rows of k weights: INT8_GROUP, or the largest divisor of k below it."""
    return next(g for g in range(min(INT8_GROUP, k), 0, -1) if k % g == 0)


@torch.no_grad()
def quantize_int8(weight: torch.Tensor, rows: int = 4096, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (q int8 (N, K), scale fp32 (N, K // group)): weight ~= dequantize_int8(q, scale). group: weights
    of a row sharing a scale (default int8_group(K); K: one scale a row, as a GPU's packed int8 op takes them).

    Works through `rows` rows at a time, so a large matrix never has a full fp32 copy.
    """
    n, k = weight.shape
    group = group or int8_group(k)
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scale = torch.empty(n, k // group, dtype=torch.float32, device=weight.device)
    for i in range(0, n, rows):
        w = weight[i:i + rows].float().view(-1, k // group, group)  # (rows, groups, group)
        s = w.abs().amax(dim=-1).clamp(min=1e-8) / 127.0
        q[i:i + rows] = torch.round(w / s[..., None]).clamp_(-127, 127).view(-1, k)
        scale[i:i + rows] = s
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """The (N, K) matrix that int8 q with group scales (N, K // group) stands for, computed in fp32 and
    returned in `dtype` (each weight rounded once, as the kernel's loops do)."""
    n, k = q.shape
    return (q.view(n, scale.shape[1], -1).float() * scale.float()[..., None]).view(n, k).to(dtype)


def can_quantize_int4(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.shape[1] % INT4_GROUP == 0


@torch.no_grad()
def quantize_int4(weight: torch.Tensor, rows: int = 4096) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (packed uint8 (N, K // 2), scale fp16 (N, K // 32), offset fp16 (N, K // 32)), the layout of
    the module's docstring: each block's minimum is its offset and (max - min) / 15 its scale.

    Works through `rows` rows at a time, so a large matrix never has a full fp32 copy.
    """
    if not can_quantize_int4(weight):
        raise ValueError(f"int4 quantizes (N, K) matrices with K a multiple of {INT4_GROUP}; got {tuple(weight.shape)}")
    n, k = weight.shape
    blocks = k // INT4_GROUP
    packed = torch.empty(n, k // 2, dtype=torch.uint8, device=weight.device)
    scale = torch.empty(n, blocks, dtype=torch.float16, device=weight.device)
    offset = torch.empty(n, blocks, dtype=torch.float16, device=weight.device)
    for i in range(0, n, rows):
        w = weight[i:i + rows].float().view(-1, blocks, INT4_GROUP)  # (rows, blocks, 32)
        low, high = w.amin(dim=-1), w.amax(dim=-1)
        s = ((high - low) / INT4_LEVELS).half().clamp_(min=torch.finfo(torch.float16).tiny)
        m = low.half()
        # q from the fp16 scale and offset the kernel will use, so rounding them costs nothing more
        q = torch.round((w - m.float()[..., None]) / s.float()[..., None]).clamp_(0, INT4_LEVELS).to(torch.uint8)
        packed[i:i + rows] = pack_int4(q).view(-1, k // 2)
        scale[i:i + rows], offset[i:i + rows] = s, m
    return packed, scale, offset


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q uint8 (..., 32) in 0..15 -> (..., 16): first half in the low nibbles, second half in the high."""
    return q[..., :INT4_GROUP // 2] | (q[..., INT4_GROUP // 2:] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """packed uint8 (N, K // 2) -> q uint8 (N, K // 32, 32), each block's weights in order."""
    blocks = packed.view(packed.shape[0], -1, INT4_GROUP // 2)  # (N, K // 32, 16)
    return torch.cat([blocks & 0x0F, blocks >> 4], dim=-1)


def int4_offset(scale: torch.Tensor, offset: torch.Tensor | None) -> torch.Tensor:
    """The offsets of int4 blocks: `offset`, or Q4_0's -8 * scale where there is none."""
    return -Q4_0_ZERO * scale if offset is None else offset


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                    dtype=torch.float32) -> torch.Tensor:
    """The (N, K) matrix that int4 `packed` (N, K // 2) with scales and offsets (N, K // 32) stands for,
    computed in fp32 and returned in `dtype`."""
    n = packed.shape[0]
    w = unpack_int4(packed).float()  # (N, K // 32, 32)
    w.mul_(scale.float()[..., None]).add_(int4_offset(scale, offset).float()[..., None])  # in place: one fp32 copy
    return w.view(n, -1).to(dtype)


def dequantize(weight: torch.Tensor, scale: torch.Tensor | None, offset: torch.Tensor | None = None,
               dtype=torch.float32) -> torch.Tensor:
    """Any weight matrix as `dtype`: llama.cpp's blocks (model/blocks.py), int4 (uint8, packed), int8 with scales,
    or a float matrix."""
    from .blocks import dequantize_blocks, is_blocks

    if is_blocks(weight):
        return dequantize_blocks(weight, dtype)
    if weight.dtype == torch.uint8:
        return dequantize_int4(weight, scale, offset, dtype)
    if scale is not None:
        return dequantize_int8(weight, scale, dtype)
    return weight.to(dtype)
