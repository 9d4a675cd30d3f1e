"""Triton kernels of the GPU decode step (model/step_ops.py says what each computes, in torch).

A decode step of the 1B shape is ~25 small ops a layer when written in torch: norms, a residual add, RoPE's
pieces, two scatters into the KV slots, a gather of each row's keys, SiLU, a product. Each is a kernel
launch and a round trip of its tensor through memory. Here they become four kernels a layer besides the
matrix products:

- `add_rms_norm`: the residual stream x += delta (rounded to x's dtype, as the reference's add), then
  RMSNorm(x) * weight into `out`; one program a row.
- `rope_write`: RoPE on the queries and keys of q|k|v (the "half split" layout, model/rope.py), the queries
  into a buffer, the keys and values straight into each row's KV slot at its position; one program a
  (row, head).
- `attend` (two kernels, split-KV as flash-decoding does it): each row's keys 0..position of its slot cut
  into SPLITS equal parts, each part's softmax-weighted sum of values computed apart (online softmax, in
  fp32), then merged with their maxima and sums. The length comes from the position on the device: no
  key past it is read, no gather copy is made, and one graph serves every length.
- `silu_mul`: SiLU(gate) * up of gate|up.

Numbers are computed in fp32 and rounded once to the activations' dtype where the reference rounds after
each op: within a bf16 step of the reference (tests/model/test_step_ops.py). On the CPU they run under
TRITON_INTERPRET=1 (how the tests run them); model/step_ops.py uses them on CUDA only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SPLITS = 32  # parts of each row's keys attended apart, then merged (a power of two)
BLOCK_KEYS = 32  # keys a program reads at once


@triton.jit
def _add_rms_norm(x_ptr, delta_ptr, weight_ptr, out_ptr, dim, eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < dim
    x = tl.load(x_ptr + row * dim + cols, mask=inside, other=0.0).to(tl.float32)
    if HAS_DELTA:
        x += tl.load(delta_ptr + row * dim + cols, mask=inside, other=0.0).to(tl.float32)
        stored = x.to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * dim + cols, stored, mask=inside)
        x = stored.to(tl.float32)  # the norm reads the residual as stored
    inverse = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / dim + eps)
    weight = tl.load(weight_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * dim + cols, (x * inverse * weight).to(out_ptr.dtype.element_ty), mask=inside)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (b, dim) += delta (in place), then RMSNorm(x) * weight -> (b, dim) in x's dtype."""
    b, dim = x.shape
    out = torch.empty_like(x)
    _add_rms_norm[(b,)](x, x if delta is None else delta, weight, out, dim, eps,
                        HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(dim))
    return out


@triton.jit
def _rope_write(qkv_ptr, cos_ptr, sin_ptr, positions_ptr, slots_ptr, q_ptr, k_ptr, v_ptr,
                n_heads, n_kv_heads, slot_stride, head_stride, HALF: tl.constexpr):
    row, head = tl.program_id(0), tl.program_id(1)  # head: 0..n_heads-1 queries, then the KV heads
    d = 2 * HALF
    position, slot = tl.load(positions_ptr + row), tl.load(slots_ptr + row)
    i = tl.arange(0, HALF)
    source = qkv_ptr + (row * (n_heads + 2 * n_kv_heads) + head) * d
    x1, x2 = tl.load(source + i).to(tl.float32), tl.load(source + HALF + i).to(tl.float32)
    table = position * d
    cos1, cos2 = tl.load(cos_ptr + table + i).to(tl.float32), tl.load(cos_ptr + table + HALF + i).to(tl.float32)
    sin1, sin2 = tl.load(sin_ptr + table + i).to(tl.float32), tl.load(sin_ptr + table + HALF + i).to(tl.float32)
    y1, y2 = x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2  # x * cos + rotate_half(x) * sin
    if head < n_heads:
        target = q_ptr + (row * n_heads + head) * d
        tl.store(target + i, y1.to(q_ptr.dtype.element_ty))
        tl.store(target + HALF + i, y2.to(q_ptr.dtype.element_ty))
    else:
        kv = head - n_heads
        at = slot * slot_stride + kv * head_stride + position * d
        tl.store(k_ptr + at + i, y1.to(k_ptr.dtype.element_ty))
        tl.store(k_ptr + at + HALF + i, y2.to(k_ptr.dtype.element_ty))
        value = source + n_kv_heads * d  # this KV head's value, n_kv_heads heads further on
        tl.store(v_ptr + at + i, tl.load(value + i))
        tl.store(v_ptr + at + HALF + i, tl.load(value + HALF + i))


def rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
               slots: torch.Tensor, layer_k: torch.Tensor, layer_v: torch.Tensor, n_heads: int) -> torch.Tensor:
    """qkv (b, (h + 2 kv) * d); cos, sin (max_len, d); positions, slots (b,); layer_k, layer_v (slots, kv, max_len,
    d) -> rotated queries (b, h, d); rotated keys and the values written into the slots at the positions."""
    b = qkv.shape[0]
    n_kv_heads, d = layer_k.shape[1], layer_k.shape[3]
    q = qkv.new_empty(b, n_heads, d)
    _rope_write[(b, n_heads + n_kv_heads)](qkv, cos, sin, positions, slots, q, layer_k, layer_v, n_heads,
                                           n_kv_heads, layer_k.stride(0), layer_k.stride(1), HALF=d // 2)
    return q


@triton.jit
def _attend_part(q_ptr, k_ptr, v_ptr, slots_ptr, positions_ptr, acc_ptr, max_ptr, sum_ptr, n_heads, groups,
                 slot_stride, head_stride, scale, SPLITS: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
                 BLOCK: tl.constexpr):
    row, kv, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    position, slot = tl.load(positions_ptr + row), tl.load(slots_ptr + row)
    per_part = tl.cdiv(tl.cdiv(position + 1, SPLITS), BLOCK) * BLOCK  # keys 0..position, in SPLITS parts
    start = part * per_part
    end = tl.minimum(start + per_part, position + 1)
    g, dims = tl.arange(0, GROUP), tl.arange(0, D)
    head = kv * groups + g  # the query heads that share this KV head
    in_group = g < groups
    q = tl.load(q_ptr + (row * n_heads + head)[:, None] * D + dims[None, :], mask=in_group[:, None],
                other=0.0).to(tl.float32) * scale  # (GROUP, D)
    best = tl.full([GROUP], float("-inf"), tl.float32)
    total = tl.zeros([GROUP], tl.float32)
    acc = tl.zeros([GROUP, D], tl.float32)
    base = slot * slot_stride + kv * head_stride
    for first in range(start, end, BLOCK):
        keys = first + tl.arange(0, BLOCK)
        present = keys < end
        at = base + keys[:, None] * D + dims[None, :]
        k = tl.load(k_ptr + at, mask=present[:, None], other=0.0).to(tl.float32)  # (BLOCK, D)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # (GROUP, BLOCK)
        scores = tl.where(present[None, :], scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        weights = tl.exp(scores - new_best[:, None])
        shrink = tl.exp(best - new_best)
        v = tl.load(v_ptr + at, mask=present[:, None], other=0.0).to(tl.float32)
        acc = acc * shrink[:, None] + tl.sum(weights[:, :, None] * v[None, :, :], axis=1)
        total = total * shrink + tl.sum(weights, axis=1)
        best = new_best
    out = (row * n_heads + head) * SPLITS + part  # (GROUP,): this part's entry for each query head
    tl.store(acc_ptr + out[:, None] * D + dims[None, :], acc, mask=in_group[:, None])
    tl.store(max_ptr + out, best, mask=in_group)
    tl.store(sum_ptr + out, total, mask=in_group)


@triton.jit
def _attend_merge(acc_ptr, max_ptr, sum_ptr, out_ptr, SPLITS: tl.constexpr, D: tl.constexpr):
    row_head = tl.program_id(0)
    parts, dims = tl.arange(0, SPLITS), tl.arange(0, D)
    best = tl.load(max_ptr + row_head * SPLITS + parts)  # (SPLITS,): -inf for a part with no keys
    weight = tl.exp(best - tl.max(best, axis=0))
    total = tl.sum(tl.load(sum_ptr + row_head * SPLITS + parts) * weight, axis=0)
    acc = tl.load(acc_ptr + (row_head * SPLITS + parts)[:, None] * D + dims[None, :])  # (SPLITS, D)
    out = tl.sum(acc * weight[:, None], axis=0) / total
    tl.store(out_ptr + row_head * D + dims, out.to(out_ptr.dtype.element_ty))


def attend(q: torch.Tensor, layer_k: torch.Tensor, layer_v: torch.Tensor, slots: torch.Tensor,
           positions: torch.Tensor) -> torch.Tensor:
    """q (b, h, d); layer_k, layer_v (slots, kv, max_len, d) -> softmax(q k^T / sqrt(d)) v over each row's keys
    0..positions[row] of its slot, (b, h, d) in q's dtype."""
    b, n_heads, d = q.shape
    n_kv_heads = layer_k.shape[1]
    groups = n_heads // n_kv_heads
    acc = torch.empty(b, n_heads, SPLITS, d, dtype=torch.float32, device=q.device)
    best = torch.empty(b, n_heads, SPLITS, dtype=torch.float32, device=q.device)
    total = torch.empty_like(best)
    _attend_part[(b, n_kv_heads, SPLITS)](q, layer_k, layer_v, slots, positions, acc, best, total, n_heads, groups,
                                          layer_k.stride(0), layer_k.stride(1), d ** -0.5, SPLITS=SPLITS,
                                          GROUP=triton.next_power_of_2(groups), D=d, BLOCK=BLOCK_KEYS)
    out = torch.empty_like(q)
    _attend_merge[(b * n_heads,)](acc, best, total, out, SPLITS=SPLITS, D=d)
    return out


@triton.jit
def _silu_mul(gate_up_ptr, out_ptr, width, BLOCK: tl.constexpr):
    row, block = tl.program_id(0), tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    inside = cols < width
    gate = tl.load(gate_up_ptr + row * 2 * width + cols, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * width + width + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * width + cols, (gate / (1.0 + tl.exp(-gate)) * up).to(out_ptr.dtype.element_ty),
             mask=inside)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate|up (b, 2 F) -> SiLU(gate) * up (b, F)."""
    b, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(b, width)
    block = 1024
    _silu_mul[(b, triton.cdiv(width, block))](gate_up, out, width, BLOCK=block)
    return out


@triton.jit
def _int8_rows(x_ptr, q_ptr, scale_ptr, y_ptr, m, n, k, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):
    outputs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, ROWS)
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    for first in range(0, k, BLOCK_K):
        ks = first + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * k + ks[None, :], mask=(rows[:, None] < m) & (ks[None, :] < k),
                    other=0.0).to(tl.float32)  # (ROWS, BLOCK_K)
        w = tl.load(q_ptr + outputs[:, None] * k + ks[None, :], mask=(outputs[:, None] < n) & (ks[None, :] < k),
                    other=0).to(tl.float32)  # (BLOCK_N, BLOCK_K): the int8 weights, widened in registers only
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    scale = tl.load(scale_ptr + outputs, mask=outputs < n, other=0.0)
    tl.store(y_ptr + rows[:, None] * n + outputs[None, :], (acc * scale[None, :]).to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < m) & (outputs[None, :] < n))


def int8_rows(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """x (M, K), M <= 8 (a decode step's rows) @ int8 q (N, K).T times the row scales (N,) -> (M, N) in out_dtype:
    each weight read once for all rows and widened in registers (torch's `_weight_int8pack_mm` keeps a few of
    a GPU's threads busy at one row), the sums in fp32."""
    m, k = x.shape
    n = q.shape[0]
    y = torch.empty(m, n, dtype=out_dtype, device=x.device)
    block_n = 16 if m > 2 else 32
    _int8_rows[(triton.cdiv(n, block_n),)](x.contiguous(), q, scale, y, m, n, k, ROWS=triton.next_power_of_2(m),
                                           BLOCK_N=block_n, BLOCK_K=128)
    return y
