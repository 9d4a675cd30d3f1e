"""int8 and int4 matrices repacked once, at load, for torch's weight-only matmul ops, which then multiply them
on every step (on a GPU, widening a matrix to bf16 for each product costs several passes over it).

- int4 (model/quantize.py: q * scale + offset per block of 32, fp16) -> tinygemm, `_weight_int4pack_mm`: the
  4-bit weights in its tile layout and per block a (scale, zero) pair, `scales_and_zeros` (K // 32, N, 2) in the
  activations' dtype (bf16 on a GPU); it computes (q - 8) * scale + zero, so zero = offset + 8 * scale (Q4_0's
  blocks, offset = -8 * scale: zero 0). Rounding the fp16 scales and zeros to bf16 moves a weight by up to
  2^-8 (8 |scale| + |zero|), about its own bf16 rounding for a block's extremes.
- int8 (one fp32 scale per group of 64 weights of a row, a GGUF's Q8_0 32) -> `_weight_int8pack_mm`, which takes
  one scale per row (N,): each row is quantized again to one scale, max |w| / 127, rounding every weight a
  second time by up to half of it (exact only where a row's groups share a scale).

The layouts each op takes (torch >= 2.5), as torch's tests and gpt-fast pack them:
- CUDA: `_convert_weight_to_int4pack(uint8 (N, K // 2), inner_k_tiles)`, byte j of a row holding k = 2j in its
  high nibble and 2j + 1 in its low one (our bytes hold a block's k and k + 16: unpacked first) -> int32
  (N / 8, K / (16 inner_k_tiles), 32, inner_k_tiles / 2); inner_k_tiles 8, 4 or 2 dividing K / 16; N a multiple
  of 8; activations bf16. `_weight_int8pack_mm` widens x to fp32 and sums in fp32; built for CUDA in recent torch.
- CPU: `_convert_weight_to_int4pack_for_cpu(int32 (N, K) in 0..15, _)` -> uint8 (N, K // 2) in its own tiles,
  N a multiple of 16; activations and scales_and_zeros in one dtype (fp32, fp16 or bf16), as for the int8 op.
  The same maths, so tests repack on the CPU (repack_model packs for the device the weights are on).

A packed Linear keeps its tensors in `weight` and `scale` (`offset` None), so state_dict, `.to()` and the
decode-step code that reads them need nothing new; `scale`'s shape tells it: (N,) for int8 rows,
(K // 32, N, 2) for int4 (quantized but not packed: (N, K // group)). A tied output head gets its own packed
copy: the embedding keeps its blocks, of which lookups widen only the rows they take.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from .quantize import INT4_GROUP, Q4_0_ZERO, dequantize_int8, int4_offset, unpack_int4

aten = torch.ops.aten
log = logging.getLogger(__name__)
INNER_K_TILES = (8, 4, 2)  # tinygemm's tiles of 16 k packed side by side; the widest that divides K is taken
ROWS_MULTIPLE = {"cuda": 8, "cpu": 16}  # N of an int4 matrix the device's tile layout takes
INT8_MM_ROWS = 16  # up to this many rows of x go to `_weight_int8pack_mm`; more (prefill) to F.linear, see below


def is_packed(scale: torch.Tensor | None) -> bool:
    """Whether a Linear whose `scale` this is holds a packed matrix (int8 rows or tinygemm's int4)."""
    return scale is not None and scale.dim() != 2


def packed_kinds(device: torch.device) -> tuple[str, ...]:
    """What repack_model packs on `device`: the kinds whose ops it has. tinygemm's int4 needs compute
    capability 8.0 (Ampere) or later; `_weight_int8pack_mm` has a CUDA kernel only in recent torch."""
    if device.type == "cpu":
        return ("int4", "int8")
    if device.type != "cuda":
        return ()
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    int4 = torch.cuda.get_device_capability(device) >= (8, 0) and has("aten::_weight_int4pack_mm", "CUDA")
    return ("int4",) * int4 + ("int8",) * has("aten::_weight_int8pack_mm", "CUDA")


def inner_k_tiles(k: int) -> int:
    return next(t for t in INNER_K_TILES if k % (16 * t) == 0)


def tinygemm_bytes(q: torch.Tensor) -> torch.Tensor:
    """q (N, K) in 0..15, in order -> uint8 (N, K // 2) as the CUDA op reads it: even k high, odd k low."""
    even, odd = q.view(q.shape[0], -1, 2).unbind(-1)  # (N, K // 2) each
    return (even << 4 | odd).to(torch.uint8).contiguous()


@torch.no_grad()
def repack_int4(packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """Our int4 (packed uint8 (N, K // 2), scale and offset (N, K // 32)) -> (tinygemm's weight for the device
    it is on, scales_and_zeros (K // 32, N, 2) in `dtype`, the activations' dtype)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    q = unpack_int4(packed).view(n, k)  # uint8 (N, K) in 0..15
    if packed.device.type == "cuda":
        weight = aten._convert_weight_to_int4pack(tinygemm_bytes(q), inner_k_tiles(k))
    else:  # the CPU's op takes the values one per int32 and packs them itself (inner_k_tiles unused)
        weight = aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    zero = int4_offset(scale, offset).float() + Q4_0_ZERO * scale.float()  # (N, K // 32): the weight at q = 8
    return weight, torch.stack([scale.float(), zero], dim=-1).transpose(0, 1).to(dtype).contiguous()


@torch.no_grad()
def repack_int8(q: torch.Tensor, scale: torch.Tensor, rows: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 q (N, K) with group scales (N, K // group) -> (int8 (N, K), fp32 scale (N,)): each row quantized
    again to one scale, max |w| / 127, `rows` rows at a time (no fp32 copy of a whole large matrix). That is
    the scale of a row's group that reaches 127 (all of them do, as quantize_int8 makes them), exactly: its
    weights keep their values, and a row whose groups share one scale is the same as before."""
    out, row_scale = torch.empty_like(q), torch.empty(q.shape[0], dtype=torch.float32, device=q.device)
    for part, part_scale, part_out, s in zip(q.split(rows), scale.split(rows), out.split(rows), row_scale.split(rows)):
        group_max = part.view(part.shape[0], scale.shape[1], -1).float().abs().amax(dim=-1)  # (rows, groups)
        s.copy_((part_scale.float() * (group_max / 127.0)).amax(dim=1).clamp(min=1e-30))
        w = dequantize_int8(part, part_scale)  # (rows, K) fp32, each weight as stored
        part_out.copy_(torch.round(w / s[:, None]).clamp_(-127, 127))
    return out, row_scale


@torch.no_grad()
def repack_linear(module: nn.Linear, dtype: torch.dtype = torch.bfloat16, kinds=("int4", "int8")) -> bool:
    """Repack one quantized Linear in place for the device its weight is on, its int4 scales in `dtype`;
    False where it is not quantized, already packed, of a kind not in `kinds`, or of a shape the op refuses."""
    weight, scale, offset = module.weight, module.scale, module.offset
    if scale is None or is_packed(scale):
        return False
    if weight.dtype == torch.uint8 and "int4" in kinds and weight.shape[0] % ROWS_MULTIPLE[weight.device.type] == 0:
        weight, scale = repack_int4(weight, scale, offset, dtype)
    elif weight.dtype == torch.int8 and "int8" in kinds:
        weight, scale = repack_int8(weight, scale)
    else:
        return False
    module.weight = nn.Parameter(weight, requires_grad=False)  # a tied head's own: the embedding keeps its blocks
    module.scale, module.offset = scale, None
    return True


def repack_model(model: nn.Module) -> int:
    """Repack every quantized Linear of `model` (nn.Linear subclasses: not the embedding) for the device its
    weights are on, as far as the device's ops go (packed_kinds); the number repacked. int4 scales in bf16 on
    a GPU (tinygemm's only dtype), in the model's compute dtype on the CPU."""
    device = next(model.parameters()).device
    dtype = torch.bfloat16 if device.type == "cuda" else getattr(model, "compute_dtype", torch.float32)
    kinds = packed_kinds(device)
    return sum(repack_linear(m, dtype, kinds) for m in model.modules() if isinstance(m, nn.Linear))


DECODE_ROWS = 8  # rows of x (a decode step's) that go to the Triton int8 kernel on CUDA


@functools.cache
def triton_int8():
    """model/triton_kernels.py's int8_rows where Triton is installed and it runs here, else None (torch's op is
    used). Tried once on a small product: a kernel Triton cannot build for this GPU leaves torch's op in use."""
    try:
        from .triton_kernels import int8_rows
        x = torch.ones(1, 32, device="cuda")
        int8_rows(x, torch.ones(16, 32, dtype=torch.int8, device="cuda"), torch.ones(16, device="cuda"), x.dtype)
    except Exception as e:  # noqa: BLE001  (ImportError, or a compile error of this Triton on this GPU)
        log.warning("int8 decode products through torch's op: the Triton kernel is not available (%s)", e)
        return None
    return int8_rows


def packed_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, fp32_out: bool = False) -> torch.Tensor:
    """x (..., K) @ a packed matrix (N, K).T -> (..., N) in x's dtype (fp32 with fp32_out), any number of rows.

    int8 rows: up to INT8_MM_ROWS rows through `_weight_int8pack_mm` (it reads the int8 weights once; on a GPU a
    warp per output sum, in fp32, so fp32_out costs nothing), more as gpt-fast does, F.linear of the int8 rows
    widened to x's dtype (exactly), times the row scales: a prefill's many rows use the tensor cores."""
    k, n = x.shape[-1], weight.shape[0] if scale.dim() == 1 else scale.shape[1]
    flat = x.reshape(-1, k)  # (M, K)
    if not flat.shape[0]:
        y = flat.new_empty(0, n)
    elif scale.dim() == 1:  # int8 rows
        flat = (flat.float() if fp32_out else flat).contiguous()
        s = scale if weight.device.type == "cuda" else scale.to(flat.dtype)  # the CPU's op takes x's dtype
        if flat.shape[0] <= DECODE_ROWS and weight.device.type == "cuda" and (rows := triton_int8()) is not None:
            y = rows(flat, weight, s, flat.dtype)
        elif flat.shape[0] <= INT8_MM_ROWS:
            y = aten._weight_int8pack_mm(flat, weight, s)
        else:
            y = F.linear(flat, weight.to(flat.dtype)) * s.to(flat.dtype)
    else:  # int4: tinygemm, x in its scales' dtype, the sums in fp32, y rounded to that dtype
        op = aten._weight_int4pack_mm if weight.device.type == "cuda" else aten._weight_int4pack_mm_for_cpu
        y = op(flat.to(scale.dtype).contiguous(), weight, INT4_GROUP, scale.contiguous())  # a fused one's part: a view
    return y.to(torch.float32 if fp32_out else x.dtype).view(*x.shape[:-1], n)
