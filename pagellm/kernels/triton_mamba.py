"""The Mamba-2 selective state scan in Triton for CUDA tensors (pagellm.kernels.mamba dispatches here),
same arguments and semantics as there.

One program per (sequence, head, block of state rows) runs the sequence sequentially in time with its
``[BP, N]`` state tile in registers (the rows of a head's state are independent): a decode is the
one-token update, a prefill the same loop over its tokens, cut into segments at the checkpoint
offsets so the state there can be stored (as the gated delta rule's kernel in triton_recurrent.py).
The chunked (SSD) prefill kernel is not written. Tested on the CPU under ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from pagellm.kernels.triton_recurrent import _checkpoint_ranges, _segment_end, _sequence


@triton.jit
def _selective_state_scan_kernel(
    out_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, state_ptr, qsl_ptr, slot_ptr, init_ptr, cps_ptr,
    cp_begin_ptr,
    x_stride, dt_stride, bc_stride, H, P, N, GROUP, dt_min, dt_max,
    BP: tl.constexpr, BN: tl.constexpr,
):
    i = tl.program_id(0)
    h = tl.program_id(1)
    g = h // GROUP
    rp = tl.program_id(2) * BP + tl.arange(0, BP)
    rn = tl.arange(0, BN)
    pmask = rp < P
    nmask = rn < N
    m2 = pmask[:, None] & nmask[None, :]
    a, L, slot, has_init = _sequence(qsl_ptr, slot_ptr, init_ptr, i)
    tile = (h * P + rp[:, None]) * N + rn[None, :]
    S = tl.load(state_ptr + slot * H * P * N + tile, mask=m2, other=0.0).to(tl.float32)
    S = tl.where(has_init, S, 0.0)
    A = tl.load(A_ptr + h).to(tl.float32)
    D = tl.load(D_ptr + h).to(tl.float32)
    bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    cp_begin = tl.load(cp_begin_ptr + i)
    cp_end = tl.load(cp_begin_ptr + i + 1)
    begin = L * 0  # an int64 like the offsets it takes in the loop
    # Segments end at each checkpoint offset and at the sequence's end; the state after each is stored.
    for c in range(cp_begin, cp_end + 1):
        end, dest = _segment_end(cps_ptr, c, cp_end, L, slot)
        for t in range(a + begin, a + end):
            v = tl.load(dt_ptr + t * dt_stride + h).to(tl.float32) + bias
            dtv = tl.where(v > 20.0, v, tl.log(1.0 + tl.exp(tl.minimum(v, 20.0))))  # torch's softplus
            dtv = tl.minimum(tl.maximum(dtv, dt_min), dt_max)
            x = tl.load(x_ptr + t * x_stride + h * P + rp, mask=pmask, other=0.0).to(tl.float32)
            b = tl.load(B_ptr + t * bc_stride + g * N + rn, mask=nmask, other=0.0).to(tl.float32)
            cc = tl.load(C_ptr + t * bc_stride + g * N + rn, mask=nmask, other=0.0).to(tl.float32)
            S = S * tl.exp(dtv * A) + (x * dtv)[:, None] * b[None, :]
            y = tl.sum(S * cc[None, :], axis=1) + D * x
            tl.store(out_ptr + (t * H + h) * P + rp, y.to(out_ptr.dtype.element_ty), mask=pmask)
        tl.store(state_ptr + dest * H * P * N + tile, S.to(state_ptr.dtype.element_ty), mask=m2)
        begin = end


def _rows_of(t: torch.Tensor) -> torch.Tensor:
    """``t`` ``[T, a, b]`` with its ``[a, b]`` part contiguous (any token stride: the layer's split views)."""
    return t if t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] else t.contiguous()


def selective_state_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    query_start_loc: torch.Tensor,
    slot_ids: torch.Tensor,
    has_initial_state: torch.Tensor,
    checkpoints: Optional[torch.Tensor],
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> torch.Tensor:
    """pagellm.kernels.mamba.selective_state_scan in Triton (state contiguous, float32 or bfloat16)."""
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    device = x.device
    out = torch.empty((T, H, P), dtype=x.dtype, device=device)
    num_seqs = slot_ids.numel()
    if num_seqs == 0:
        return out
    x = _rows_of(x)
    if B.dtype != C.dtype or B.stride() != C.stride():
        B, C = B.float().contiguous(), C.float().contiguous()
    B, C = _rows_of(B), _rows_of(C)
    if dt.stride(-1) != 1:
        dt = dt.contiguous()
    cps, cp_begin = _checkpoint_ranges(checkpoints, num_seqs, device)
    bn = triton.next_power_of_2(N)
    bp = max(1, min(triton.next_power_of_2(P), 4096 // bn))  # a [BP, BN] tile of at most 4096 floats
    _selective_state_scan_kernel[(num_seqs, H, triton.cdiv(P, bp))](
        out, x, dt, A.float().contiguous(), B, C, D.float().contiguous(), dt_bias.float().contiguous(), state,
        query_start_loc.to(device=device, dtype=torch.int64), slot_ids.to(device=device, dtype=torch.int64),
        has_initial_state.to(device=device, dtype=torch.int32), cps, cp_begin,
        x.stride(0), dt.stride(0), B.stride(0), H, P, N, H // G, float(dt_limit[0]), float(dt_limit[1]),
        BP=bp, BN=bn,
    )
    return out
