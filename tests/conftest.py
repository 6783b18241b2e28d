"""Shared fixtures. Tests live beside their helpers (tests/_models.py) and import them directly."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_torch_thread():
    """Keep torch to one intra-op thread (the I/O thread and child processes share 2 cores)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
