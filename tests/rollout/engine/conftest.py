"""Shared by the engine tests (a real vLLM server on the tiny model)."""

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """One torch thread in each engine test module: the server's processes need the machine's
    cores more than the test's own forward passes."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
