"""The identity of a LoRA adapter as requests carry it: no tensors, so it crosses every layer."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's ``LoRARequest``: ``lora_int_id`` (>= 1) names the adapter to the engine, which loads
    ``lora_path`` (a PEFT directory) the first time it sees the id."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: Optional[str] = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")

    @property
    def cache_key(self) -> str:
        """What the prefix cache mixes into a request's first block: two adapters never share KV. The
        path is part of it because a disk tier's keys outlive the server (docs/kv_offloading.md)."""
        return f"lora:{self.lora_int_id}:{self.lora_name}:{self.lora_path}"
