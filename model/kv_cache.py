"""The key/value cache of one conversation: pre-allocated, written in place at each position.

A prompt is prefilled in chunks that start at multiples of PREFILL_CHUNK, so the same tokens always
meet the same chunks: each position's keys and values come out bit for bit the same whichever request
computes them. A later request may take over only such positions (`exact`); positions of a last,
partial chunk or of decode steps were summed in another order and are computed again, so that a
reply never depends on what a cache held before.

Keys and values are kept in one of two types (`KV_TYPES`, LLAMA_KV_TYPE):
- "bf16": as the model computes them, in its activations' dtype (bf16; fp32 on CPUs without bf16
  arithmetic, model/cpu.py);
- "q8": 8 bits, in blocks of 32 numbers along head_dim with one fp16 scale each, laid out as GGUF's
  Q8_0 (the scale's 2 bytes, then 32 int8): a row of head_dim numbers is head_dim / 32 * 34 bytes,
  0.53x bf16's and 0.27x fp32's. A block's scale is max|x| / 127 rounded to fp16; each number is
  x / scale rounded to the nearest integer (ties to even). The decode op (csrc/decode_step.cpp) writes
  and reads the blocks itself, a block at a time; the reference (LayerCache.update) widens a layer's
  keys and values to fp32 for the attention of one forward pass.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .config import LlamaConfig
from .cpu import has_amx
from .options import KV_TYPES
Q8_BLOCK = 32  # numbers a q8 block holds
Q8_BLOCK_BYTES = 2 + Q8_BLOCK  # its fp16 scale, then the numbers in int8

# Prompt tokens per forward pass: a cancel, and in the engine the other streams' next decode step, wait
# for one chunk at most. 256 was the fastest size on AVX-512 CPUs (docs/benchmarks.md); on CPUs with
# AMX the bf16 products pay off at more rows (1B shape: 0.88x transformers' prefill in chunks of 256,
# 1.00x in 512), and a chunk of 512 there takes about as long (0.85 s) as one of 256 on Zen 5.
PREFILL_CHUNK = 512 if has_amx() else 256


def q8_row_bytes(head_dim: int) -> int:
    """Bytes of one position's head in q8 blocks."""
    return head_dim // Q8_BLOCK * Q8_BLOCK_BYTES


def quantize_q8(x: torch.Tensor) -> torch.Tensor:
    """x (..., head_dim) -> its q8 blocks (..., head_dim / 32 * 34) in uint8 (the module's docstring)."""
    blocks = x.float().unflatten(-1, (-1, Q8_BLOCK))  # (..., n_blocks, 32)
    scale = (blocks.abs().amax(-1, keepdim=True) / 127).half()  # (..., n_blocks, 1)
    wide = scale.float()
    q = torch.where(wide > 0, blocks / wide, 0).round_().clamp_(-127, 127).to(torch.int8)
    return torch.cat([scale.view(torch.uint8), q.view(torch.uint8)], -1).flatten(-2)


def dequantize_q8(blocks: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """q8 blocks (..., row_bytes) -> the numbers (..., head_dim) they hold, in dtype (each q * scale in fp32)."""
    blocks = blocks.unflatten(-1, (-1, Q8_BLOCK_BYTES))  # (..., n_blocks, 34)
    scale = blocks[..., :2].contiguous().view(torch.float16).float()  # (..., n_blocks, 1)
    q = blocks[..., 2:].view(torch.int8).float()  # (..., n_blocks, 32)
    return (q * scale).flatten(-2).to(dtype)


class LayerCache(NamedTuple):
    """One layer's part of a KVCache: k, v (batch, n_kv_heads, max_len, head_dim), or their q8 blocks
    (batch, n_kv_heads, max_len, row_bytes) in uint8, and the position a decoded token is written at (the
    cache's length when this was taken)."""

    k: torch.Tensor
    v: torch.Tensor
    length: int

    def update(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (batch, n_kv_heads, seq, head_dim) at start.. and return all keys/values so far: as
        stored, or widened to fp32 from q8 blocks."""
        end = start + k.shape[2]
        max_len = self.k.shape[2]
        if end > max_len:
            raise ValueError(f"KV cache holds {max_len} positions; asked to write up to {end}")
        if self.k.dtype == torch.uint8:
            self.k[:, :, start:end] = quantize_q8(k)
            self.v[:, :, start:end] = quantize_q8(v)
            return dequantize_q8(self.k[:, :, :end]), dequantize_q8(self.v[:, :, :end])
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


class KVCache:
    """Keys and values of every layer for the first `length` positions of one sequence.

    Owned by one request (never by the shared model), so two conversations can run side by side.
    `tokens` records the ids whose keys/values are stored, so a later turn of the same conversation
    can reuse the common prefix and prefill only what is new.
    """

    def __init__(self, config: LlamaConfig, max_len: int, *, batch: int = 1,
                 device=None, dtype=torch.float32, chunk: int | None = None,
                 storage: tuple[torch.Tensor, torch.Tensor] | None = None, kv_type: str = "bf16"):
        self.config = config
        if kv_type not in KV_TYPES:
            raise ValueError(f"KV type {kv_type!r}: expected one of {', '.join(KV_TYPES)}")
        self.kv_type, self.dtype = kv_type, dtype  # dtype: the activations' (the stored numbers' unless q8)
        if kv_type == "q8":
            if config.head_dim % Q8_BLOCK:
                raise ValueError(f"q8 KV blocks take a head_dim that is a multiple of {Q8_BLOCK}; this model's is "
                                 f"{config.head_dim}")
            dtype = torch.uint8
        row = q8_row_bytes(config.head_dim) if kv_type == "q8" else config.head_dim
        shape = (config.n_layers, batch, config.n_kv_heads, max_len, row)
        if storage is not None:  # tensors of that shape allocated by the caller (a slot: model/static_decode.py)
            self.k, self.v = storage
            if self.k.shape != shape or self.v.shape != shape:
                raise ValueError(f"KV storage of shape {tuple(self.k.shape)}; expected {shape}")
            if kv_type == "bf16":
                self.dtype = self.k.dtype
        else:  # never read beyond what was written, so left uninitialized: pages are touched only as used
            self.k = torch.empty(shape, device=device, dtype=dtype)
            self.v = torch.empty(shape, device=device, dtype=dtype)
        self.max_len = max_len
        self.slot: int | None = None  # where a SlotCache's slot (model/static_decode.py) holds it
        self.chunk = chunk or PREFILL_CHUNK  # prompt tokens per forward pass, chunks starting at its multiples
        self.tokens: list[int] = []
        self.exact = 0  # leading positions computed by whole chunks: the same for any request with these tokens

    @property
    def quantized(self) -> bool:
        return self.kv_type == "q8"

    @staticmethod
    def bytes_per_position(config: LlamaConfig, kv_type: str, dtype: torch.dtype) -> int:
        """Bytes one position's keys and values take in every layer."""
        row = q8_row_bytes(config.head_dim) if kv_type == "q8" else config.head_dim * dtype.itemsize
        return 2 * config.n_layers * config.n_kv_heads * row

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def resized(self, max_len: int) -> KVCache:
        """A cache of another size holding the same positions (as many as fit)."""
        return self.copy_prefix(min(self.length, max_len), max_len)

    def layer(self, index: int) -> LayerCache:
        """Layer `index`'s keys and values, with this cache's length as where a new token goes."""
        return LayerCache(self.k[index], self.v[index], self.length)

    @property
    def used_bytes(self) -> int:
        """Bytes of the positions written so far (the memory actually touched)."""
        return self.nbytes * self.length // self.max_len

    def chunk_end(self, prompt_length: int) -> int:
        """Where the next prefill chunk of a prompt of that length ends: the next multiple of `chunk`, or
        the prompt's end."""
        return min(prompt_length, (self.length // self.chunk + 1) * self.chunk)

    def extend(self, ids: list[int]) -> None:
        """Record the ids a forward pass just wrote at positions length.. (a prefill chunk, or a token)."""
        start = self.length
        self.tokens.extend(ids)
        if start == self.exact and start % self.chunk == 0 and len(ids) == self.chunk:
            self.exact = self.length

    def inexact_chunk(self) -> tuple[int, list[int]] | None:
        """The first whole chunk of the ids held here that was not computed as a prefill computes it (a
        reply's decoded tokens, a partial chunk): (its start, its ids), or None. Run through the model
        as a prefill chunk, it makes `exact` reach its end (`exact = start + chunk`)."""
        start = self.exact
        if start + self.chunk > self.length:
            return None
        return start, self.tokens[start:start + self.chunk]

    def truncate(self, n: int) -> None:
        """Keep the first n positions (later writes go over the rest)."""
        del self.tokens[n:]
        self.exact = min(self.exact, n)

    def reusable(self, prompt: list[int]) -> int:
        """How many leading positions a request for `prompt` may take from this cache: those it shares with
        the prompt and that were computed by whole chunks, in whole chunks, leaving at least the prompt's last
        token to run (its logits give the first token)."""
        shared = min(self.exact, len(prompt) - 1)
        if shared <= 0:
            return 0
        return min(shared, self.common_prefix(prompt)) // self.chunk * self.chunk

    def common_prefix(self, tokens: list[int]) -> int:
        """How many leading ids of `tokens` already have their keys/values here."""
        return common_prefix(self.tokens, tokens)

    def copy_prefix(self, n: int, max_len: int, into: KVCache | None = None) -> KVCache:
        """A new cache of max_len positions holding this one's first n positions (`into`: that empty one)."""
        new = into or KVCache(self.config, max_len, batch=self.k.shape[1], device=self.k.device, dtype=self.dtype,
                              chunk=self.chunk, kv_type=self.kv_type)
        new.k[:, :, :, :n] = self.k[:, :, :, :n]
        new.v[:, :, :, :n] = self.v[:, :, :, :n]
        new.tokens = self.tokens[:n]
        new.exact = min(self.exact, n)
        return new


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids a and b share."""
    # Binary search over list-slice equality: each comparison runs in C, about log2(n) of them.
    low, high = 0, min(len(a), len(b))
    if a[:high] == b[:high]:
        return high
    high -= 1  # a[:low] and b[:low] match, a[:high + 1] and b[:high + 1] do not
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low
