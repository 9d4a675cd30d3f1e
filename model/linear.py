"""Linear layers whose weights may be stored as bf16, int8 or int4, with activations in fp32 or bf16.

Prefill (many rows) goes to `F.linear`; a quantized matrix is dequantized a block of rows at a time
into the activations' dtype (`widen`: the kernel's C++ loops, or model/quantize.py's), so it never
exists whole in that dtype. Matrices in llama.cpp's blocks (a GGUF's K-quants) are instead multiplied in
their integers by x rounded to int8 (the kernel's prefill_blocks), where the build has it.
Decode (one row per sequence, up to MAX_KERNEL_ROWS) is bound by memory bandwidth: the decode kernel
(model/kernels.py) streams the 32-, 16-, 8- or 4-bit weights once for all rows, several matrices of the same
input in one call (q|k|v, gate|up).
A matrix repacked for torch's weight-only matmul ops (model/packed.py: a GPU's, at load) goes to them, whatever
the rows, and is never widened.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .blocks import dequantize_blocks, is_blocks
from .cpu import has_amx
from .kernels import kernels
from .packed import is_packed, packed_linear
from .quantize import can_quantize_int4, dequantize, quantize_int4, quantize_int8

MAX_KERNEL_ROWS = 8  # rows of x (tokens in one decode step) the decode kernel takes at once
# Up to this many rows never go to F.linear's matrix product, whose sums for a row change with the rows beside
# it (and with fp32 on 5 to 11 rows, with the number of threads, on Zen 5): the kernel, MAX_KERNEL_ROWS at a time,
# or F.linear a row at a time. A prompt's last prefill chunk can be this short, and decode steps always are.
FEW_ROWS = 2 * MAX_KERNEL_ROWS
# What the kernel streams (uint8: int4; "blocks": llama.cpp's, model/blocks.py)
KERNEL_WEIGHTS = (torch.bfloat16, torch.float32, torch.int8, torch.uint8, "blocks")
DEQUANTIZE_BLOCK_BYTES = 8 << 20  # a stored matrix is widened for F.linear this many bytes of rows at a time
QUANTIZE = ("int8", "int4")  # what quantize_model and load_checkpoint(quantize=...) take
# How the output head is stored under each: int4 keeps it int8. On the default model an int4 head alone put
# perplexity 5.5% above bf16's, an int8 one 0.1% (docs/benchmarks.md); llama.cpp's Q4 files keep it at 6 bits too.
OUTPUT_HEAD = {"int8": "int8", "int4": "int8"}


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
           offset: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) @ weight (N, K).T, weight in any dtype: int8 with group scales (N, K // group), or
    int4 packed (N, K // 2) with block scales and offsets (N, K // 32) (model/quantize.py)."""
    return linears(x, [weight], [scale], [offset])


def linears(x: torch.Tensor, weights: list[torch.Tensor], scales: list[torch.Tensor | None],
            offsets: list[torch.Tensor | None] | None = None, fp32_out: bool = False) -> torch.Tensor:
    """x (..., K) through several weight matrices (N_i, K) at once: outputs side by side, (..., sum N_i),
    in x's dtype, or in fp32 with fp32_out (the output head: the sums are fp32, logits keep them).

    Up to MAX_KERNEL_ROWS rows of x on the CPU go to the decode kernel, which reads each weight once
    for all of them (up to FEW_ROWS, in groups of as many); more rows (prefill) go to F.linear. Each of
    a few rows' result is the same whatever rows come with it (the kernel's loops are written so; where the
    kernel does not apply, such rows go to F.linear one at a time), so a sequence decodes the same tokens
    alone or in any batch. Packed matrices (model/packed.py) go to their ops, any rows.
    """
    offsets = offsets or [None] * len(weights)
    kinds, k_dim = {"blocks" if is_blocks(w) else w.dtype for w in weights}, x.shape[-1]
    rows = x.numel() // k_dim if k_dim else 0
    few = 1 <= rows <= FEW_ROWS and x.device.type == "cpu" and not any(map(is_packed, scales))
    if few and len(kinds) > 1:  # a kernel call per kind
        y = torch.cat([linears(x, [w], [s], [o], fp32_out) for w, s, o in zip(weights, scales, offsets)], dim=-1)
        return y
    if few and rows > MAX_KERNEL_ROWS:
        flat = x.reshape(rows, k_dim)
        y = torch.cat([linears(flat[i:i + MAX_KERNEL_ROWS], weights, scales, offsets, fp32_out)
                       for i in range(0, rows, MAX_KERNEL_ROWS)])
        return y.view(*x.shape[:-1], -1)
    kind = next(iter(kinds)) if len(kinds) == 1 else None
    if few and kind in KERNEL_WEIGHTS and x.dtype in (torch.float32, torch.bfloat16):  # (one kind, from here on)
        ops = kernels()
        if ops:  # y comes back in x's dtype, or fp32
            flat = x.reshape(rows, k_dim).contiguous()  # (M, K)
            if kind == "blocks":  # llama.cpp's blocks, of one format or several
                y = ops.matvec_blocks(flat, weights, fp32_out)
            elif kind == torch.bfloat16:
                y = ops.matvec_bf16(flat, weights, fp32_out)  # (M, sum N_i)
            elif kind == torch.float32:
                y = ops.matvec_f32(flat, weights, fp32_out)
            elif kind == torch.int8:
                y = ops.matvec_int8(flat, weights, [s.float() for s in scales], fp32_out)
            else:
                y = ops.matvec_int4(flat, weights, [s.half() for s in scales],
                                    [None if o is None else o.half() for o in offsets], fp32_out)
            return y.view(*x.shape[:-1], -1)
    if few and rows > 1:  # F.linear's sums for a row change with the number of rows (M = 1 is a vector product)
        flat = x.reshape(rows, k_dim)
        y = torch.cat([linears(flat[i:i + 1], weights, scales, offsets, fp32_out) for i in range(rows)])
        return y.view(*x.shape[:-1], -1)
    if kinds == {"blocks"} and (ops := prefill_ops(x)):  # llama.cpp's blocks, all of them in one call
        y = ops.prefill_blocks(x.reshape(rows, k_dim).contiguous(), weights, fp32_out)
        return y.view(*x.shape[:-1], -1)
    outputs = [packed_linear(x, w, s, fp32_out) if is_packed(s) else blockwise_linear(x, w, s, o)
               for w, s, o in zip(weights, scales, offsets)]
    y = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)
    return y.float() if fp32_out else y


def blockwise_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
                     offset: torch.Tensor | None) -> torch.Tensor:
    """F.linear of x with any weight. One stored in another dtype (quantized, or bf16 weights under fp32
    activations on CPUs without bf16 arithmetic) is widened into x's dtype a block of rows at a time."""
    if weight.dtype == x.dtype:
        return F.linear(x, weight)
    if is_blocks(weight) and (ops := prefill_ops(x)):  # llama.cpp's blocks times x rounded to int8, never widened
        return ops.prefill_blocks(x.reshape(-1, x.shape[-1]).contiguous(), [weight]).view(*x.shape[:-1], -1)
    n, k = weight.shape[0], x.shape[-1]  # blocks: (N, K / block, bytes)
    block = max(1, DEQUANTIZE_BLOCK_BYTES // (k * x.element_size()))
    if block >= n:
        return F.linear(x, widen(weight, scale, offset, x.dtype))
    y = x.new_empty(*x.shape[:-1], n)
    for i in range(0, n, block):
        rows = slice(i, i + block)
        part = widen(weight[rows], None if scale is None else scale[rows],
                     None if offset is None else offset[rows], x.dtype)
        y[..., rows] = F.linear(x, part)  # (..., block)
    return y


def prefill_ops(x: torch.Tensor):
    """The kernel's ops where a prefill multiplies llama.cpp's blocks in their integers (csrc/prefill_blocks.cpp:
    built for AVX2 and AVX-512); None on other builds, off the CPU, and where oneDNN's AMX bf16 tiles are faster
    (blocks widened for F.linear there)."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16) or has_amx():
        return None
    ops = kernels()
    return ops if ops and hasattr(ops, "prefill_blocks") else None


def widen(weight: torch.Tensor, scale: torch.Tensor | None, offset: torch.Tensor | None,
          dtype: torch.dtype) -> torch.Tensor:
    """A stored matrix as `dtype`: int8 and int4 through the kernel's one-pass loops where it is built
    (csrc/dequantize.cpp), else model/quantize.py's dequantize, which those loops are tested against."""
    if is_blocks(weight):
        return dequantize_blocks(weight, dtype)
    ops = kernels() if scale is not None and weight.device.type == "cpu" else None
    if ops and dtype in (torch.float32, torch.bfloat16) and weight.is_contiguous():
        if weight.dtype == torch.uint8:
            return ops.dequantize_int4(weight, scale.half().contiguous(),
                                       None if offset is None else offset.half().contiguous(), dtype)
        if weight.dtype == torch.int8:
            return ops.dequantize_int8(weight, scale.float().contiguous(), dtype)
    return dequantize(weight, scale, offset, dtype)


# Rows of a packed int4 matrix a fused one may be cut at: the tile rows of the device's layout (model/packed.py;
# the CPU's layout was seen to separate at multiples of 32 rows).
FUSE_ROWS = {"cuda": 8, "cpu": 64}


def out_features(layer: Linear) -> int:
    """N of a Linear in any storage: packed int4 keeps it in its scales' shape (K // 32, N, 2)."""
    return layer.scale.shape[1] if layer.scale is not None and layer.scale.dim() == 3 else layer.weight.shape[0]


@torch.no_grad()
def fuse(*layers: Linear) -> Linear | None:
    """One Linear whose output rows are those of `layers` (the same input; q|k|v, gate|up), in order, so one
    product replaces several; the layers' own weights, scales and offsets become views of its rows, so the
    weights stay in memory once. None where the layers are stored in different kinds, or a packed layout
    cannot be cut at their boundaries. The fused layer is not a submodule: state_dict is as before."""
    first = layers[0]
    kind = lambda layer: (layer.weight.dtype, layer.weight.shape[1:], layer.offset is None,  # noqa: E731
                          None if layer.scale is None else (layer.scale.dtype, layer.scale.dim()))
    if any(kind(layer) != kind(first) for layer in layers):
        return None
    sizes = [out_features(layer) for layer in layers]
    int4_tiles = first.scale is not None and first.scale.dim() == 3
    if int4_tiles and any(n % FUSE_ROWS.get(first.weight.device.type, 64) for n in sizes):
        return None
    with torch.device("meta"):
        fused = Linear(first.in_features, sum(sizes))
    fused.weight = nn.Parameter(torch.cat([layer.weight for layer in layers]), requires_grad=False)
    if first.scale is not None:
        fused.scale = torch.cat([layer.scale for layer in layers], dim=1 if int4_tiles else 0)
    if first.offset is not None:
        fused.offset = torch.cat([layer.offset for layer in layers])
    per_row = fused.weight.shape[0] / fused.out_features  # leading index a row takes (tinygemm's CUDA tiles: 1/8)
    start = 0
    for layer, n in zip(layers, sizes):
        rows = slice(int(start * per_row), int((start + n) * per_row))
        layer.weight = nn.Parameter(fused.weight[rows], requires_grad=False)
        if layer.scale is not None:
            layer.scale = fused.scale[:, start:start + n] if int4_tiles else fused.scale[start:start + n]
        if layer.offset is not None:
            layer.offset = fused.offset[start:start + n]
        start += n
    return fused


def project(x: torch.Tensor, *layers: Linear) -> torch.Tensor:
    """x through several Linear layers of the same input size, outputs side by side (q|k|v, gate|up)."""
    return linears(x, [layer.weight for layer in layers], [layer.scale for layer in layers],
                   [layer.offset for layer in layers])


class Linear(nn.Linear):
    """nn.Linear without bias whose weight may be bf16, int8 with a `scale` per group of a row, or int4
    (uint8 (N, K // 2), two weights a byte) with a `scale` and an `offset` per block of 32.

    `scale` and `offset` are buffers (None unless quantized; `offset` None for int8 and for Q4_0's
    symmetric int4 blocks), so `.to()` moves them and `state_dict()` holds them
    (`layers.0.attention.wq.scale`) beside the weight. Repacked for torch's weight-only ops (model/packed.py),
    `weight` and `scale` hold the ops' layouts, told apart by `scale`'s shape.
    """

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)
        self.register_buffer("scale", None)
        self.register_buffer("offset", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self)


class Embedding(nn.Embedding):
    """nn.Embedding whose weight may be int8 or int4 with scales (and offsets) per group of a row (a
    GGUF's Q8_0 or Q4_x table): only the rows looked up are dequantized, so the table is never held
    twice. `scale` and `offset` are buffers, as Linear's (a tied output head shares them)."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__(num_embeddings, embedding_dim)
        self.register_buffer("scale", None)
        self.register_buffer("offset", None)

    def reset_parameters(self) -> None:
        # On the meta device there is nothing to fill, and torch's normal_ there imports torch._dynamo: 1.1 s
        # and 145 MB of every process that loads a checkpoint (Zen 4).
        if self.weight.device.type != "meta":
            super().reset_parameters()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if is_blocks(self.weight):
            ids = tokens.reshape(-1)
            return dequantize_blocks(self.weight[ids]).view(*tokens.shape, -1)  # (..., dim) float32
        if self.scale is None:
            return super().forward(tokens)
        ids = tokens.reshape(-1)
        rows = dequantize(self.weight[ids], self.scale[ids], None if self.offset is None else self.offset[ids])
        return rows.view(*tokens.shape, -1)  # (..., dim) float32


@torch.no_grad()
def quantize_linear(module: Linear, method: str, row_scales: bool = False) -> None:
    """Store one Linear's weight as `method` ("int8" or "int4"; int4 only where K is whole blocks); row_scales:
    int8 with one scale a row (what a GPU's packed int8 op takes: model/packed.py), not one per group."""
    if method == "int8":
        q, module.scale = quantize_int8(module.weight, group=module.weight.shape[1] if row_scales else None)
    elif can_quantize_int4(module.weight):
        q, module.scale, module.offset = quantize_int4(module.weight)
    else:
        return
    module.weight = nn.Parameter(q, requires_grad=False)


@torch.no_grad()
def quantize_model(model: nn.Module, method: str = "int8", row_scales: bool = False) -> None:
    """Store every float Linear of `model` as `method` (a tied output head gets its own copy)."""
    if method not in QUANTIZE:
        raise ValueError(f"quantize={method!r}: expected one of {', '.join(QUANTIZE)}")
    for module in model.modules():
        if isinstance(module, Linear) and module.weight.is_floating_point():
            quantize_linear(module, method, row_scales)
