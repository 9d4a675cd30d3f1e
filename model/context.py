"""The context limit: how many tokens a model reads at once, its prompt and its reply together.

Without torch, so that the engine's prompt fitting (app/engine/prompt.py) and whoever reports the error need
not import the model to raise or catch it.
"""


class PromptTooLong(ValueError):
    """The prompt does not fit the context limit."""


def prompt_budget(limit: int, max_new_tokens: int) -> int:
    """The tokens a prompt may take: the context, less room for the reply (at most half of it)."""
    return limit - min(max_new_tokens, limit // 2)
