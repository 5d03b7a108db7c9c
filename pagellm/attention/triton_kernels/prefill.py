"""Varlen causal attention for a mixed batch (prefill chunks and decodes) straight from the paged cache.

One program per (query tile, sequence, query head). A sequence's new tokens sit at the end of its
context: with q_len new tokens of a seq_len context, new token i is at position
seq_len - q_len + i and sees every cached position up to its own, so a chunk after a prefix-cache
hit or an earlier chunk attends over the whole computed prefix. Online softmax over KV tiles
gathered through the block table; KV tiles past the tile's last query position are skipped.

AttentionOptions: with a sliding window KV tiles start at the tile's first row's window (keys
before it are never loaded: their blocks may be freed) and each row masks its own; the soft cap
bends the scores before the mask; the sink starts each row's softmax as a score with no value.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from pagellm.attention.kv_quant import FP8_DTYPES
from pagellm.attention.triton_kernels.kv_codec import fp8_unit, kernel_view, kv_format
from pagellm.attention.triton_kernels.kv_loop import attend_kv_tiles, normalize
from pagellm.attention.triton_kernels.scores import LOG2E

_LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(
    q_ptr,
    cache_ptr,
    block_table_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    out_ptr,
    scales_ptr,  # fp8: float32 [k_scale, v_scale], read here so that CUDA graphs see updates
    sinks_ptr,  # float32 [num_heads], read with HAS_SINKS
    qk_scale,  # softmax scale * log2(e)
    window,  # sliding window in tokens, read with HAS_WINDOW
    cap_log2,  # the soft cap times log2(e), read with HAS_CAP
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_tok,
    stride_cache_head,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr,
    KV_FORMAT: tl.constexpr,
    IS_FP8: tl.constexpr,
    FP8_UNIT: tl.constexpr,  # 256 for e4m3 (decode_fp8 leaves it 2^-8 small), 1 for e5m2
    HAS_WINDOW: tl.constexpr,
    HAS_CAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_rows = rows < q_len
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask_dims = dims < HEAD_DIM
    tokens = (q_start + rows).to(tl.int64)
    q = tl.load(
        q_ptr + tokens[:, None] * stride_qt + head * stride_qh + dims[None, :],
        mask=mask_rows[:, None] & mask_dims[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:  # a score with no value
        m_i = tl.full([BLOCK_M], 1.0, tl.float32) * (tl.load(sinks_ptr + head) * LOG2E)
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    # Causal: no query of this tile looks past its last row's position.
    kv_end = tl.minimum(seq_len, prefix + (tile + 1) * BLOCK_M)
    kv_start = 0
    if HAS_WINDOW:
        # Nor before its first row's window.
        kv_start = tl.maximum(prefix + tile * BLOCK_M - window + 1, 0)
    m_i, l_i, acc = attend_kv_tiles(
        q, m_i, l_i, acc, cache_ptr + (head // GROUP) * stride_cache_head, block_table_ptr + seq.to(tl.int64) * stride_bt,
        kv_start, kv_end, prefix + rows, window, qk_scale, scales_ptr, cap_log2, stride_cache_kv, stride_cache_block, stride_cache_tok,
        HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, BLOCK_N, DOT_F32, KV_FORMAT, IS_FP8, FP8_UNIT, HAS_CAP, CAUSAL=True, HAS_WINDOW=HAS_WINDOW,
    )

    out = normalize(acc, l_i, scales_ptr, IS_FP8, FP8_UNIT)
    tl.store(
        out_ptr + tokens[:, None] * stride_ot + head * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask_rows[:, None] & mask_dims[None, :],
    )


def prefill_attention(
    out: torch.Tensor,  # [T, num_heads, head_dim], written
    query: torch.Tensor,  # [T, num_heads, head_dim], last dim contiguous
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, row_width]
    block_table: torch.Tensor,  # int32 [S, max_blocks], last dim contiguous
    query_start_loc: torch.Tensor,  # int32 [S + 1]
    seq_lens: torch.Tensor,  # int32 [S]
    scales: torch.Tensor,  # float32 [k_scale, v_scale] on the device; read for an fp8 cache only
    max_query_len: int,
    scale: float,
    block_m: int,
    block_n: int,
    dot_f32: bool,
    window: Optional[int] = None,  # AttentionOptions, already validated; None: off
    logits_soft_cap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,  # float32 [num_heads] on the device
) -> None:
    num_seqs = seq_lens.shape[0]
    _, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    grid = (triton.cdiv(max_query_len, block_m), num_seqs, num_heads)
    cache = kernel_view(kv_cache)
    _prefill_kernel[grid](
        query,
        cache,
        block_table,
        query_start_loc,
        seq_lens,
        out,
        scales,
        sinks if sinks is not None else scales,  # a placeholder pointer without sinks
        scale * _LOG2E,
        window or 0,
        (logits_soft_cap or 0.0) * _LOG2E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_table.stride(0),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_F32=dot_f32,
        KV_FORMAT=kv_format(kv_cache.dtype),
        IS_FP8=kv_cache.dtype in FP8_DTYPES,
        FP8_UNIT=fp8_unit(kv_cache.dtype),
        HAS_WINDOW=window is not None,
        HAS_CAP=logits_soft_cap is not None,
        HAS_SINKS=sinks is not None,
    )
