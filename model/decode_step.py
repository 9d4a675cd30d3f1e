"""The fast decode step: every layer of one decode step in one C++ op (csrc/decode_step.cpp).

Run op by op, a layer of a small model's decode step is about 25 small ATen ops that together take
as long as reading the layer's weights. `decode_layers` hands the whole stack of layers to one op
instead, which computes the same maths (Block.decode in model/llama.py, the reference it is tested
against) in plain loops between the decode kernel's matrix products. Llama.decode takes it on the
CPU when the kernel is on and built (LLAMA_KERNELS=off: model.kernels.configure), for weight matrices the kernel streams
and activations in fp32 or bf16; otherwise the reference. The matrices are all bf16, all fp32, or quantized:
int8 with group scales and int4 with block scales and offsets (model/quantize.py), mixed freely
between the op's kernel calls (an int4 model keeps as int8 a matrix whose K is not whole blocks of 32)
but of one kind within q|k|v and within w1|w3. The KV caches are in the activations' dtype or in q8 blocks
(model/kv_cache.py), one kind a call. With several threads a step runs as one parallel region, its threads
meeting at barriers between the products (csrc/team.h), rather than opening a region for each of its ~150 products.
"""

from __future__ import annotations

import itertools
import operator
import weakref

import torch

from .kernels import kernels
from .kv_cache import KVCache
from .blocks import is_blocks
from .linear import MAX_KERNEL_ROWS
from .packed import is_packed
from .rope import Rope

# Each layer's matrices in the order the op takes them (csrc/decode_step.cpp's Matrix): q|k|v and
# w1|w3 side by side, so each group is one call of the decode kernel.
LAYER_MATRICES = ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                  "feed_forward.w1", "feed_forward.w3", "feed_forward.w2")
QUANTIZED_WEIGHTS = (torch.int8, torch.uint8)  # int8, and int4 two a byte: the quantized kinds the op streams


class LayerWeights:
    """The op's norms, weights, scales and offsets of one model: gathered once (a few hundred module attribute
    reads, about a millisecond), then checked on each step against the modules' own tensors by
    identity (plain dict reads, tens of microseconds), so weights swapped after loading are the ones used."""

    def __init__(self, model):
        self.norms = [norm for block in model.layers for norm in (block.attention_norm, block.ffn_norm)]
        self.linears = [block.get_submodule(name) for block in model.layers for name in LAYER_MATRICES]
        # where each module keeps its tensors, read on every step with map() (the loops run in C)
        self.places = ([(n._parameters, "weight") for n in self.norms] + [(m._parameters, "weight") for m in self.linears]
                       + [(m._buffers, "scale") for m in self.linears] + [(m._buffers, "offset") for m in self.linears])
        self.found = None  # (the modules' tensors, the op's norms, weights, scales and offsets), per activation dtype
        self.dtype = None

    def current(self, dtype: torch.dtype) -> tuple[list, list, list, list] | None:
        """(norms in `dtype`, weights, scales, offsets) for the op, or None where it does not take the
        matrices' kinds."""
        tensors = list(itertools.starmap(dict.get, self.places))
        if self.found is None or self.dtype != dtype or any(map(operator.is_not, tensors, self.found[0])):
            self.found, self.dtype = (tensors, self.gather(dtype)), dtype
        return self.found[1]

    def gather(self, dtype: torch.dtype):
        """The op's arguments, scales and offsets in the dtypes the kernel reads (fp32 for int8, fp16 for
        int4), converted here once; None where the matrices are neither all bf16, all fp32 nor all quantized (of any
        kinds, side by side too), or repacked for torch's ops (model/packed.py)."""
        weights = [m.weight for m in self.linears]
        if any(is_packed(m.scale) for m in self.linears):
            return None
        if all(w.dtype == torch.bfloat16 for w in weights) or all(w.dtype == torch.float32 for w in weights):
            return self.norms_in(dtype), weights, [], []
        if not all(w.dtype in QUANTIZED_WEIGHTS for w in weights):
            return None
        # llama.cpp's blocks (any of their formats) beside int8 or int4 in one call too: the op takes each kind's run
        kinds = ["blocks" if is_blocks(w) else w.dtype for w in weights]
        no_scale = torch.empty(0)  # blocks carry their scales inside them
        scales = [no_scale if kind == "blocks" else m.scale.half() if kind == torch.uint8 else m.scale.float()
                  for m, kind in zip(self.linears, kinds)]
        offsets = [m.offset.half() if kind == torch.uint8 and m.offset is not None else None
                   for m, kind in zip(self.linears, kinds)]
        return self.norms_in(dtype), weights, scales, offsets

    def norms_in(self, dtype: torch.dtype) -> list[torch.Tensor]:
        return [n.weight.to(dtype) for n in self.norms]


_layer_weights: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its LayerWeights


def decode_layers(model, x: torch.Tensor, rope: Rope, caches: list[KVCache], positions: list[int] | None = None,
                  ops=None) -> torch.Tensor | None:
    """x (b, dim) through every layer of `model` in one op, row i's key and value written to caches[i]
    at positions[i] (default: its length; rows may share a cache, the op writes every row's keys and
    values before any row attends); rope's tables (b, head_dim) in x's dtype. None where the op does not apply
    (no kernel, not on the CPU, weights it does not take, more sequences than it takes, caches that are
    views of a static slot cache): the caller
    runs the reference. `ops`: the build to use (default: the one linears() uses)."""
    if torch.compiler.is_compiling() or x.device.type != "cpu":  # compile traces the reference; a GPU runs it
        return None
    ops = ops or kernels()
    if ops is None or not 1 <= x.shape[0] <= MAX_KERNEL_ROWS or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    if not all(cache.k.is_contiguous() and cache.v.is_contiguous() for cache in caches):
        return None  # a static slot's views (model/static_decode.py): the op takes caches of their own
    if len({cache.k.dtype for cache in caches}) > 1:
        return None  # q8 blocks beside caches in x's dtype: the op takes one kind a call
    if model not in _layer_weights:
        _layer_weights[model] = LayerWeights(model)
    found = _layer_weights[model].current(x.dtype)
    if found is None:
        return None
    if positions is None:
        positions = [cache.length for cache in caches]
    for cache, position in zip(caches, positions):
        if position >= cache.max_len:
            raise ValueError(f"KV cache holds {cache.max_len} positions; asked to write up to {position + 1}")
    norms, weights, scales, offsets = found
    config = model.config
    return ops.decode_layers(x, norms, weights, scales, offsets, rope.cos, rope.sin, [c.k for c in caches],
                             [c.v for c in caches], positions, config.n_heads, config.norm_eps)
