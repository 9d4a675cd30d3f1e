"""The context limit: how many tokens a model reads at once, its prompt and its reply together.

Without torch, so that the engine's prompt fitting (app/engine/prompt.py) and whoever reports the error need
not import the model to raise or catch it.
"""


class PromptTooLong(ValueError):
    """The prompt does not fit the context limit."""
