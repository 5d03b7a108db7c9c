"""Every environment variable pagellm reads, in one place, read when asked (not at import).

Flags and constructor arguments are the interface; these exist for what must be settable before
a process starts (the kernel build, a server's secret) or from outside a launcher.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional


def cpu_arch() -> str:
    """PAGELLM_CPU_ARCH: the ``-march`` the C++ kernels are built for (e.g. ``x86-64-v3`` for AVX2)."""
    return os.environ.get("PAGELLM_CPU_ARCH") or "native"


def amx() -> bool:
    """PAGELLM_AMX=0: keep the linear layers off AMX tiles on a CPU that has them (for A/B runs)."""
    return os.environ.get("PAGELLM_AMX", "1").lower() not in ("0", "false")


def cache_dir() -> Path:
    """PAGELLM_CACHE_DIR: where built kernels are kept; else ``$XDG_CACHE_HOME/pagellm`` or ``~/.cache/pagellm``."""
    if os.environ.get("PAGELLM_CACHE_DIR"):
        return Path(os.environ["PAGELLM_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pagellm"


def packed_weight_cache_dir() -> Optional[Path]:
    """PAGELLM_PACKED_WEIGHT_CACHE: where the kernels' packed weights are kept between starts
    (pagellm.kernels.pack_cache): a directory, or ``0`` for nowhere; default ``<cache dir>/packed``."""
    value = os.environ.get("PAGELLM_PACKED_WEIGHT_CACHE", "")
    if value.lower() in ("0", "false", "off"):
        return None
    return Path(value) if value else cache_dir() / "packed"


def retune() -> bool:
    """PAGELLM_RETUNE=1: measure the machine's start-up tuning again instead of reading what an earlier start kept."""
    return os.environ.get("PAGELLM_RETUNE", "0").lower() not in ("0", "false", "")


def api_key() -> Optional[str]:
    """PAGELLM_API_KEY: the server's bearer token when ``--api-key`` is not given."""
    return os.environ.get("PAGELLM_API_KEY") or None


def allow_runtime_lora_updating() -> bool:
    """PAGELLM_ALLOW_RUNTIME_LORA_UPDATING=1 (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING): serve
    /v1/load_lora_adapter and /v1/unload_lora_adapter, which let a client make the server read a
    directory it names; off by default."""
    return os.environ.get("PAGELLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true")


def triton_interpret() -> bool:
    """TRITON_INTERPRET=1: Triton's own switch (read by Triton when a kernel is defined) to run
    kernels in its CPU interpreter; the Triton backend then accepts CPU tensors, for tests."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def set_openmp_defaults() -> None:
    """Lets libgomp's workers spin between the many short parallel regions of a step.

    Must run before torch loads its OpenMP runtime; a user's own setting of either variable wins.
    Why spinning pays on small VMs is in docs/benchmarks.md ("Why libgomp's workers spin").
    """
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", "100000")
