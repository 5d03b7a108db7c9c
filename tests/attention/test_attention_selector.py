"""Backend selection by name and by device."""
from __future__ import annotations

import pytest
import torch

from pagellm.attention.backend import AttentionBackend
from pagellm.attention.selector import BACKEND_NAMES, get_attn_backend
from pagellm.attention.triton_paged import triton_available
from pagellm.kernels import ops


@pytest.mark.parametrize("name", ["torch_sdpa", "torch_ref"])
def test_named_backends(name: str) -> None:
    backend = get_attn_backend(name, torch.device("cpu"))
    assert isinstance(backend, AttentionBackend)
    assert backend.name == name


def test_default_on_cpu_is_the_fastest_available() -> None:
    expected = "cpu_paged" if ops.available() else "torch_sdpa"
    assert get_attn_backend(None, "cpu").name == expected


def test_default_on_cuda_is_triton_when_installed() -> None:
    # Choosing needs no device: nothing is allocated on it.
    expected = "triton_paged" if triton_available() else "torch_sdpa"
    assert get_attn_backend(None, torch.device("cuda")).name == expected
    assert get_attn_backend(None, torch.device("mps")).name == "torch_sdpa"


def test_triton_rejects_cpu_outside_the_interpreter(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="runs on CUDA"):
        get_attn_backend("triton_paged", "cpu")


def test_unknown_name_raises() -> None:
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attn_backend("flash_magic", "cpu")


def test_cpu_paged_rejects_other_devices() -> None:
    with pytest.raises(ValueError, match="CPU only"):
        get_attn_backend("cpu_paged", torch.device("cuda"))


def test_names_are_listed() -> None:
    assert set(BACKEND_NAMES) == {"cpu_paged", "triton_paged", "torch_sdpa", "torch_ref"}
