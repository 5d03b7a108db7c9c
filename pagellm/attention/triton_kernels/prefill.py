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

import torch
import triton
import triton.language as tl

from pagellm.attention.triton_kernels.kv_codec import kernel_view
from pagellm.attention.triton_kernels.kv_loop import KernelOptions, attend_kv_tiles, normalize
from pagellm.attention.triton_kernels.scores import LOG2E


@triton.jit
def _prefill_kernel(
    q_ptr,
    cache_ptr,
    block_table_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    out_ptr,
    # KernelOptions.launch_args: runtime arguments, then (after this kernel's own) compile-time switches.
    scales_ptr, sinks_ptr, qk_scale, window, cap_log2,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cache_kv, stride_cache_block, stride_cache_tok, stride_cache_head, stride_bt,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr, KV_FORMAT: tl.constexpr, IS_FP8: tl.constexpr, FP8_UNIT: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_CAP: tl.constexpr, HAS_SINKS: tl.constexpr,
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
    max_query_len: int,
    block_m: int,
    options: KernelOptions,
) -> None:
    num_seqs = seq_lens.shape[0]
    num_heads = query.shape[1]
    args, constexprs = options.launch_args(out, query, kv_cache, block_table)
    _prefill_kernel[(triton.cdiv(max_query_len, block_m), num_seqs, num_heads)](
        query,
        kernel_view(kv_cache),
        block_table,
        query_start_loc,
        seq_lens,
        out,
        *args,
        GROUP=num_heads // kv_cache.shape[3],
        BLOCK_M=block_m,
        **constexprs,
    )
