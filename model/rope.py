"""Rotary position embedding (RoPE) with the Llama 3 frequency scaling.

We use the "half split" layout of Hugging Face checkpoints: a head vector is rotated as two halves
(x1, x2), not as interleaved pairs. Meta's checkpoints and llama.cpp's GGUF files use interleaved
pairs; their q/k rows are reordered once (`permute_qk_rows`), which gives identical attention scores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import LlamaConfig, RopeFreqFactors


def inv_freq(config: LlamaConfig) -> torch.Tensor:
    """The rotation frequency of each pair of channels, (head_dim // 2,), float32."""
    d = config.head_dim
    freqs = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = config.rope_scaling
    if s is None:
        return freqs
    if isinstance(s, RopeFreqFactors):  # llama.cpp's form: one divisor per frequency, as the file gives them
        return freqs / torch.tensor(s.factors, dtype=torch.float32)
    # Llama 3: long wavelengths are slowed down by `factor`, short ones kept, and the band
    # between them interpolated smoothly.
    wavelen = 2 * math.pi / freqs
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / s.factor, freqs)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


@dataclass(frozen=True)
class Rope:
    """RoPE's cos and sin for some positions, each (..., head_dim): the tables a layer rotates its
    queries and keys with, taken from the model's tables for the positions being computed."""

    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def tables(cls, config: LlamaConfig, max_len: int, device=None) -> Rope:
        """Positions 0..max_len-1, each table (max_len, head_dim), float32."""
        positions = torch.arange(max_len, dtype=torch.float32, device=device)
        angles = torch.outer(positions, inv_freq(config).to(device))  # (max_len, head_dim // 2)
        angles = torch.cat([angles, angles], dim=-1)  # (max_len, head_dim)
        return cls(angles.cos(), angles.sin())

    @property
    def max_len(self) -> int:
        return self.cos.shape[0]

    def at(self, positions: slice | list[int], dtype: torch.dtype) -> Rope:
        """The rows of `positions` (a slice, or one position per sequence) in the activations' dtype."""
        if isinstance(positions, list):  # as a tensor: torch.compile then guards on its shape, not each value
            positions = torch.tensor(positions, device=self.cos.device)
        return Rope(self.cos[positions].to(dtype), self.sin[positions].to(dtype))

    def view(self, *shape: int) -> Rope:
        return Rope(self.cos.view(*shape), self.sin.view(*shape))

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x (batch, heads, seq, head_dim), the tables broadcast against it: each channel pair (i,
        i + head_dim/2) turned by its position's angle."""
        return x * self.cos + rotate_half(x) * self.sin


def permute_qk_rows(w, n_heads: int, to: str):
    """Reorder the rows of a q or k projection between RoPE's two layouts of a head's channel pairs.

    to="half": from interleaved pairs (2i, 2i + 1) (Meta's and llama.cpp's files) to ours (i, i + head_dim/2);
    to="interleaved": back. w: (n_heads * head_dim, ...), a torch tensor or a numpy array; whatever
    follows the row axis (the columns, an int8 row's group scales, a row's raw bytes) moves with its row.
    """
    rows = w.shape[0]
    pairs = rows // n_heads // 2
    if to == "half":
        split = (n_heads, pairs, 2)  # rows [head][pair][which] -> [head][which][pair]
    elif to == "interleaved":
        split = (n_heads, 2, pairs)  # rows [head][which][pair] -> [head][pair][which]
    else:
        raise ValueError(f"to={to!r}: expected 'half' or 'interleaved'")
    return w.reshape(*split, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
