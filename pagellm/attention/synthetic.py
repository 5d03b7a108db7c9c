"""Random attention batches over a paged cache, for tests, benchmarks and self-checks.

A batch is described by (new tokens, context length) per sequence; each sequence gets a
random, non-contiguous set of blocks, its cached prefix is filled with random keys/values, and
the slot mapping points the new tokens at the tail of its context.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagellm.attention.backend import AttentionMetadata
from pagellm.attention.kv_quant import KVScales, cache_head_dim, is_quantized, narrow_kv_view, quantize, row_width


@dataclass
class SyntheticBatch:
    query: torch.Tensor  # [T, num_heads, head_dim]
    key: torch.Tensor  # [T, num_kv_heads, head_dim]
    value: torch.Tensor  # [T, num_kv_heads, head_dim]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, row_width]
    metadata: AttentionMetadata
    scale: float
    kv_scales: KVScales = field(default_factory=KVScales)


def make_batch(
    seqs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    cache_dtype: torch.dtype | None = None,
    seed: int = 0,
    spare_blocks: int = 3,
    fill_unused: float = float("nan"),
    kv_scales: KVScales | None = None,
) -> SyntheticBatch:
    """seqs[i] = (q_len, seq_len): sequence i adds q_len tokens and then holds seq_len.

    Unused cache slots hold ``fill_unused`` (NaN by default) so that a backend that reads past
    a context, or into the wrong block, poisons its output instead of passing by luck. The cache
    holds ``cache_dtype`` (default: ``dtype``, the type of queries, keys and values); an 8-bit
    cache holds the keys and values quantized under ``kv_scales``, and in unused slots a large
    finite value where the format has no NaN (int8).
    """
    for q_len, seq_len in seqs:
        if q_len < 0 or seq_len < q_len:
            raise ValueError(f"each sequence needs 0 <= q_len <= seq_len; got {(q_len, seq_len)}")
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-seq_len // block_size) for _, seq_len in seqs]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    # Shuffled ids: sequences' blocks are scattered and out of order in the cache.
    block_ids = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_per_seq, default=0) + 1
    block_table = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    cache_dtype = cache_dtype or dtype
    kv_scales = kv_scales or KVScales()
    # Built in float32 for an 8-bit cache, which is quantized from it at the end.
    build_dtype = torch.float32 if is_quantized(cache_dtype) else cache_dtype
    if cache_dtype == torch.int8 and fill_unused != fill_unused:
        fill_unused = 1e4
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), fill_unused, dtype=build_dtype)
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    slots: list[int] = []
    next_block = 0
    for i, (q_len, seq_len) in enumerate(seqs):
        own = block_ids[next_block:next_block + blocks_per_seq[i]]
        next_block += blocks_per_seq[i]
        block_table[i, : len(own)] = torch.tensor(own, dtype=torch.int32)
        seq_slots = [own[pos // block_size] * block_size + pos % block_size for pos in range(seq_len)]
        cached = seq_slots[: seq_len - q_len]
        if cached:
            index = torch.tensor(cached)
            flat[:, index] = torch.randn(2, len(cached), num_kv_heads, head_dim, generator=gen).to(build_dtype)
        slots.extend(seq_slots[seq_len - q_len:])
    if is_quantized(cache_dtype):
        stored = torch.empty(2, num_blocks, block_size, num_kv_heads, row_width(head_dim, cache_dtype), dtype=cache_dtype)
        stored[0] = quantize(kv_cache[0], cache_dtype, kv_scales.k_scale)
        stored[1] = quantize(kv_cache[1], cache_dtype, kv_scales.v_scale)
        kv_cache = stored
    num_tokens = sum(q_len for q_len, _ in seqs)
    query_start_loc = [0]
    for q_len, _ in seqs:
        query_start_loc.append(query_start_loc[-1] + q_len)
    seq_lens = [seq_len for _, seq_len in seqs]
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=block_table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max((q for q, _ in seqs), default=0),
        max_seq_len=max(seq_lens, default=0),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )
    return SyntheticBatch(
        query=torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(device, dtype),
        key=torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(device, dtype),
        value=torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(device, dtype),
        kv_cache=kv_cache.to(device),
        metadata=metadata,
        scale=head_dim**-0.5,
        kv_scales=kv_scales,
    )


def pad_rows(kv_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_cache`` as a narrower layer's cache inside a wider one's (padded rows; pagellm.worker.kv_cache):
    (the view, the wide contiguous cache of ``num_kv_heads`` x ``head_dim`` a token). The view holds
    ``kv_cache``'s bytes; the rest of each token's row is poisoned with NaN, or with 0x7F bytes in an
    8-bit cache (NaN as fp8 and as an int8 row's float16 scale), so a backend that reads past a
    narrow row, or writes there, shows it."""
    wide = torch.empty(
        (2, *kv_cache.shape[1:3], num_kv_heads, row_width(head_dim, kv_cache.dtype)), dtype=kv_cache.dtype, device=kv_cache.device
    )
    if wide.element_size() == 1:
        wide.view(torch.uint8).fill_(0x7F)
    else:
        wide.fill_(float("nan"))
    view = narrow_kv_view(wide, kv_cache.shape[3], cache_head_dim(kv_cache))
    view.view(torch.uint8).copy_(kv_cache.view(torch.uint8))  # bytes: fp8 has few copy kernels
    return view, wide
