"""The chat app: the Chainlit UI and the OpenAI-compatible API (the web process), the backend they call,
and the engine process that computes the replies. docs/architecture.md shows which module runs where."""
