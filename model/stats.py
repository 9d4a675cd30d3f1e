"""The figures of one reply: what `generate()` reports and what the engine sends in its `Done` message.

A msgspec Struct, so the engine encodes it as it is; no torch here, so the web process reads it without
loading torch.
"""

from __future__ import annotations

import msgspec


class Stats(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens whose keys/values came from a cache (not computed for this reply)
    new_tokens: int = 0  # the reply's tokens (a stop token is not one)
    time_to_first_token: float = 0.0  # seconds from the start (the engine: the request's arrival) to the first token
    total_time: float = 0.0
    decode_steps: int = 0  # forward passes after the prompt's (each samples one token, or more with guesses)
    decoded_tokens: int = 0  # tokens those passes gave (a stop token too)
    guesses: int = 0  # guessed tokens checked (model/speculation.py); decoded_tokens - decode_steps of them stood

    @property
    def tokens_per_second(self) -> float:
        """Decode speed: the tokens after the first over the time after the first."""
        decode_time = self.total_time - self.time_to_first_token
        return (self.new_tokens - 1) / decode_time if self.new_tokens > 1 and decode_time > 0 else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens a decode step gave: 1 without speculation, more where guesses stood (0: no step)."""
        return self.decoded_tokens / self.decode_steps if self.decode_steps else 0.0

    def step(self, guessed: int, tokens: int) -> None:
        """Count a decode step that checked `guessed` guesses and gave `tokens` tokens."""
        self.decode_steps += 1
        self.decoded_tokens += tokens
        self.guesses += guessed
