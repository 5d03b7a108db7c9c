"""Triton kernels of the recurrent layers for CUDA tensors (pagellm.kernels.recurrent dispatches here):
the causal conv1d and the gated delta rule, same arguments and semantics as there.

Both run each sequence sequentially in time. The conv kernel is one program per (sequence, channel
block). The gated delta rule is one program per (sequence, value head, block of value columns),
holding its ``[Dk, BV]`` state tile in registers across all the sequence's tokens (FLA's fused
recurrent form): a decode is the one-token update, a prefill the same loop over its tokens, cut
into segments at the checkpoint offsets so the state there can be stored. The chunked (WY/UT)
prefill kernel is not written. Tested on the CPU under ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _sequence(qsl_ptr, slot_ptr, init_ptr, i):
    """Sequence ``i``'s first row, length, slot and whether it starts from its slot's state."""
    a = tl.load(qsl_ptr + i)
    L = tl.load(qsl_ptr + i + 1) - a
    return a, L, tl.load(slot_ptr + i), tl.load(init_ptr + i) != 0


@triton.jit
def _segment_end(cps_ptr, c, cp_end, L, slot):
    """Where segment ``c`` of a sequence ends and the slot its state goes to: checkpoint row ``c``'s
    offset and slot while ``c < cp_end``, then the sequence's end and its own slot (row ``cp_end``
    exists: the host appends one)."""
    is_cp = c < cp_end
    return tl.where(is_cp, tl.load(cps_ptr + c * 3 + 1), L), tl.where(is_cp, tl.load(cps_ptr + c * 3 + 2), slot)


@triton.jit
def _causal_conv1d_kernel(
    out_ptr, x_ptr, w_ptr, bias_ptr, state_ptr, qsl_ptr, slot_ptr, init_ptr, cps_ptr, cp_begin_ptr,
    C,
    K: tl.constexpr, KM1_PAD: tl.constexpr, BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    a, L, slot, has_init = _sequence(qsl_ptr, slot_ptr, init_ptr, i)
    state_base = state_ptr + slot * (K - 1) * C
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros([BLOCK_C], dtype=tl.float32)
    for t in range(0, L):
        acc = bias
        for j in tl.static_range(K):
            pos = cols * 0 + (t - (K - 1) + j)  # a vector, so that the masks are vectors (the interpreter wants them so)
            xv = tl.load(x_ptr + (a + pos) * C + cols, mask=cmask & (pos >= 0), other=0.0).to(tl.float32)
            sv = tl.load(state_base + (K - 1 + pos) * C + cols, mask=cmask & (pos < 0), other=0.0).to(tl.float32)
            sv = tl.where(has_init, sv, 0.0)
            w = tl.load(w_ptr + cols * K + j, mask=cmask, other=0.0).to(tl.float32)
            acc += w * (xv + sv)
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        tl.store(out_ptr + (a + t) * C + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)
    # The K - 1 inputs before each checkpoint offset, then before the end (into the sequence's slot):
    # every read of the initial state comes before the final write, in this program's order.
    rows = tl.arange(0, KM1_PAD)
    cp_begin = tl.load(cp_begin_ptr + i)
    cp_end = tl.load(cp_begin_ptr + i + 1)
    for c in range(cp_begin, cp_end + 1):
        o, dest = _segment_end(cps_ptr, c, cp_end, L, slot)
        pos = o - (K - 1) + rows  # [KM1_PAD]
        m2 = (rows < K - 1)[:, None] & cmask[None, :]
        xv = tl.load(x_ptr + (a + pos)[:, None] * C + cols[None, :], mask=m2 & (pos >= 0)[:, None], other=0.0)
        sv = tl.load(state_base + (K - 1 + pos)[:, None] * C + cols[None, :], mask=m2 & (pos < 0)[:, None], other=0.0)
        sv = tl.where(has_init, sv, 0.0)
        tl.store(state_ptr + dest * (K - 1) * C + rows[:, None] * C + cols[None, :], (xv + sv).to(state_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _gated_delta_rule_kernel(
    out_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, qsl_ptr, slot_ptr, init_ptr, cps_ptr, cp_begin_ptr,
    scale, Hk, Hv, Dk, Dv, GROUP,
    BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr,
):
    i = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // GROUP
    rk = tl.arange(0, BK)
    cv = tl.program_id(2) * BV + tl.arange(0, BV)
    kmask = rk < Dk
    vmask = cv < Dv
    m2 = kmask[:, None] & vmask[None, :]
    a, L, slot, has_init = _sequence(qsl_ptr, slot_ptr, init_ptr, i)
    tile = (h * Dk + rk[:, None]) * Dv + cv[None, :]
    S = tl.load(state_ptr + slot * Hv * Dk * Dv + tile, mask=m2, other=0.0).to(tl.float32)
    S = tl.where(has_init, S, 0.0)
    cp_begin = tl.load(cp_begin_ptr + i)
    cp_end = tl.load(cp_begin_ptr + i + 1)
    begin = L * 0  # an int64 like the offsets it takes in the loop
    # Segments end at each checkpoint offset and at the sequence's end; the state after each is stored.
    for c in range(cp_begin, cp_end + 1):
        end, dest = _segment_end(cps_ptr, c, cp_end, L, slot)
        for t in range(a + begin, a + end):
            q = tl.load(q_ptr + (t * Hk + kh) * Dk + rk, mask=kmask, other=0.0).to(tl.float32)
            k = tl.load(k_ptr + (t * Hk + kh) * Dk + rk, mask=kmask, other=0.0).to(tl.float32)
            if L2NORM:
                q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)
                k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
            q = q * scale
            v = tl.load(v_ptr + (t * Hv + h) * Dv + cv, mask=vmask, other=0.0).to(tl.float32)
            decay = tl.exp(tl.load(g_ptr + t * Hv + h).to(tl.float32))
            b = tl.load(beta_ptr + t * Hv + h).to(tl.float32)
            S = S * decay
            delta = (v - tl.sum(S * k[:, None], axis=0)) * b
            S = S + k[:, None] * delta[None, :]
            o = tl.sum(S * q[:, None], axis=0)
            tl.store(out_ptr + (t * Hv + h) * Dv + cv, o.to(out_ptr.dtype.element_ty), mask=vmask)
        tl.store(state_ptr + dest * Hv * Dk * Dv + tile, S.to(state_ptr.dtype.element_ty), mask=m2)
        begin = end


def _checkpoint_ranges(checkpoints: Optional[torch.Tensor], num_seqs: int, device: torch.device):
    """The checkpoint rows as int64 [M + 1, 3] on the device (a last row of zeros, so that the kernels may
    read row ``cp_end`` unmasked) and each sequence's first row ([N + 1])."""
    if checkpoints is None or checkpoints.numel() == 0:
        cps = torch.zeros((1, 3), dtype=torch.int64, device=device)
        return cps, torch.zeros(num_seqs + 1, dtype=torch.int64, device=device)
    cps = checkpoints.to(device=device, dtype=torch.int64).reshape(-1, 3)
    cps = torch.cat([cps, cps.new_zeros(1, 3)]).contiguous()
    counts = torch.bincount(cps[:-1, 0], minlength=num_seqs)
    begin = torch.zeros(num_seqs + 1, dtype=torch.int64, device=device)
    begin[1:] = counts.cumsum(0)
    return cps, begin


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    conv_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    slot_ids: torch.Tensor,
    has_initial_state: torch.Tensor,
    checkpoints: Optional[torch.Tensor],
    activation: Optional[str] = "silu",
) -> torch.Tensor:
    """pagellm.kernels.recurrent.causal_conv1d in Triton (conv_state contiguous)."""
    T, C = x.shape
    K = weight.shape[1]
    device = x.device
    x = x.contiguous()
    out = torch.empty_like(x)
    num_seqs = slot_ids.numel()
    if num_seqs == 0:
        return out
    cps, cp_begin = _checkpoint_ranges(checkpoints, num_seqs, device)
    block_c = min(256, triton.next_power_of_2(C))
    _causal_conv1d_kernel[(num_seqs, triton.cdiv(C, block_c))](
        out, x, weight.contiguous(), bias if bias is not None else x, conv_state,
        query_start_loc.to(device=device, dtype=torch.int64), slot_ids.to(device=device, dtype=torch.int64),
        has_initial_state.to(device=device, dtype=torch.int32), cps, cp_begin,
        C, K=K, KM1_PAD=triton.next_power_of_2(max(K - 1, 1)), BLOCK_C=block_c, HAS_BIAS=bias is not None,
        SILU=activation is not None,
    )
    return out


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    query_start_loc: torch.Tensor,
    slot_ids: torch.Tensor,
    has_initial_state: torch.Tensor,
    checkpoints: Optional[torch.Tensor],
    scale: float,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """pagellm.kernels.recurrent.gated_delta_rule in Triton (state contiguous, float32 or bfloat16)."""
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1], v.shape[2]
    device = v.device
    out = torch.empty(v.shape, dtype=v.dtype, device=device)
    num_seqs = slot_ids.numel()
    if num_seqs == 0:
        return out
    cps, cp_begin = _checkpoint_ranges(checkpoints, num_seqs, device)
    bk = triton.next_power_of_2(Dk)
    bv = min(32, triton.next_power_of_2(Dv))
    _gated_delta_rule_kernel[(num_seqs, Hv, triton.cdiv(Dv, bv))](
        out, q.contiguous(), k.contiguous(), v.contiguous(), g.float().contiguous(), beta.float().contiguous(), state,
        query_start_loc.to(device=device, dtype=torch.int64), slot_ids.to(device=device, dtype=torch.int64),
        has_initial_state.to(device=device, dtype=torch.int32), cps, cp_begin,
        float(scale), Hk, Hv, Dk, Dv, Hv // Hk,
        BK=bk, BV=bv, L2NORM=bool(use_qk_l2norm),
    )
    return out
