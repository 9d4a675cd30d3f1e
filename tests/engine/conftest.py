"""The engine's tests: the tiny checkpoint (tests/conftest.py) loaded once per module, on the test device."""

import pytest
import torch

from model.checkpoint import load_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tiny, device):
    return load_checkpoint(tiny, dtype=torch.float32, device=device)
