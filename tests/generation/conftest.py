"""Fixtures shared by the fast-decode tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_torch_thread():
    """torch on one thread for the test (the C decode paths run only then, as under xdist),
    restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
