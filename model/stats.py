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

    @property
    def tokens_per_second(self) -> float:
        """Decode speed: the tokens after the first over the time after the first."""
        decode_time = self.total_time - self.time_to_first_token
        return (self.new_tokens - 1) / decode_time if self.new_tokens > 1 and decode_time > 0 else 0.0
