"""The Mamba-2 selective state scan (pagellm.kernels.mamba): the torch reference against a naive per-token
loop and transformers' Mamba-2 functions, the C++ kernel against the loop (float32 and bfloat16)."""
from __future__ import annotations

import os

# transformers imports triton, whose helpers take the interpreter only if TRITON_INTERPRET is set first
# (see test_recurrent.py).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from slot_batch_utils import batch_meta
from torch.nn import functional as F
from transformers.models.mamba2 import modeling_mamba2 as hf

from pagellm.kernels import mamba, ops

# Decodes, short and long prefills (past one and two 16-token chunks), a zero-length sequence.
LENGTHS = [1, 5, 0, 16, 17, 1, 40, 1]
# Checkpoints at chunk boundaries (16, 32), mid-chunk, at offset 1 and at the end; two on one offset.
CHECKPOINTS = {0: [1], 1: [1, 3, 5], 3: [16], 4: [7, 16, 17], 6: [15, 16, 16, 32, 33, 40]}
NO_LIMIT = (0.0, float("inf"))


def naive_scan(x, dt, A, B, C, D, dt_bias, state, query_start_loc, slot_ids, has_initial_state, checkpoints, dt_limit=NO_LIMIT):
    """The recurrence token by token, in float64: the oracle."""
    T, H, P = x.shape
    rep = H // B.shape[1]
    d = F.softplus(dt.double() + dt_bias.double()).clamp(min=dt_limit[0], max=dt_limit[1])
    xd, Bh, Ch = x.double(), B.double().repeat_interleave(rep, 1), C.double().repeat_interleave(rep, 1)
    y = torch.zeros(T, H, P, dtype=torch.float64)
    starts = query_start_loc.tolist()
    cps = [] if checkpoints is None else checkpoints.tolist()
    new_slots = {}
    for i, slot in enumerate(slot_ids.tolist()):
        S = state[slot].double() if has_initial_state[i] else torch.zeros(state.shape[1:], dtype=torch.float64)
        for t in range(starts[i], starts[i + 1]):
            dA = (d[t] * A.double()).exp()  # [H]
            S = dA[:, None, None] * S + (d[t][:, None] * xd[t])[..., None] * Bh[t][:, None, :]
            y[t] = (S @ Ch[t][..., None])[..., 0] + D.double()[:, None] * xd[t]
            for ci, o, s in cps:
                if ci == i and o == t + 1 - starts[i]:
                    new_slots[s] = S.float()
        new_slots[slot] = S.float()
    for s, value in new_slots.items():
        state[s] = value
    return y


def _inputs(lengths, H, G, P, N, seed=0, dtype=torch.float32, bc_dtype=None):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    x = torch.randn(T, H, P, generator=gen).to(dtype)
    dt = (torch.randn(T, H, generator=gen) - 1.0).to(dtype)
    A = -torch.exp(torch.rand(H, generator=gen) * 2.0)
    B = (torch.randn(T, G, N, generator=gen) * 0.5).to(bc_dtype or dtype)
    C = (torch.randn(T, G, N, generator=gen) * 0.5).to(bc_dtype or dtype)
    D = torch.randn(H, generator=gen)
    dt_bias = torch.randn(H, generator=gen) * 0.5
    return x, dt, A, B, C, D, dt_bias


def assert_states_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32 states to 1e-4; bfloat16 ones (each the rounding of nearly equal sums) to one unit in the last place."""
    assert got.dtype == want.dtype
    tol = 1e-4 if got.dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=1e-4)


def _check_against_naive(fn, lengths, H, G, P, N, dtype=torch.float32, dt_limit=NO_LIMIT, seed=0, tol=None,
                         state_dtype=torch.float32, **kw):
    """With a bfloat16 ``state_dtype`` the loop, too, reads the rounded slots and rounds only where it
    writes, so float32 outputs still agree to 1e-4."""
    num_slots = 2 * len(lengths) + sum(len(v) for v in CHECKPOINTS.values())
    x, dt, A, B, C, D, dt_bias = _inputs(lengths, H, G, P, N, seed=seed, dtype=dtype)
    qsl, slots, has_init, cps = batch_meta(lengths, num_slots, seed=seed + 1, checkpoint_offsets=CHECKPOINTS, cold_every=3)
    state0 = (torch.randn(num_slots, H, P, N, generator=torch.Generator().manual_seed(seed + 2)) * 0.3).to(state_dtype)
    ref_state, state = state0.clone(), state0.clone()
    ref = naive_scan(x, dt, A, B, C, D, dt_bias, ref_state, qsl, slots, has_init, cps, dt_limit)
    y = fn(x, dt, A, B, C, D, dt_bias, state, qsl, slots, has_init, cps, dt_limit=dt_limit, **kw)
    assert y.dtype == dtype and y.shape == x.shape
    tol = tol or (1e-4 if dtype == torch.float32 else 2e-2)
    torch.testing.assert_close(y.float(), ref.float().to(dtype).float(), rtol=tol, atol=tol)
    # Every slot: the written ones hold their states, the others are untouched.
    assert_states_close(state, ref_state)
    written = set(slots.tolist()) | set(cps[:, 2].tolist())
    for s in range(num_slots):
        if s not in written:
            assert torch.equal(state[s], state0[s]), f"slot {s} was written"
    return state


@pytest.mark.parametrize("G", [1, 2])
@pytest.mark.parametrize("dt_limit", [NO_LIMIT, (0.05, 0.4)])
def test_reference_matches_naive(G, dt_limit):
    _check_against_naive(mamba.selective_state_scan_reference, LENGTHS, H=4, G=G, P=8, N=12, dt_limit=dt_limit, chunk_size=16)


def test_reference_matches_transformers():
    """Whole sequences through transformers' mamba2_chunk_scan (prefill) and mamba2_selective_state_update (decode)."""
    H, G, P, N, L = 4, 2, 8, 16, 37
    x, dt, A, B, C, D, dt_bias = _inputs([L + 1], H, G, P, N, seed=5)
    state = torch.zeros(1, H, P, N)
    qsl, one, init = torch.tensor([0, L], dtype=torch.int32), torch.tensor([0]), torch.tensor([False])
    y = mamba.selective_state_scan_reference(x[:L], dt[:L], A, B[:L], C[:L], D, dt_bias, state, qsl, one, init, None, chunk_size=8)
    ref_y, ref_state = hf.mamba2_chunk_scan(x[None, :L], dt[None, :L], A, B[None, :L], C[None, :L], 16, D=D, dt_bias=dt_bias,
                                            dt_softplus=True, return_final_states=True)
    torch.testing.assert_close(y, ref_y[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state[0], ref_state[0], rtol=1e-4, atol=1e-4)
    # One more token, from that state.
    hf_state = ref_state.clone()
    ref_y = hf.mamba2_selective_state_update(
        hf_state, x[L:], dt[L:, :, None].expand(1, H, P), A[:, None, None].expand(H, P, N), B[L:], C[L:],
        D=D[:, None].expand(H, P), dt_bias=dt_bias[:, None].expand(H, P), dt_softplus=True,
    )
    y = mamba.selective_state_scan_reference(x[L:], dt[L:], A, B[L:], C[L:], D, dt_bias, state, torch.tensor([0, 1], dtype=torch.int32),
                                             one, torch.tensor([True]), None)
    torch.testing.assert_close(y, ref_y, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, hf_state, rtol=1e-4, atol=1e-4)


def test_dispatch_checks_shapes():
    x, dt, A, B, C, D, dt_bias = _inputs([3], H=4, G=3, P=2, N=5)
    meta = (torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0]), torch.tensor([False]), None)
    with pytest.raises(ValueError, match="multiple of 3 groups"):
        mamba.selective_state_scan(x, dt, A, B, C, D, dt_bias, torch.zeros(1, 4, 2, 5), *meta)
    x, dt, A, B, C, D, dt_bias = _inputs([3], H=4, G=2, P=2, N=5)
    with pytest.raises(ValueError, match="state must be float32 or bfloat16"):
        mamba.selective_state_scan(x, dt, A, B, C, D, dt_bias, torch.zeros(1, 4, 2, 5, dtype=torch.float16), *meta)
    with pytest.raises(ValueError, match="state must be"):
        mamba.selective_state_scan(x, dt, A, B, C, D, dt_bias, torch.zeros(1, 4, 5, 2), *meta)
    with pytest.raises(ValueError, match="dt must be"):
        mamba.selective_state_scan(x, dt[:, :2], A, B, C, D, dt_bias, torch.zeros(1, 4, 2, 5), *meta)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_dispatch_runs(state_dtype):
    _check_against_naive(mamba.selective_state_scan, LENGTHS, H=4, G=2, P=8, N=12, state_dtype=state_dtype)


# --- C++ against the naive loop -------------------------------------------------------------------

needs_cpp = pytest.mark.skipif(not ops._mamba_ops_loaded(), reason="C++ Mamba-2 kernel unavailable")


@needs_cpp
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4, 1, 8, 12), (6, 3, 40, 16), (2, 2, 64, 128)])
def test_cpp_matches_naive(dtype, shape, state_dtype):
    H, G, P, N = shape
    x = torch.zeros(1, H, P, dtype=dtype)
    assert ops.selective_state_scan_supports(x, torch.zeros(1, H, P, N, dtype=state_dtype))
    _check_against_naive(mamba.selective_state_scan, LENGTHS, H=H, G=G, P=P, N=N, dtype=dtype, state_dtype=state_dtype)


@needs_cpp
def test_cpp_dt_limit_and_strided_inputs():
    """dt clamped; x, dt, B and C as views into one projection (the layer's split), B and C in bfloat16."""
    H, G, P, N = 4, 2, 8, 12
    x, dt, A, B, C, D, dt_bias = _inputs(LENGTHS, H, G, P, N, seed=3)
    T = x.shape[0]
    packed = torch.cat([x.reshape(T, -1), B.reshape(T, -1), C.reshape(T, -1), dt], dim=1)
    xv = packed[:, : H * P].view(T, H, P)
    Bv = packed[:, H * P: H * P + G * N].view(T, G, N).to(torch.bfloat16)
    Cv = packed[:, H * P + G * N: H * P + 2 * G * N].view(T, G, N)
    dtv = packed[:, -H:]
    num_slots = 40
    qsl, slots, has_init, cps = batch_meta(LENGTHS, num_slots, seed=4, checkpoint_offsets=CHECKPOINTS, cold_every=3)
    state0 = torch.randn(num_slots, H, P, N) * 0.3
    ref_state, state = state0.clone(), state0.clone()
    limit = (0.05, 0.4)
    ref = naive_scan(x, dt, A, Bv.float(), C, D, dt_bias, ref_state, qsl, slots, has_init, cps, limit)
    y = mamba.selective_state_scan(xv, dtv, A, Bv, Cv, D, dt_bias, state, qsl, slots, has_init, cps, dt_limit=limit)
    torch.testing.assert_close(y, ref.float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, ref_state, rtol=1e-4, atol=1e-4)


@needs_cpp
def test_cpp_zero_state_ignores_slot_contents():
    H, G, P, N = 2, 1, 8, 16
    x, dt, A, B, C, D, dt_bias = _inputs([1, 9, 0], H, G, P, N)
    state = torch.full((3, H, P, N), float("nan"))
    y = mamba.selective_state_scan(x, dt, A, B, C, D, dt_bias, state, torch.tensor([0, 1, 10, 10], dtype=torch.int32),
                                   torch.tensor([1, 0, 2]), torch.tensor([False, False, False]), None)
    assert torch.isfinite(y).all() and torch.isfinite(state).all()


@needs_cpp
def test_cpp_split_prefill_equals_one_call():
    """A 300-token sequence in one call equals its first 100 tokens, then one decode, then the rest from the state."""
    H, G, P, N = 4, 1, 16, 32
    x, dt, A, B, C, D, dt_bias = _inputs([300], H, G, P, N, seed=7)
    init = torch.randn(1, H, P, N) * 0.3
    one = init.clone()
    meta = (torch.tensor([0]), torch.tensor([True]), None)
    y_one = mamba.selective_state_scan(x, dt, A, B, C, D, dt_bias, one, torch.tensor([0, 300], dtype=torch.int32), *meta)
    two = init.clone()
    parts = []
    for a, e in ((0, 100), (100, 101), (101, 300)):
        parts.append(mamba.selective_state_scan(x[a:e], dt[a:e], A, B[a:e], C[a:e], D, dt_bias, two,
                                                torch.tensor([0, e - a], dtype=torch.int32), *meta))
    torch.testing.assert_close(torch.cat(parts), y_one, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(two, one, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_dispatch_falls_back_to_reference(monkeypatch, state_dtype):
    monkeypatch.setattr(ops, "selective_state_scan_supports", lambda *a: False)
    _check_against_naive(mamba.selective_state_scan, LENGTHS, H=4, G=2, P=8, N=12, state_dtype=state_dtype)


# --- Triton under the interpreter (tiny: the interpreter is slow) ---------------------------------


@pytest.mark.skipif(os.environ["TRITON_INTERPRET"] != "1", reason="needs TRITON_INTERPRET=1 on CPU")
@pytest.mark.parametrize("dtype,state_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                               (torch.float32, torch.bfloat16)])
def test_triton_matches_naive(dtype, state_dtype):
    pytest.importorskip("triton", reason="triton is not installed (pip install 'pagellm[gpu]')")
    from pagellm.kernels import triton_mamba

    lengths = [1, 5, 0, 9, 1]
    cps = {0: [1], 1: [2, 5], 3: [4, 4, 9]}
    H, G, P, N = 4, 2, 6, 5
    x, dt, A, B, C, D, dt_bias = _inputs(lengths, H, G, P, N, seed=9, dtype=dtype)
    qsl, slots, has_init, checkpoints = batch_meta(lengths, 16, seed=10, checkpoint_offsets=cps, cold_every=3)
    state0 = (torch.randn(16, H, P, N) * 0.3).to(state_dtype)
    ref_state, state = state0.clone(), state0.clone()
    limit = (0.05, 2.0)
    ref = naive_scan(x, dt, A, B, C, D, dt_bias, ref_state, qsl, slots, has_init, checkpoints, limit)
    y = triton_mamba.selective_state_scan(x, dt, A, B, C, D, dt_bias, state, qsl, slots, has_init, checkpoints, limit)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert y.dtype == dtype
    torch.testing.assert_close(y.float(), ref.float().to(dtype).float(), rtol=tol, atol=tol)
    assert_states_close(state, ref_state)
