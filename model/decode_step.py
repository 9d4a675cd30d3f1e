"""The fast decode step: every layer of one decode step in one C++ op (csrc/decode_step.cpp).

Run op by op, a layer of a small model's decode step is about 25 small ATen ops that together take
as long as reading the layer's weights. `decode_layers` hands the whole stack of layers to one op
instead, which computes the same maths (Block.decode in model/llama.py, the reference it is tested
against) in plain loops between the decode kernel's matrix products. Llama.decode takes it on the
CPU when the kernel is built (LLAMA_KERNELS=0 turns it off), for weight matrices the kernel streams
(all bf16, or all int8 with group scales) and activations in fp32 or bf16; otherwise the reference.
"""

from __future__ import annotations

import torch

from .kernels import kernels
from .kv_cache import KVCache
from .linear import MAX_KERNEL_ROWS

# Each layer's matrices in the order the op takes them (csrc/decode_step.cpp's Matrix): q|k|v and
# w1|w3 side by side, so each group is one call of the decode kernel.
LAYER_MATRICES = ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                  "feed_forward.w1", "feed_forward.w3", "feed_forward.w2")
KERNEL_WEIGHTS = (torch.bfloat16, torch.int8)  # the kinds of weight matrix the op streams


def layer_weights(model, dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor],
                                                       list[torch.Tensor]] | None:
    """The op's norms (in `dtype`, the activations'), weights and scales for `model`, or None where its
    matrices are not all of one kind the op takes. Gathered on each call (a few hundred attribute
    reads, ~0.1 ms), so weights swapped after loading are always the ones used."""
    norms, weights, scales = [], [], []
    for block in model.layers:
        norms += [norm.weight.to(dtype) for norm in (block.attention_norm, block.ffn_norm)]
        for name in LAYER_MATRICES:
            linear = block.get_submodule(name)
            weights.append(linear.weight)
            scales.append(linear.scale)
    kind = weights[0].dtype
    if kind not in KERNEL_WEIGHTS or any(w.dtype != kind for w in weights):
        return None
    return norms, weights, [s.float() for s in scales] if kind == torch.int8 else []


def decode_layers(model, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, caches: list[KVCache],
                  ops=None) -> torch.Tensor | None:
    """x (b, dim) through every layer of `model` in one op, sequence i's key and value written to
    caches[i] at its length; cos, sin (b, head_dim) in x's dtype. None where the op does not apply
    (no kernel, not on the CPU, weights it does not take, more sequences than it takes): the caller
    runs the reference. `ops`: the build to use (default: the one linears() uses)."""
    ops = ops or kernels()
    if (ops is None or x.device.type != "cpu" or not 1 <= x.shape[0] <= MAX_KERNEL_ROWS
            or x.dtype not in (torch.float32, torch.bfloat16) or torch.compiler.is_compiling()):
        return None
    found = layer_weights(model, x.dtype)
    if found is None:
        return None
    for cache in caches:
        if cache.length >= cache.max_len:
            raise ValueError(f"KV cache holds {cache.max_len} positions; asked to write up to {cache.length + 1}")
    norms, weights, scales = found
    config = model.config
    return ops.decode_layers(x, norms, weights, scales, cos, sin, [c.k for c in caches], [c.v for c in caches],
                             [c.length for c in caches], config.n_heads, config.norm_eps)
