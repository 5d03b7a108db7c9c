"""The engine's memory plan: what the weights, the KV cache and the activations will take, checked
against the machine's memory before anything large is allocated.

Weights are estimated from the checkpoint's own tensor table and the form each linear layer will
be held in (pagellm.layers.linear_method): a GGUF weight the int8 kernel takes stays near its
file size, a bfloat16 one two bytes a weight, the exact float32 path eight (the weight and its
panels). A plan that does not fit raises a ValueError naming the parts, instead of letting the
kernel's OOM killer end the process halfway through loading.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional

from safetensors import safe_open

from pagellm.config import LinearPrecision
from pagellm.layers.gguf_types import FLOAT_TYPES, kernel_takes
from pagellm.models.gguf_loader import GGUFFile

logger = logging.getLogger(__name__)

# Bytes of a packed int8-kernel block per byte of the file's block, by type (gemm_int8.cpp's
# layouts: scales widened where the kernel wants them, 2- and 3-bit quants stored as nibbles).
PACKED_PER_FILE_BYTE: dict[str, float] = {"Q3_K": 1.33, "Q2_K": 1.95}
DEFAULT_PACKED_PER_FILE_BYTE = 1.03
# The interpreter, torch and the server's libraries, resident before any model memory.
RUNTIME_BYTES = 768 << 20
GiB = float(1 << 30)


@dataclass(frozen=True)
class MemoryPlan:
    checkpoint_bytes: int  # the weights' bytes in the checkpoint files
    weight_bytes: int  # resident once loaded (an estimate before, measured after loading)
    kv_cache_bytes: int
    activation_bytes: int
    available_bytes: Optional[int]  # what the machine (or its cgroup) can still give; None if unknown
    kv_cache_tokens: int = 0  # of full context: the usable blocks shared evenly by the KV cache groups
    kv_cache_dtype: str = ""  # --kv-cache-dtype's name for what the cache holds
    kv_cache_layout: str = ""  # how layers share blocks (KVCacheLayout.describe); "" for one full-attention group
    state_bytes: int = 0  # of kv_cache_bytes, a hybrid model's recurrent state slots
    num_state_slots: int = 0

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_cache_bytes + self.activation_bytes + RUNTIME_BYTES

    def describe(self) -> str:
        tokens = f", {self.kv_cache_tokens:,} tokens" if self.kv_cache_tokens else ""
        tokens += f" of {self.kv_cache_dtype}" if self.kv_cache_dtype else ""
        tokens += f" in {self.kv_cache_layout}" if self.kv_cache_layout else ""
        if self.num_state_slots:
            tokens += f", {self.state_bytes / GiB:.2f} GiB of it {self.num_state_slots} recurrent state slots"
        available = f" of {self.available_bytes / GiB:.2f} GiB available" if self.available_bytes else ""
        return (
            f"weights {self.weight_bytes / GiB:.2f} GiB (checkpoint {self.checkpoint_bytes / GiB:.2f} GiB), "
            f"KV cache {self.kv_cache_bytes / GiB:.2f} GiB{tokens}, activations {self.activation_bytes / GiB:.2f} GiB, "
            f"runtime {RUNTIME_BYTES / GiB:.2f} GiB: {self.total_bytes / GiB:.2f} GiB{available}"
        )

    def check(self) -> None:
        """ValueError when the plan cannot fit in the memory available."""
        if self.available_bytes is not None and self.total_bytes > self.available_bytes:
            raise ValueError(
                f"the model does not fit in memory: {self.describe()}. Lower --kv-cache-memory, "
                "--max-num-batched-tokens or --max-num-seqs, or use a smaller (more quantized) checkpoint."
            )


def available_memory_bytes() -> Optional[int]:
    """MemAvailable, capped by this process's cgroup limit where one is set."""
    available: Optional[int] = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        return None
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        if limit != "max" and available is not None:
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass
    return available


def estimate_weight_bytes(checkpoint: list[str], precision: LinearPrecision, is_gguf: bool) -> tuple[int, int]:
    """(bytes in the checkpoint, bytes resident once loaded for ``precision``)."""
    if is_gguf:
        return _estimate_gguf(checkpoint[0], precision)
    file_bytes = resident = 0
    per_weight = {"bfloat16": 2, "float32": 8, "int8": 2}[precision.fallback]
    for path in checkpoint:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                numel = 1
                for dim in sl.get_shape():
                    numel *= dim
                item = {"F32": 4, "F16": 2, "BF16": 2}.get(sl.get_dtype(), 4)
                file_bytes += numel * item
                linear = name.endswith("proj.weight") or name.endswith("lm_head.weight")
                resident += numel * (per_weight if linear else item)
    return file_bytes, resident


def _estimate_gguf(path: str, precision: LinearPrecision) -> tuple[int, int]:
    gguf_file = GGUFFile.cached(path)
    file_bytes = resident = 0
    fallback = {"bfloat16": 2, "float32": 8, "int8": 2}[precision.fallback]
    tied = "output.weight" not in gguf_file.tensors
    for name, info in gguf_file.tensors.items():
        file_bytes += info.num_bytes
        numel = 1
        for dim in info.shape:
            numel *= dim
        if info.ggml_type in FLOAT_TYPES and len(info.shape) == 1:
            resident += numel * 4  # norms: float32
            continue
        quantized = info.ggml_type not in FLOAT_TYPES
        packed = precision.kind == "int8" and quantized and kernel_takes(info.ggml_type)
        ratio = PACKED_PER_FILE_BYTE.get(info.ggml_type.name, DEFAULT_PACKED_PER_FILE_BYTE)
        if name.startswith("token_embd"):
            # Kept as the kernel's panels (a tied head shares them), else as blocks or float32.
            resident += int(info.num_bytes * ratio) if packed else info.num_bytes if quantized else numel * 4
            if packed or not tied:
                continue
        resident += int(info.num_bytes * ratio) if packed else numel * fallback
    return file_bytes, resident


def checkpoint_bytes_on_disk(files: list[str]) -> int:
    return sum(os.path.getsize(f) for f in files)
