"""The Triton backend: paged attention on NVIDIA GPUs without gathering the context.

The new keys/values are scattered into the cache by a Triton kernel; a decode-only batch (every
sequence adds one token) goes through the split-K decode kernel, any other batch (prefill chunks,
possibly mixed with decodes) through the varlen causal kernel. Every launch depends only on the
device tensors and on (num_seqs, num_tokens, max_seq_len) of the metadata, so a decode step is
capturable in a CUDA graph when those are fixed (see pagellm.worker.cuda_graphs).

8-bit caches (kv_quant) are quantized by the cache-write kernel and dequantized in registers by
the attention kernels; fp8's per-layer scales are read from ``KVScales.device_tensor`` inside
the kernels, so a captured graph replays with the scales current at replay time.

A layer's :class:`AttentionOptions` (sliding window, logit soft cap, sinks) are compile-time
switches of the kernels plus launch arguments: a plain layer runs the kernels as they were, and a
window shrinks a decode's split plan to the window, never loading the blocks before it.

Under ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors in Triton's interpreter, which is
how the test suite checks them without a GPU.
"""
from __future__ import annotations

import importlib.util
from typing import Optional

import torch

from pagellm import envs
from pagellm.attention.backend import AttentionBackend, AttentionMetadata, AttentionOptions
from pagellm.attention.kv_quant import FP8_DTYPES, QUANTIZED_DTYPES, KVScales

# Decode: KV tokens per split before a context is split across programs (flash-decoding), and
# the most splits one sequence gets (longer contexts get longer partitions instead).
DEFAULT_PARTITION = 512
MAX_SPLITS = 64
DEFAULT_BLOCK_N = 64  # KV tokens per tile
DEFAULT_BLOCK_M = 64  # query rows per prefill tile
_SUPPORTED_CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16) + QUANTIZED_DTYPES


def triton_available() -> bool:
    """Whether Triton can be imported (it is the optional ``gpu`` extra)."""
    return importlib.util.find_spec("triton") is not None


def runs_on(device: torch.device) -> bool:
    """Triton runs on CUDA devices, and on CPU only inside its interpreter."""
    return device.type == "cuda" or (device.type == "cpu" and envs.triton_interpret())


def split_plan(max_seq_len: int, partition: int, block_n: int, max_splits: int = MAX_SPLITS) -> tuple[int, int]:
    """(num_splits, tokens per split) for a decode batch whose longest context is ``max_seq_len``.

    Split size is a multiple of the KV tile so that every tile but a context's last is full.
    """
    num_splits = max(1, min(max_splits, -(-max_seq_len // partition)))
    per_split = -(-max(1, max_seq_len) // num_splits)
    per_split = -(-per_split // block_n) * block_n
    return num_splits, per_split


def _contiguous_head_dim(t: torch.Tensor) -> torch.Tensor:
    """The kernels take any token/head strides (views into the fused qkv) but a contiguous head_dim."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _kernel_scales(query: torch.Tensor, kv_cache: torch.Tensor, kv_scales: KVScales, metadata: AttentionMetadata) -> torch.Tensor:
    """fp8's scales as the kernels read them (the same device tensor every step, so CUDA graphs see
    updates); for any other cache a placeholder pointer."""
    return kv_scales.device_tensor(query.device) if kv_cache.dtype in FP8_DTYPES else metadata.seq_lens


class TritonPagedBackend(AttentionBackend):
    """Triton kernels for the cache write, decode and prefill; fp32, fp16, bf16, fp8 and int8 caches; GQA."""

    name = "triton_paged"
    accepts_strided_qkv = True
    supports_cuda_graphs = True

    def __init__(
        self, partition: int = DEFAULT_PARTITION, block_n: int = DEFAULT_BLOCK_N, block_m: int = DEFAULT_BLOCK_M
    ) -> None:
        for label, value in (("partition", partition), ("block_n", block_n), ("block_m", block_m)):
            if value < 16 or value & (value - 1):
                raise ValueError(f"{label} must be a power of two >= 16, got {value}")
        if partition < block_n:
            raise ValueError(f"partition ({partition}) must be at least block_n ({block_n})")
        if not triton_available():
            raise RuntimeError("the triton_paged backend needs Triton: pip install 'pagellm[gpu]'")
        # Imported here: importing triton is slow, and the kernels compile on first launch.
        from pagellm.attention.triton_kernels import cache_write, decode, kv_loop, prefill

        self._cache_write = cache_write
        self._decode = decode
        self._prefill = prefill
        self._kernel_options = kv_loop.KernelOptions
        self.partition = partition
        self.block_n = block_n
        self.block_m = block_m

    def check_supported(self, query: torch.Tensor, kv_cache: torch.Tensor) -> None:
        if not runs_on(query.device):
            raise ValueError(f"attention backend 'triton_paged' runs on CUDA (or with TRITON_INTERPRET=1), not on {query.device}")
        if kv_cache.dtype not in _SUPPORTED_CACHE_DTYPES:
            raise ValueError(f"triton_paged supports float32, float16, bfloat16, fp8 and int8 KV caches, not {kv_cache.dtype}")
        if kv_cache.stride(-1) != 1:
            raise ValueError("triton_paged needs a KV cache whose head_dim is contiguous")

    def write_cache(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
        kv_scales: KVScales,
    ) -> None:
        key, value = (_contiguous_head_dim(t) for t in (key, value))
        scales = _kernel_scales(query, kv_cache, kv_scales, metadata)
        self._cache_write.write_kv_cache(key, value, kv_cache, metadata.slot_mapping, scales)

    def attend(
        self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float, kv_scales: KVScales,
        options: Optional[AttentionOptions],
    ) -> torch.Tensor:
        query = _contiguous_head_dim(query)
        output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if metadata.num_tokens == 0:
            return output
        block_table = metadata.block_table
        if block_table.stride(-1) != 1:
            block_table = block_table.contiguous()
        window = cap = sinks = None
        if options is not None:
            window, cap = options.sliding_window, options.logits_soft_cap
            sinks = options.sinks.float() if options.sinks is not None else None
            if window is not None:
                window = min(window, 2**31 - 1)  # an int32 launch argument; any window past every context is the same
        kernel_options = self._kernel_options(
            _kernel_scales(query, kv_cache, kv_scales, metadata),
            scale,
            self.block_n,
            # The interpreter computes bf16 dot products wrongly (numpy has no bf16); it upcasts them.
            dot_f32=envs.triton_interpret() and torch.bfloat16 in (query.dtype, kv_cache.dtype),
            window=window,
            logits_soft_cap=cap,
            sinks=sinks,
        )
        if metadata.max_query_len <= 1 and metadata.num_tokens == metadata.num_seqs:
            # A decode reads at most its window: the splits cover that much.
            span = metadata.max_seq_len if window is None else min(metadata.max_seq_len, window)
            num_splits, per_split = split_plan(span, self.partition, self.block_n)
            self._decode.decode_attention(
                output, query, kv_cache, block_table, metadata.seq_lens, num_splits, per_split, kernel_options
            )
        else:
            self._prefill.prefill_attention(
                output,
                query,
                kv_cache,
                block_table,
                metadata.query_start_loc,
                metadata.seq_lens,
                metadata.max_query_len,
                self.block_m,
                kernel_options,
            )
        return output
