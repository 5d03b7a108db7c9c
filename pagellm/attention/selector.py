"""Pick an attention backend by name, or the best one for a device."""
from __future__ import annotations

import torch

from pagellm.attention.backend import AttentionBackend
from pagellm.kernels import ops

BACKEND_NAMES = ("cpu_paged", "torch_sdpa", "torch_ref")


def get_attn_backend(name: str | None, device: torch.device | str) -> AttentionBackend:
    """The backend called ``name``, or with ``None`` the fastest that works on ``device``.

    CPU: the C++ kernel ("cpu_paged") if it builds, else "torch_sdpa" (after one warning).
    Other devices: "torch_sdpa".
    """
    device = torch.device(device)
    if name is None:
        name = "cpu_paged" if device.type == "cpu" and ops.available() else "torch_sdpa"
    if name == "cpu_paged":
        if device.type != "cpu":
            raise ValueError(f"attention backend 'cpu_paged' runs on CPU only, not on {device}")
        from pagellm.attention.cpu_paged import CpuPagedBackend

        return CpuPagedBackend()
    if name == "torch_sdpa":
        from pagellm.attention.torch_sdpa import TorchSdpaBackend

        return TorchSdpaBackend()
    if name == "torch_ref":
        from pagellm.attention.torch_ref import TorchReferenceBackend

        return TorchReferenceBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
