"""Pick an attention backend by name, or the best one for a device."""
from __future__ import annotations

import torch

from pagellm.attention.backend import AttentionBackend
from pagellm.kernels import ops

BACKEND_NAMES = ("cpu_paged", "triton_paged", "torch_sdpa", "torch_ref")


def get_attn_backend(name: str | None, device: torch.device | str) -> AttentionBackend:
    """The backend called ``name``, or with ``None`` the fastest that works on ``device``.

    CPU: the C++ kernel ("cpu_paged") if it builds, else "torch_sdpa" (after one warning).
    CUDA: the Triton kernels ("triton_paged") if Triton is installed, else "torch_sdpa".
    Other devices: "torch_sdpa".
    """
    device = torch.device(device)
    if name is None and device.type == "cpu":
        name = "cpu_paged" if ops.available() else "torch_sdpa"
    if name == "cpu_paged":  # before the Triton module, whose import a CPU start need not pay
        if device.type != "cpu":
            raise ValueError(f"attention backend 'cpu_paged' runs on CPU only, not on {device}")
        from pagellm.attention.cpu_paged import CpuPagedBackend

        return CpuPagedBackend()
    from pagellm.attention.triton_paged import runs_on, triton_available

    if name is None:
        name = "triton_paged" if device.type == "cuda" and triton_available() else "torch_sdpa"
    if name == "triton_paged":
        if not runs_on(device):
            raise ValueError(f"attention backend 'triton_paged' runs on CUDA (or with TRITON_INTERPRET=1), not on {device}")
        if not triton_available():
            raise ValueError("attention backend 'triton_paged' needs Triton: pip install 'pagellm[gpu]'")
        from pagellm.attention.triton_paged import TritonPagedBackend

        return TritonPagedBackend()
    if name == "torch_sdpa":
        from pagellm.attention.torch_sdpa import TorchSdpaBackend

        return TorchSdpaBackend()
    if name == "torch_ref":
        from pagellm.attention.torch_ref import TorchReferenceBackend

        return TorchReferenceBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
