"""Choosing the next token from logits: greedy, temperature, top-k, top-p (nucleus)."""

from __future__ import annotations

import torch


def make_generator(seed: int | None, device="cpu") -> torch.Generator:
    """A private random stream, so one conversation's seed never depends on another's draws."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
           top_p: float = 1.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits (vocab,) -> token id (0-dim LongTensor). temperature 0 is greedy (argmax)."""
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k and top_k < logits.shape[-1]:
        logits, ids = torch.topk(logits, top_k)  # sorted, highest first
    elif top_p < 1.0:
        logits, ids = torch.sort(logits, descending=True)
    else:
        ids = None
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        # Keep the smallest set of top tokens whose mass reaches top_p (always at least one).
        mass_before = torch.cumsum(probs, dim=-1) - probs
        probs = probs.masked_fill(mass_before >= top_p, 0.0)
    # argmax(p / E) with E ~ Exp(1) draws from p (exponential race): one pass, no cumulative sums.
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    choice = torch.argmax(probs / noise)
    return choice if ids is None else ids[choice]
