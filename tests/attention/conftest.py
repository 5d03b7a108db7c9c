"""Shared fixtures for the attention tests."""
from __future__ import annotations

import pytest

from pagellm.attention.torch_ref import TorchReferenceBackend


@pytest.fixture(scope="session")
def reference() -> TorchReferenceBackend:
    return TorchReferenceBackend()
