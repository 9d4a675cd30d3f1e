"""The context limit: how many tokens a model reads at once, its prompt and its reply together.

Without torch, so that the engine's prompt fitting (app/engine/prompt.py) and whoever reports the error need
not import the model to raise or catch it.
"""


class PromptTooLong(ValueError):
    """The prompt does not fit the context limit."""


def prompt_budget(limit: int, max_new_tokens: int) -> int:
    """The tokens a prompt may take: the context, less room for the reply (at most half of it)."""
    return limit - min(max_new_tokens, limit // 2)


KV_SHARE = 4  # one conversation's KV cache at full length may take this fraction (1/4) of the memory available
MIN_CONTEXT = 256


def choose_context(own: int, asked: int | None, bytes_per_position: int, available: int) -> tuple[int, str]:
    """The context a model runs with, and why. `asked`: LLAMA_MAX_CONTEXT, taken within the model's own
    length (`own`). Unset: the model's own length where one conversation's KV cache at that length
    (`bytes_per_position` each) takes at most a quarter of the memory `available` (bytes, after the
    weights are loaded), else as many tokens as that quarter holds, in whole 256s, at least 256: several
    conversations share the memory, and a cache's pages are touched only as its positions are written."""
    if asked is not None:
        return (asked, "LLAMA_MAX_CONTEXT") if asked <= own else (own, "the model's own, below LLAMA_MAX_CONTEXT")
    fits = available // KV_SHARE // max(1, bytes_per_position)
    if fits >= own:
        return own, "the model's own"
    return max(MIN_CONTEXT, fits // MIN_CONTEXT * MIN_CONTEXT), "what a quarter of the memory available holds"
