"""The operations of the static decode step (model/static_decode.py) besides its matrix products, each written
once in torch, the reference, and used as Triton kernels (model/triton_kernels.py) where those run: on CUDA
with Triton installed and a head size of a power of two. Both compute the reference's maths.

- add_rms_norm(x, delta, norm): the residual stream x += delta in place (delta None: nothing added), then
  RMSNorm(x) * weight: every norm of a layer follows an add, so one kernel does both.
- rope_write(qkv, cos, sin, positions, slots, layer_k, layer_v, n_heads): queries and keys rotated (RoPE at each
  row's position), keys and values written into each row's slot at that position -> the queries (b, h, d).
- attend(q, layer_k, layer_v, slots, positions, length): one query a head against its row's keys 0..position
  (grouped-query: each KV head serves n_heads / n_kv_heads queries) -> (b, h, d). The torch form gathers the
  first `length` keys of each slot and masks those past the row's position (so steps of other lengths are
  other CUDA graphs); the Triton form reads each row's own keys only, so `length` does not matter to it
  (`reads_own_length`).
- silu_mul(gate_up): SiLU(gate) * up.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from .llama import sdpa
from .rope import rotate_half


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, norm: nn.RMSNorm) -> torch.Tensor:
    if delta is not None:
        x.add_(delta)
    return norm(x)


def rope_write(qkv, cos, sin, positions, slots, layer_k, layer_v, n_heads: int) -> torch.Tensor:
    b, (n_kv_heads, d) = qkv.shape[0], (layer_k.shape[1], layer_k.shape[3])
    qkv = qkv.view(b, n_heads + 2 * n_kv_heads, d)
    cos, sin = cos[positions][:, None], sin[positions][:, None]  # (b, 1, d)
    qk = qkv[:, :n_heads + n_kv_heads] * cos + rotate_half(qkv[:, :n_heads + n_kv_heads]) * sin
    heads = torch.arange(n_kv_heads, device=qkv.device)[None, :]  # (1, kv)
    layer_k[slots[:, None], heads, positions[:, None]] = qk[:, n_heads:]  # every row written before any attends
    layer_v[slots[:, None], heads, positions[:, None]] = qkv[:, n_heads + n_kv_heads:]
    return qk[:, :n_heads]


def attend(q, layer_k, layer_v, slots, positions, length: int) -> torch.Tensor:
    b, n_heads, d = q.shape
    n_kv_heads = layer_k.shape[1]
    keys, values = layer_k[slots, :, :length], layer_v[slots, :, :length]  # (b, kv, length, d)
    seen = torch.arange(length, device=q.device)[None, :] <= positions[:, None]  # (b, length)
    mask = torch.zeros(seen.shape, dtype=q.dtype, device=q.device).masked_fill_(~seen, float("-inf"))
    out = sdpa(q.reshape(b, n_kv_heads, n_heads // n_kv_heads, d), keys, values,
               attn_mask=mask[:, None, None, :])  # (b, kv, groups, d)
    return out.view(b, n_heads, d)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


TORCH = SimpleNamespace(name="torch", reads_own_length=False, add_rms_norm=add_rms_norm, rope_write=rope_write,
                        attend=attend, silu_mul=silu_mul)


@functools.cache
def triton_ops() -> SimpleNamespace | None:
    """The Triton forms with the torch forms' signatures, or None where Triton is not installed."""
    try:
        from . import triton_kernels as kernels
    except ImportError:
        return None
    return SimpleNamespace(
        name="triton", reads_own_length=True,
        add_rms_norm=lambda x, delta, norm: kernels.add_rms_norm(x, delta, norm.weight, norm.eps),
        rope_write=kernels.rope_write,
        attend=lambda q, layer_k, layer_v, slots, positions, length: kernels.attend(q, layer_k, layer_v, slots,
                                                                                    positions),
        silu_mul=kernels.silu_mul)


def step_ops(device: torch.device, head_dim: int) -> SimpleNamespace:
    """The forms a step on `device` uses: Triton's on CUDA where it is installed and head_dim is a power of two
    (its vectors' sizes), else torch's."""
    if device.type == "cuda" and head_dim & (head_dim - 1) == 0:
        return triton_ops() or TORCH
    return TORCH
