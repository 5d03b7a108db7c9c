"""The C++ CPU backend: attention straight out of the paged cache, OpenMP over the batch.

Handles what ``pagellm.kernels.ops.paged_attention_supports`` accepts (float32 queries on CPU,
the head sizes the kernel is built for, a float32, float16, bfloat16, fp8 or int8 cache), with
every AttentionOptions field (sliding window, soft cap, sinks); anything else goes through the
vectorised torch path so callers never need to care.
"""
from __future__ import annotations

from typing import Optional

import torch

from pagellm.attention.backend import AttentionBackend, AttentionMetadata, AttentionOptions
from pagellm.attention.kv_quant import KVScales
from pagellm.attention.torch_sdpa import torch_attention
from pagellm.kernels import ops
from pagellm.kernels.context import KernelContext
from pagellm.kernels.tuning import CpuTuning


class CpuPagedBackend(AttentionBackend):
    """C++ kernel for float32 on CPU; the torch path for what it does not cover."""

    name = "cpu_paged"
    accepts_strided_qkv = True

    def __init__(self, tuning: CpuTuning | None = None) -> None:
        if not ops.available():
            raise RuntimeError("the C++ paged attention kernel could not be built; use get_attn_backend() to fall back")
        # Its own until the loader hands it the model's (use_kernel_context).
        self.kernels = KernelContext(tuning)

    @property
    def decode_prefetch_to_l2(self) -> bool:
        # Which prefetch level decode runs faster with depends on the core, so it was measured.
        return self.kernels.tuning.decode_prefetch_to_l2

    def supports(self, query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        return ops.paged_attention_supports(query, kv_cache)

    def write_cache(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
        kv_scales: KVScales,
    ) -> None:
        # The C++ write where the C++ kernel attends and it takes these tensors; torch's otherwise.
        if self.supports(query, kv_cache) and ops.write_kv_cache_supports(key, value, kv_cache, metadata.slot_mapping):
            ops.write_kv_cache(kv_cache, key, value, metadata.slot_mapping, kv_scales.k_scale, kv_scales.v_scale)
        else:
            super().write_cache(query, key, value, kv_cache, metadata, kv_scales)

    def attend(
        self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float, kv_scales: KVScales,
        options: Optional[AttentionOptions],
    ) -> torch.Tensor:
        if not self.supports(query, kv_cache):
            return torch_attention(query.contiguous(), kv_cache, metadata, scale, kv_scales, options)
        if query.stride(2) != 1 or query.stride(1) != query.shape[2]:
            query = query.contiguous()
        output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        block_table = metadata.block_table
        if block_table.stride(-1) != 1:
            block_table = block_table.contiguous()
        window = cap = sinks = None
        if options is not None:
            window, cap, sinks = options.sliding_window, options.logits_soft_cap, options.sinks
        ops.paged_attention(
            output,
            query,
            kv_cache,
            block_table,
            metadata.seq_lens,
            metadata.query_start_loc,
            scale,
            self.decode_prefetch_to_l2,
            kv_scales.k_scale,
            kv_scales.v_scale,
            window,
            cap,
            sinks,
        )
        return output
