"""The chat in the browser: Chainlit handlers and what they show, store and check."""
