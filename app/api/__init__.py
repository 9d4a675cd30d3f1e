"""The OpenAI-compatible API: routes, the OpenAI shapes read and written, metrics, the guard."""
