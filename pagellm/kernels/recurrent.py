"""The recurrent layers' kernels for hybrid models (Qwen3-Next / Qwen3.5 Gated DeltaNet): the
short causal convolution and the gated delta rule over a flat batch of sequences.

Every sequence of the batch keeps its state in one slot of a per-layer state tensor; the per-step
metadata is shared by all recurrent layers of a step:

- ``query_start_loc`` int32 ``[N + 1]``: sequence ``i`` is rows ``query_start_loc[i]:query_start_loc[i + 1]``
  of the flat batch (0 rows allowed);
- ``slot_ids`` int64 ``[N]``: the slot read as sequence ``i``'s initial state and overwritten with its final state;
- ``has_initial_state`` bool ``[N]``: False starts from a zero state (the slot is not read, still written);
- ``checkpoints`` int64 ``[M, 3]``: rows ``(i, o, s)``, ``1 <= o <= len_i``, sorted by ``(i, o)``: the state
  after the first ``o`` tokens of sequence ``i`` is also copied into slot ``s``.

A slot written in a call (a final or a checkpoint slot) must not be another sequence's initial
slot in the same call: the sequences run in parallel.

Each op dispatches on where its tensors are: the C++ kernels (``csrc/recurrent.cpp``, through
:mod:`pagellm.kernels.ops`) for CPU tensors when the library is loaded, the Triton kernels
(:mod:`pagellm.kernels.triton_recurrent`) for CUDA tensors, and the torch reference here otherwise.
The references are also the tests' oracle.

The C++ gated delta rule runs every sequence sequentially in time, with the state tiled over its
value columns (the delta rule keeps them independent): a ``Dk x 2 vectors`` tile stays in L1 over the
whole sequence and each token costs one fused pass over it. On the development CPU this sequential
form ran a 4096-token prefill at Qwen3.5-2B's shapes faster than the chunked (WY/UT, 64-token chunks)
form of the torch reference on BLAS matmuls, so no chunked C++ form was written
(``python -m pagellm.bench.recurrent_bench``; figures in docs/kernels.md).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.nn import functional as F

from pagellm.kernels import ops
from pagellm.kernels.slot_scan import checkpoints_by_sequence, scan_sequences

CHUNK_SIZE = 64


def _activate(x: torch.Tensor, activation: Optional[str]) -> torch.Tensor:
    if activation is None:
        return x
    if activation in ("silu", "swish"):
        return F.silu(x)
    raise ValueError(f"causal_conv1d: unknown activation {activation!r} (silu or None)")


def causal_conv1d_reference(
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
    """:func:`causal_conv1d` in torch: one depthwise ``conv1d`` per sequence over its initial state and its tokens."""
    T, C = x.shape
    K = weight.shape[1]
    out = torch.empty_like(x)
    w = weight.float().unsqueeze(1)  # [C, 1, K]
    b = None if bias is None else bias.float()
    starts = query_start_loc.tolist()
    slots = slot_ids.tolist()
    initial = has_initial_state.tolist()
    cps = checkpoints_by_sequence(checkpoints, len(slots))
    for i, slot in enumerate(slots):
        a, e = starts[i], starts[i + 1]
        init = conv_state[slot].float() if initial[i] else x.new_zeros((K - 1, C), dtype=torch.float32)
        xin = torch.cat([init, x[a:e].float()])  # [K - 1 + L, C]: row K - 1 + t is token t
        if e > a:
            y = F.conv1d(xin.t().unsqueeze(0), w, b, groups=C)[0]  # [C, L]
            out[a:e] = _activate(y, activation).t().to(x.dtype)
        for o, s in cps[i]:
            conv_state[s] = xin[o:o + K - 1].to(conv_state.dtype)
        conv_state[slot] = xin[e - a:e - a + K - 1].to(conv_state.dtype)
    return out


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int, scale: float, use_qk_l2norm: bool):
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * scale
    group = num_v_heads // k.shape[1]
    if group != 1:
        q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    return q, k  # [T, Hv, Dk] float32


def _chunk_step(S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor):
    """One chunk of ``c`` tokens in the WY/UT form (transformers' ``torch_chunk_gated_delta_rule``).

    S [H, Dk, Dv]; q, k [H, c, Dk]; v [H, c, Dv]; g, beta [H, c]. Returns (out [H, c, Dv], new S)."""
    c = q.shape[1]
    k_beta = k * beta.unsqueeze(-1)
    v_beta = v * beta.unsqueeze(-1)
    cum = g.cumsum(dim=-1)  # [H, c]
    upper = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()  # [H, c, c]
    ut = (k_beta @ k.transpose(-1, -2)) * decay
    intra = (q @ k.transpose(-1, -2)) * decay
    cum_exp = cum.exp().unsqueeze(-1)
    rhs = torch.cat([v_beta, k_beta * cum_exp], dim=-1)
    sol = torch.linalg.solve_triangular(ut, rhs, upper=False, unitriangular=True)
    new_values, k_cumdecay = sol[..., : v.shape[-1]], sol[..., v.shape[-1]:]
    v_new = new_values - k_cumdecay @ S
    out = (q * cum_exp) @ S + intra @ v_new
    k_tail = k * (cum[:, -1:] - cum).exp().unsqueeze(-1)
    S = S * cum[:, -1].exp()[:, None, None] + k_tail.transpose(-1, -2) @ v_new
    return out, S


def _recurrent_step(S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor):
    """One token for a batch of states: S [B, H, Dk, Dv]; q, k [B, H, Dk]; v [B, H, Dv]; g, beta [B, H]."""
    S = S * g.exp()[..., None, None]
    kv_mem = (S * k.unsqueeze(-1)).sum(dim=-2)
    delta = (v - kv_mem) * beta.unsqueeze(-1)
    S = S + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return (S * q.unsqueeze(-1)).sum(dim=-2), S


def gated_delta_rule_reference(
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
    """:func:`gated_delta_rule` in torch: the one-token update for every 1-token sequence at once, the
    chunked form (64-token chunks, also cut at each checkpoint) for each longer one, all heads at once."""
    Hv = v.shape[1]
    qf, kf = _prepare_qk(q, k, Hv, scale, use_qk_l2norm)
    vf, gf, bf = v.float(), g.float(), beta.float()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)

    def decode_step(S: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        o, S = _recurrent_step(S, qf[rows], kf[rows], vf[rows], gf[rows], bf[rows])
        out[rows] = o
        return S

    def chunk_step(S: torch.Tensor, sl: slice) -> torch.Tensor:
        o, S = _chunk_step(S, qf[sl].transpose(0, 1), kf[sl].transpose(0, 1), vf[sl].transpose(0, 1), gf[sl].t(), bf[sl].t())
        out[sl] = o.transpose(0, 1)
        return S

    scan_sequences(state, query_start_loc, slot_ids, has_initial_state, checkpoints, CHUNK_SIZE, decode_step, chunk_step)
    return out.to(v.dtype)


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
    """Depthwise causal convolution over each sequence of a flat batch, continuing from its conv state.

    ``x`` ``[T, C]`` float32 or bfloat16 (a column slice of a wider tensor is read in place); ``weight``
    ``[C, K]``; ``bias`` ``[C]`` or None; ``conv_state`` ``[S, K - 1, C]`` in x's dtype, each slot the
    last ``K - 1`` inputs, oldest first.
    ``out[t, c] = act(bias[c] + sum_j weight[c, j] * xin[t - (K - 1) + j, c])``, inputs before a sequence's
    first token read from its initial state (zeros without one), sums in float32; ``activation`` "silu" or
    None. Writes each sequence's last ``K - 1`` inputs into its slot and, per checkpoint ``(i, o, s)``, the
    ``K - 1`` inputs before offset ``o`` into slot ``s``. Returns ``out`` ``[T, C]`` in x's dtype.
    """
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"causal_conv1d: unknown activation {activation!r} (silu or None)")
    if checkpoints is None:
        checkpoints = torch.empty((0, 3), dtype=torch.int64)
    if ops.causal_conv1d_supports(x, weight, conv_state):
        return ops.causal_conv1d(x, weight, bias, conv_state, query_start_loc, slot_ids, has_initial_state, checkpoints, activation)
    if x.device.type == "cuda":
        from pagellm.kernels import triton_recurrent

        return triton_recurrent.causal_conv1d(
            x, weight, bias, conv_state, query_start_loc, slot_ids, has_initial_state, checkpoints, activation
        )
    return causal_conv1d_reference(x, weight, bias, conv_state, query_start_loc, slot_ids, has_initial_state, checkpoints, activation)


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
    """The gated delta rule over each sequence of a flat batch, from and into its state slot.

    ``q``, ``k`` ``[T, Hk, Dk]``, ``v`` ``[T, Hv, Dv]`` (float32 or bfloat16; v head ``h`` reads q/k head
    ``h // (Hv // Hk)``), ``g`` ``[T, Hv]`` float32 log decay, ``beta`` ``[T, Hv]`` float32 (already a
    sigmoid), ``state`` ``[S, Hv, Dk, Dv]`` float32 or bfloat16 (a state is updated in float32 and
    rounded only where it is written: a slot or a checkpoint). With ``use_qk_l2norm`` q and k are L2-normalised
    over Dk (eps 1e-6), then q is multiplied by ``scale``. Per token: ``S *= exp(g)``; ``delta = (v - k.S) * beta``;
    ``S += k delta^T``; ``o = q.S`` (transformers' ``torch_recurrent_gated_delta_rule``), sums in float32.
    Writes each sequence's final state into its slot and, per checkpoint ``(i, o, s)``, the state after
    ``o`` tokens into slot ``s``. Returns ``out`` ``[T, Hv, Dv]`` in v's dtype.
    """
    if checkpoints is None:
        checkpoints = torch.empty((0, 3), dtype=torch.int64)
    if v.shape[1] % k.shape[1]:
        raise ValueError(f"gated_delta_rule: {v.shape[1]} value heads are not a multiple of {k.shape[1]} key heads")
    args = (q, k, v, g, beta, state, query_start_loc, slot_ids, has_initial_state, checkpoints, float(scale), bool(use_qk_l2norm))
    if ops.gated_delta_rule_supports(q, k, v, state):
        return ops.gated_delta_rule(*args)
    if v.device.type == "cuda":
        from pagellm.kernels import triton_recurrent

        return triton_recurrent.gated_delta_rule(*args)
    return gated_delta_rule_reference(*args)
