"""The Llama 3 decoder: token embedding, blocks of grouped-query attention and SwiGLU, final norm, head.

Module names follow Meta's checkpoints (wq/wk/wv/wo, w1/w2/w3), so loading is renaming.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from .config import LlamaConfig
from .decode_step import decode_layers
from .kv_cache import KVCache, LayerCache
from .linear import MAX_KERNEL_ROWS, Embedding, Linear, linears, project
from .rope import Rope


# SDPA's backends on CUDA without cuDNN's: it builds an execution plan for each new key length (tens to hundreds
# of ms, and every decode step and prefill chunk has a new one), where flash and memory-efficient attention take
# any length as it comes.
CUDA_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options) -> torch.Tensor:
    """F.scaled_dot_product_attention, on CUDA through CUDA_ATTENTION's backends."""
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, **options)
    with sdpa_kernel(CUDA_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, **options)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.wq = Linear(config.dim, config.n_heads * config.head_dim)
        self.wk = Linear(config.dim, config.n_kv_heads * config.head_dim)
        self.wv = Linear(config.dim, config.n_kv_heads * config.head_dim)
        self.wo = Linear(config.n_heads * config.head_dim, config.dim)

    def qkv(self, x, rope: Rope):
        """x (b, s, dim) -> rotated queries (b, h, s, d), rotated keys and values (b, kv, s, d)."""
        batch, seq, _ = x.shape
        h, kv = self.n_heads, self.n_kv_heads
        qkv = project(x, self.wq, self.wk, self.wv).view(batch, seq, h + 2 * kv, self.head_dim)
        qkv = qkv.transpose(1, 2)  # (b, h + 2 kv, s, d)
        qk = rope.rotate(qkv[:, :h + kv])  # queries and keys rotated in one go
        return qk[:, :h], qk[:, h:], qkv[:, h + kv:]

    def forward(self, x, rope: Rope, mask, cache: LayerCache | None, start_pos: int):
        """Positions start_pos.. of one batch of sequences that share this layer's cache (or have none)."""
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x, rope)
        if cache is not None:
            k, v = cache.update(start_pos, k, v)  # (b, kv, start_pos + s, d)
        if seq == 1:
            return self.wo(self.attend_one(q, k, v).reshape(batch, 1, -1).to(x.dtype))
        out = sdpa(
            q.to(k.dtype), k, v, attn_mask=mask, is_causal=mask is None and start_pos == 0,
            enable_gqa=self.n_kv_heads != self.n_heads)  # in fp32 where a q8 cache widened its keys to it
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1).to(x.dtype))

    def decode(self, x, rope: Rope, caches: list[LayerCache]):
        """One new token of each of len(caches) rows, x (b, 1, dim), each at its own position (its layer
        cache's length); rope's tables (b, 1, 1, d). The projections see all b rows at once; row i's keys
        and values are written before row i + 1 attends (rows may share a cache: Llama.decode)."""
        q, k, v = self.qkv(x, rope)
        out = torch.cat([self.attend_one(q[i:i + 1], *cache.update(cache.length, k[i:i + 1], v[i:i + 1]))
                         for i, cache in enumerate(caches)])  # (b, kv, groups, d)
        return self.wo(out.reshape(len(caches), 1, -1).to(x.dtype))

    def attend_one(self, q, k, v):
        """One new query per sequence, q (b, h, 1, d), against keys/values (b, kv, n, d) -> (b, kv, groups, d).

        The query heads that share a KV head become that head's "sequence" of queries: no repeated
        keys, and SDPA's fast kernels (its GQA path is many times slower for a single query).
        """
        batch, kv = k.shape[:2]
        q = q.reshape(batch, kv, self.n_heads // kv, self.head_dim).to(k.dtype)
        return sdpa(q, k, v)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.w1 = Linear(config.dim, config.ffn_dim)
        self.w2 = Linear(config.ffn_dim, config.dim)
        self.w3 = Linear(config.dim, config.ffn_dim)

    def forward(self, x):
        gate, up = project(x, self.w1, self.w3).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x, rope: Rope, mask, cache: LayerCache | None, start_pos: int):
        x = x + self.attention(self.attention_norm(x), rope, mask, cache, start_pos)
        return x + self.feed_forward(self.ffn_norm(x))

    def decode(self, x, rope: Rope, caches: list[LayerCache]):
        x = x + self.attention.decode(self.attention_norm(x), rope, caches)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.output = Linear(config.dim, config.vocab_size)
        self.tie_weights()
        # RoPE tables are not in any checkpoint: built by setup_rope() on the real device.
        self.rope: Rope | None = None
        # Activations, norms and the KV cache use compute_dtype; matrices may be stored narrower
        # (bf16 or int8 weights with fp32 compute on CPUs without native bf16).
        self.compute_dtype = torch.float32
        # How KV caches made for this model keep keys and values (model/kv_cache.py's KV_TYPES).
        self.kv_type = "bf16"
        # Whether decode runs the layers as one C++ op where it applies (model/decode_step.py).
        self.fused_decode = True
        # Steps of fixed shapes over static KV slots (CUDA graphs): model/static_decode.py's attach().
        self.static = None

    def tie_weights(self):
        if self.config.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def setup_rope(self, max_len: int):
        device = self.tok_embeddings.weight.device
        self.rope = Rope.tables(self.config, max_len, device=device)

    def ensure_rope(self, end: int):
        """RoPE tables that reach position end - 1 (doubled when they grow, so growing is rare)."""
        if self.rope is None or end > self.rope.max_len:
            self.setup_rope(max(end, 2 * (0 if self.rope is None else self.rope.max_len)))

    def forward(self, tokens: torch.Tensor, start_pos: int = 0, kv_cache: KVCache | None = None,
                last_only: bool = False) -> torch.Tensor:
        """tokens (batch, seq) at positions start_pos.. -> logits (batch, seq or 1, vocab) in fp32.

        Without a kv_cache the sequence attends only to itself (start_pos must be 0).
        """
        seq = tokens.shape[1]
        end = start_pos + seq
        self.ensure_rope(end)
        x = self.tok_embeddings(tokens).to(self.compute_dtype)  # (b, s, dim)
        rope = self.rope.at(slice(start_pos, end), x.dtype)  # (s, head_dim) tables
        mask = None
        if kv_cache is not None and start_pos > 0 and seq > 1:
            # New tokens see every cached position and the new ones up to themselves.
            positions = torch.arange(end, device=tokens.device)
            mask = positions[None, :] <= positions[start_pos:, None]  # (s, start_pos + s)
        for i, block in enumerate(self.layers):
            x = block(x, rope, mask, None if kv_cache is None else kv_cache.layer(i), start_pos)
        if last_only:
            x = x[:, -1:, :]
        return self.logits(x)

    def decode(self, tokens: torch.Tensor, caches: list[KVCache], fused: bool | None = None,
               positions: list[int] | None = None) -> torch.Tensor:
        """One new token for each of several rows: tokens (b,), row i at position positions[i] (default:
        caches[i].length) of caches[i], its keys/values written there -> logits (b, vocab) in fp32.

        The weight matrices are read once for all b rows; attention runs per row, over its cache up to
        its position. Rows may share a cache at consecutive positions (a speculative check: the guesses
        after a sequence's last token): every row's keys and values are written before any row
        attends, so each sees the ones before it, and none sees a later one. The caller records the
        ids that stand in each cache's `tokens` afterwards (positions past them are written over later).
        Rows whose caches are all slots of the model's static KV cache run as one step of fixed shapes
        (model/static_decode.py: a replayed CUDA graph). Where it applies (model/decode_step.py), the
        layers run as one C++ op; with fused=False
        (default: self.fused_decode), or where it does not, they run as the blocks' decode methods
        below, the reference.
        """
        if positions is None:
            positions = [cache.length for cache in caches]
        if len(caches) > MAX_KERNEL_ROWS and tokens.device.type == "cpu":  # the fused op's rows at a time
            return torch.cat([self.decode(tokens[i:i + MAX_KERNEL_ROWS], caches[i:i + MAX_KERNEL_ROWS], fused,
                                          positions[i:i + MAX_KERNEL_ROWS])
                              for i in range(0, len(caches), MAX_KERNEL_ROWS)])
        for cache, position in zip(caches, positions):
            if not 0 <= position < cache.max_len:
                raise ValueError(f"KV cache holds {cache.max_len} positions; asked to write up to {position + 1}")
        if self.static is not None and self.static.cache.holds(caches):
            return self.static.decode(tokens, caches, positions)
        self.ensure_rope(max(positions) + 1)
        x = self.tok_embeddings(tokens).to(self.compute_dtype)  # (b, dim)
        rope = self.rope.at(positions, x.dtype)  # (b, head_dim) tables
        fused = self.fused_decode if fused is None else fused
        out = decode_layers(self, x, rope, caches, positions) if fused else None  # (b, dim), or None
        if out is None:
            x, rope = x[:, None], rope.view(len(caches), 1, 1, -1)  # (b, 1, dim), (b, 1, 1, head_dim)
            for i, block in enumerate(self.layers):
                x = block.decode(x, rope, [LayerCache(cache.k[i], cache.v[i], position)
                                           for cache, position in zip(caches, positions)])
            out = x[:, 0]
        return self.logits(out)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., dim) -> logits (..., vocab) in fp32: the head sums in fp32, and sampling and logprobs
        see those sums, not their rounding to bf16 (steps of 1/8 at a typical logit size: ties)."""
        head = self.output
        return linears(self.norm(x), [head.weight], [head.scale], [head.offset], fp32_out=True)
