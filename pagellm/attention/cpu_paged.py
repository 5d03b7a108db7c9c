"""The C++ CPU backend: attention straight out of the paged cache, OpenMP over the batch.

Handles float32 queries on CPU with head_dim in {32, 64, 80, 96, 128, 256} over a float32,
float16 or bfloat16 cache; anything else (another dtype or head size) goes through the
vectorised torch path so callers never need to care.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from pagellm.attention.backend import AttentionBackend, AttentionMetadata, write_kv_cache
from pagellm.attention.torch_sdpa import torch_attention
from pagellm.attention.validation import check_attention_inputs
from pagellm.kernels.build import load_kernels

logger = logging.getLogger(__name__)

SUPPORTED_HEAD_DIMS = frozenset({32, 64, 80, 96, 128, 256})
SUPPORTED_CACHE_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})


def kernel_available() -> bool:
    """Whether the C++ kernel is (or can be) built and loaded in this process."""
    return load_kernels()


class CpuPagedBackend(AttentionBackend):
    """C++ kernel for float32 on CPU; the torch path for what it does not cover."""

    name = "cpu_paged"
    accepts_strided_qkv = True

    def __init__(self) -> None:
        if not load_kernels():
            raise RuntimeError("the C++ paged attention kernel could not be built; use get_attn_backend() to fall back")
        tune_decode_prefetch()
        self._attention_op = torch.ops.pagellm_attn.paged_attention
        self._write_op = torch.ops.pagellm_attn.write_kv_cache

    def supports(self, query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        return (
            query.device.type == "cpu"
            and query.dtype == torch.float32
            and kv_cache.dtype in SUPPORTED_CACHE_DTYPES
            and query.shape[-1] in SUPPORTED_HEAD_DIMS
            and kv_cache.is_contiguous()
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        check_attention_inputs(query, key, value, kv_cache, metadata)
        if not self.supports(query, kv_cache):
            write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
            return torch_attention(query.contiguous(), kv_cache, metadata, scale)
        self._write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        if query.stride(2) != 1 or query.stride(1) != query.shape[2]:
            query = query.contiguous()
        output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        block_table = metadata.block_table
        if block_table.stride(-1) != 1:
            block_table = block_table.contiguous()
        self._attention_op(output, query, kv_cache, block_table, metadata.seq_lens, metadata.query_start_loc, float(scale))
        return output

    def _write_kv_cache(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        # The C++ scatter costs a third of index_copy_ for a decode batch and two thirds for a
        # long prefill; it needs per-token contiguous heads (the normal case) and matching dtypes,
        # or float32 keys/values for a half-precision cache (it converts them as it writes).
        converts = kv_cache.dtype in (torch.float16, torch.bfloat16) and key.dtype == torch.float32
        fast = (
            (key.dtype == kv_cache.dtype or converts)
            and value.dtype == key.dtype
            and key.stride(-1) == 1
            and value.stride(-1) == 1
            and key.stride(-2) == key.shape[-1]
            and value.stride(-2) == value.shape[-1]
            and slot_mapping.dtype == torch.int64
            and slot_mapping.is_contiguous()
        )
        if fast:
            self._write_op(kv_cache, key, value, slot_mapping)
        else:
            write_kv_cache(key, value, kv_cache, slot_mapping)


# Decode at 32 sequences x 512 keys (SmolLM2's heads): 25 MiB of cache per copy, and copies enough
# to exceed a 32 MiB last-level cache, so the timed passes read from memory as a model step does.
_PROBE_SEQS, _PROBE_CONTEXT, _PROBE_COPIES = 32, 512, 3
_PROBE_REPEATS = 3
# L2 prefetches must win by this much to replace the default (L1).
_PROBE_MIN_GAIN = 1.03
_prefetch_to_l2: Optional[bool] = None


def tune_decode_prefetch() -> bool:
    """Measures, once per process, whether decode attention runs faster when it prefetches the
    next keys and values into L2 only, and sets the kernel accordingly (see g_prefetch_to_l2 in
    paged_attention.cpp: 1.6x faster from memory on an AMD Zen 4, slower on an Intel Xeon).
    Returns the choice."""
    global _prefetch_to_l2
    if _prefetch_to_l2 is not None:
        return _prefetch_to_l2
    from pagellm.attention.synthetic import make_batch

    start = time.perf_counter()
    batch = make_batch([(1, _PROBE_CONTEXT)] * _PROBE_SEQS, 9, 3, 64, 16, fill_unused=0.0)
    caches = [batch.kv_cache.clone() for _ in range(_PROBE_COPIES)]
    out = torch.empty_like(batch.query)
    meta = batch.metadata
    block_table = meta.block_table.contiguous()

    def seconds(to_l2: bool) -> float:
        torch.ops.pagellm_attn.set_decode_prefetch_to_l2(to_l2)
        begin = time.perf_counter()
        for cache in caches:
            torch.ops.pagellm_attn.paged_attention(out, batch.query, cache, block_table, meta.seq_lens, meta.query_start_loc, batch.scale)
        return time.perf_counter() - begin

    best = {False: float("inf"), True: float("inf")}
    seconds(False)  # warm-up
    for _ in range(_PROBE_REPEATS):
        for to_l2 in (False, True):
            best[to_l2] = min(best[to_l2], seconds(to_l2))
    _prefetch_to_l2 = best[True] * _PROBE_MIN_GAIN < best[False]
    torch.ops.pagellm_attn.set_decode_prefetch_to_l2(_prefetch_to_l2)
    logger.info(
        "decode attention prefetches into %s (from memory: L1 %.1f ms, L2 %.1f ms; measured in %.2f s)",
        "L2" if _prefetch_to_l2 else "L1",
        best[False] * 1e3,
        best[True] * 1e3,
        time.perf_counter() - start,
    )
    return _prefetch_to_l2
