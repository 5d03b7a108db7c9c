"""The Mamba-2 selective state scan of hybrid models (Granite 4.0-H, Nemotron-H) over a flat batch of sequences.

Per token ``t`` of a sequence and head ``h`` (``g`` the group of ``h``), in float32::

    dt_t = clamp(softplus(dt[t, h] + dt_bias[h]), *dt_limit)
    S = exp(dt_t * A[h]) * S + dt_t * outer(x[t, h], B[t, g])       # S: [P, N]
    y[t, h] = S @ C[t, g] + D[h] * x[t, h]

(transformers' ``Mamba2Mixer.torch_forward`` / ``mamba2_chunk_scan``). The batch metadata
(``query_start_loc``, ``slot_ids``, ``has_initial_state``, ``checkpoints``) means exactly what it
means for :func:`pagellm.kernels.recurrent.gated_delta_rule`: each sequence reads its initial state
from its slot (zeros without one), writes its final state there, and each checkpoint ``(i, o, s)``
copies the state after ``o`` tokens of sequence ``i`` into slot ``s``.

:func:`selective_state_scan` dispatches like the recurrent ops: the C++ kernel (``csrc/mamba.cpp``,
through :mod:`pagellm.kernels.ops`) for CPU tensors when the library is loaded, the Triton kernel
(:mod:`pagellm.kernels.triton_mamba`) for CUDA tensors, and the torch reference here otherwise.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.nn import functional as F

from pagellm.kernels import ops
from pagellm.kernels.slot_scan import scan_sequences

CHUNK_SIZE = 256


def discretized_dt(dt: torch.Tensor, dt_bias: torch.Tensor, dt_limit: tuple[float, float]) -> torch.Tensor:
    """``clamp(softplus(dt + dt_bias), *dt_limit)`` in float32, ``[T, H]``."""
    return F.softplus(dt.float() + dt_bias.float()).clamp(min=dt_limit[0], max=dt_limit[1])


def _chunk_step(S: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor):
    """One chunk of ``c`` tokens of one sequence in the SSD form (transformers' ``mamba2_chunk_scan``),
    every head at once, the heads of a group sharing its ``C.B`` and reading B and C without copies.

    S [H, P, N]; x [c, H, P]; dt [c, H]; A [H]; B, C [c, G, N] (all float32). Returns (y without the
    D skip [c, H, P], the state after the chunk)."""
    c, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    rep = H // G
    Bg, Cg = B.transpose(0, 1), C.transpose(0, 1)  # [G, c, N]
    xdt = (x * dt[..., None]).permute(1, 0, 2)  # [H, c, P]
    cum = (dt * A).t().cumsum(dim=-1)  # [H, c]
    # decay[h, l, s] = exp(cum[l] - cum[s]) for s <= l (vLLM's and mamba_ssm's chunk-scan kernels take the
    # same difference of cumulative sums in float32).
    upper = torch.ones(c, c, dtype=torch.bool, device=x.device).triu(1)
    decay = (cum[:, :, None] - cum[:, None, :]).masked_fill_(upper, float("-inf")).exp_()
    scores = decay.view(G, rep, c, c).mul_((Cg @ Bg.transpose(-1, -2))[:, None])  # [G, rep, c, c]
    y = scores.view(H, c, c) @ xdt  # within the chunk
    # From the state before the chunk: C_t . S, decayed to token t.
    y_state = (Cg @ S.view(G, rep * P, N).transpose(-1, -2)).view(G, c, rep, P).permute(0, 2, 1, 3).reshape(H, c, P)
    y += y_state * cum.exp()[..., None]
    tail = (cum[:, -1:] - cum).exp()  # [H, c]: decay from each token to the chunk's end
    contrib = (xdt * tail[..., None]).transpose(-1, -2).reshape(G, rep * P, c) @ Bg  # [G, rep * P, N]
    S = S * cum[:, -1].exp()[:, None, None] + contrib.view(H, P, N)
    return y.transpose(0, 1), S


def _check_args(x, dt, A, B, C, D, dt_bias, state, query_start_loc, slot_ids, has_initial_state, chunk_size) -> None:
    if x.dim() != 3:
        raise ValueError(f"selective_state_scan: x must be [T, H, P], got shape {tuple(x.shape)}")
    T, H, P = x.shape
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"selective_state_scan: x must be float32 or bfloat16, got {x.dtype}")
    if tuple(dt.shape) != (T, H):
        raise ValueError(f"selective_state_scan: dt must be [T, H] = {(T, H)}, got {tuple(dt.shape)}")
    for name, t in (("A", A), ("D", D), ("dt_bias", dt_bias)):
        if tuple(t.shape) != (H,):
            raise ValueError(f"selective_state_scan: {name} must be [H] = [{H}], got {tuple(t.shape)}")
    if B.dim() != 3 or B.shape[0] != T or B.shape != C.shape:
        raise ValueError(f"selective_state_scan: B and C must both be [T, G, N] with T = {T}, got {tuple(B.shape)} and {tuple(C.shape)}")
    G, N = B.shape[1], B.shape[2]
    if G == 0 or H % G:
        raise ValueError(f"selective_state_scan: {H} heads are not a multiple of {G} groups")
    if state.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"selective_state_scan: state must be float32 or bfloat16, got {state.dtype}")
    if state.dim() != 4 or tuple(state.shape[1:]) != (H, P, N):
        raise ValueError(f"selective_state_scan: state must be [S, H, P, N] = [S, {H}, {P}, {N}], got {tuple(state.shape)}")
    num_seqs = slot_ids.numel()
    if query_start_loc.numel() != num_seqs + 1 or has_initial_state.numel() != num_seqs:
        raise ValueError("selective_state_scan: query_start_loc must have one more entry than slot_ids and has_initial_state")
    if chunk_size < 1:
        raise ValueError(f"selective_state_scan: chunk_size must be positive, got {chunk_size}")


def selective_state_scan_reference(
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
    chunk_size: int = CHUNK_SIZE,
) -> torch.Tensor:
    """:func:`selective_state_scan` in torch: the one-token update for every 1-token sequence at once,
    the chunked SSD form (``chunk_size`` chunks, also cut at each checkpoint) for each longer one."""
    T, H, P = x.shape
    G = B.shape[1]
    rep = H // G
    xf, Bf, Cf = x.float(), B.float(), C.float()
    Af, Df = A.float(), D.float()
    dtf = discretized_dt(dt, dt_bias, dt_limit)
    out = torch.empty((T, H, P), dtype=torch.float32, device=x.device)

    def decode_step(S: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        # In place on the gathered copy: a batch of decodes is dominated by passes over the states.
        d = dtf[rows]  # [n, H]
        xdt = xf[rows] * d[..., None]  # [n, H, P]
        Bh = Bf[rows].repeat_interleave(rep, dim=1)  # [n, H, N]
        Ch = Cf[rows].repeat_interleave(rep, dim=1)
        S.mul_((d * Af).exp()[..., None, None])
        S.view(-1, P, S.shape[-1]).baddbmm_(xdt.reshape(-1, P, 1), Bh.reshape(-1, 1, Bh.shape[-1]))
        out[rows] = (S @ Ch[..., None])[..., 0]
        return S

    def chunk_step(S: torch.Tensor, sl: slice) -> torch.Tensor:
        out[sl], S = _chunk_step(S, xf[sl], dtf[sl], Af, Bf[sl], Cf[sl])
        return S

    scan_sequences(state, query_start_loc, slot_ids, has_initial_state, checkpoints, chunk_size, decode_step, chunk_step)
    out += Df[:, None] * xf
    return out.to(x.dtype)


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
    chunk_size: int = CHUNK_SIZE,
) -> torch.Tensor:
    """The Mamba-2 selective state scan over each sequence of a flat batch, from and into its state slot.

    ``x`` ``[T, H, P]`` float32 or bfloat16; ``dt`` ``[T, H]`` raw (before ``dt_bias`` and softplus);
    ``A`` (negative), ``D``, ``dt_bias`` ``[H]``; ``B``, ``C`` ``[T, G, N]`` (head ``h`` reads group
    ``h // (H // G)``); ``state`` ``[S, H, P, N]`` float32 or bfloat16 (updated in float32, rounded only
    where it is written). Sums in float32. Writes each sequence's final
    state into its slot and, per checkpoint ``(i, o, s)``, the state after ``o`` tokens into slot ``s``.
    ``chunk_size`` shapes only the torch reference's prefill. Returns ``y`` ``[T, H, P]`` in x's dtype.
    """
    _check_args(x, dt, A, B, C, D, dt_bias, state, query_start_loc, slot_ids, has_initial_state, chunk_size)
    if checkpoints is None:
        checkpoints = torch.empty((0, 3), dtype=torch.int64)
    args = (x, dt, A, B, C, D, dt_bias, state, query_start_loc, slot_ids, has_initial_state, checkpoints,
            (float(dt_limit[0]), float(dt_limit[1])))
    if ops.selective_state_scan_supports(x, state):
        return ops.selective_state_scan(*args)
    if x.device.type == "cuda":
        from pagellm.kernels import triton_mamba

        return triton_mamba.selective_state_scan(*args)
    return selective_state_scan_reference(*args, chunk_size=chunk_size)
