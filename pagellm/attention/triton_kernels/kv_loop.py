"""What the decode and prefill kernels share: the loop over a sequence's KV tiles, and their launch arguments.

Both kernels hold a tile of query rows (decode: the query heads of one kv head's GQA group at one
token; prefill: one query head's rows at consecutive tokens) and run the same online softmax over
the keys ``kv_start ... kv_end - 1`` of one sequence and kv head, gathered from the paged cache
through the block table, decoded in registers (kv_codec) and scored in base 2.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from pagellm.attention.kv_quant import FP8_DTYPES
from pagellm.attention.triton_kernels.kv_codec import FORMAT_INT8, fp8_unit, kv_format, load_int8_row_scale, load_kv
from pagellm.attention.triton_kernels.scores import LOG2E, soft_cap


@triton.jit
def attend_kv_tiles(
    q,  # [rows, HEAD_DIM_PAD], the query tile as loaded
    m_i,  # [rows] float32: the running max (base 2), -inf or a sink's score to start
    l_i,  # [rows] float32: the running softmax sum, 0 or 1 (a sink) to start
    acc,  # [rows, HEAD_DIM_PAD] float32: the running weighted sum of values, 0 to start
    k_base,  # the cache's K rows of this kv head
    table,  # this sequence's block-table row
    kv_start,
    kv_end,  # the keys at positions kv_start ... kv_end - 1, every one in the context
    q_pos,  # [rows] int: each row's position, read with CAUSAL
    window,  # read with CAUSAL and HAS_WINDOW
    qk_scale,  # softmax scale * log2(e)
    scales_ptr,  # fp8: float32 [k_scale, v_scale], read with IS_FP8
    cap_log2,  # the soft cap times log2(e), read with HAS_CAP
    stride_cache_kv,
    stride_cache_block,
    stride_cache_tok,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr,
    KV_FORMAT: tl.constexpr,
    IS_FP8: tl.constexpr,
    FP8_UNIT: tl.constexpr,
    HAS_CAP: tl.constexpr,
    CAUSAL: tl.constexpr,  # each row masks the keys after its q_pos (and, with HAS_WINDOW, before its window)
    HAS_WINDOW: tl.constexpr,
):
    """The online softmax over the keys' tiles: returns the updated (m_i, l_i, acc).

    Without CAUSAL every row sees every key in the range (a decode: its one position is the
    context's last, and its range starts at its window); with it, rows that see no key yet stay
    NaN-free (m_i -inf, l_i 0).
    """
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask_dims = dims < HEAD_DIM
    if DOT_F32:
        q = q.to(tl.float32)
    if IS_FP8:
        # fp8's per-layer scales fold into the scores (here) and the output (normalize).
        qk_scale = qk_scale * (tl.load(scales_ptr) * FP8_UNIT)
    for start_n in range(kv_start, kv_end, BLOCK_N):
        pos = start_n + tl.arange(0, BLOCK_N)
        in_context = pos < kv_end
        block = tl.load(table + pos // BLOCK_SIZE, mask=in_context, other=0).to(tl.int64)
        slot = block * stride_cache_block + (pos % BLOCK_SIZE) * stride_cache_tok
        kv_mask = in_context[:, None] & mask_dims[None, :]
        # other=0: slots past the context may hold anything (even NaN), and 0 * NaN would leak.
        k_row = k_base + slot
        k = load_kv(k_row[:, None] + dims[None, :], kv_mask, q.dtype, KV_FORMAT)
        v = load_kv(k_row[:, None] + stride_cache_kv + dims[None, :], kv_mask, q.dtype, KV_FORMAT)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        if KV_FORMAT == FORMAT_INT8:
            s = s * load_int8_row_scale(k_row, in_context, HEAD_DIM)[None, :]
        if HAS_CAP:
            s = soft_cap(s, cap_log2)
        visible = in_context[None, :]
        if CAUSAL:
            visible = visible & (pos[None, :] <= q_pos[:, None])
            if HAS_WINDOW:
                visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = m_new
        if CAUSAL:
            # Padding rows past q_len (or rows before their window) may see nothing yet; keep their arithmetic NaN-free.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if KV_FORMAT == FORMAT_INT8:
            # l_i sums the softmax weights; the dot takes them times each value row's scale.
            p = p * load_int8_row_scale(k_row + stride_cache_kv, in_context, HEAD_DIM)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def normalize(acc, l_i, scales_ptr, IS_FP8: tl.constexpr, FP8_UNIT: tl.constexpr):
    """The rows' attention output: the weighted sum over the softmax sum (0 where that is 0), times
    fp8's v scale."""
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if IS_FP8:
        out = out * (tl.load(scales_ptr + 1) * FP8_UNIT)
    return out


@dataclass(frozen=True)
class KernelOptions:
    """What the backend passes the decode and prefill kernels alike."""

    scales: torch.Tensor  # float32 [k_scale, v_scale] on the device; read for an fp8 cache only
    scale: float  # the softmax scale
    block_n: int  # KV tokens per tile
    dot_f32: bool  # take the dot products in float32 (the interpreter gets bf16 ones wrong)
    window: Optional[int] = None  # AttentionOptions, already validated; None: off
    logits_soft_cap: Optional[float] = None
    sinks: Optional[torch.Tensor] = None  # float32 [num_heads] on the device

    def launch_args(
        self, out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor
    ) -> tuple[tuple, dict]:
        """The arguments both kernels take, as (runtime arguments, compile-time switches).

        The runtime ones follow each kernel's own, in this order: ``scales_ptr`` (fp8's scales, read in
        the kernel so that CUDA graphs see updates), ``sinks_ptr`` (read with HAS_SINKS), ``qk_scale``
        (the softmax scale times log2(e): the kernels work in base 2), ``window`` (read with HAS_WINDOW),
        ``cap_log2`` (the soft cap times log2(e), read with HAS_CAP), then the strides of the query and
        output (token, head), of the cache (K/V, block, token, head) and of the block table (sequence).
        """
        scales, window, cap, sinks = self.scales, self.window, self.logits_soft_cap, self.sinks
        args = (
            scales,
            sinks if sinks is not None else scales,  # a placeholder pointer without sinks
            self.scale * LOG2E.value,
            window or 0,
            (cap or 0.0) * LOG2E.value,
            *query.stride()[:2],
            *out.stride()[:2],
            *kv_cache.stride()[:4],
            block_table.stride(0),
        )
        head_dim = query.shape[2]
        constexprs = dict(
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
            BLOCK_SIZE=kv_cache.shape[2],
            BLOCK_N=self.block_n,
            DOT_F32=self.dot_f32,
            KV_FORMAT=kv_format(kv_cache.dtype),
            IS_FP8=kv_cache.dtype in FP8_DTYPES,
            FP8_UNIT=fp8_unit(kv_cache.dtype),  # 256 for e4m3 (decode_fp8 leaves it 2^-8 small), 1 for e5m2
            HAS_WINDOW=window is not None,
            HAS_CAP=cap is not None,
            HAS_SINKS=sinks is not None,
        )
        return args, constexprs
