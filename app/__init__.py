"""The Chainlit chat app (main.py) and the generation service it runs on (service.py)."""
