"""The recurrent layers' kernels (pagellm.kernels.recurrent): the torch reference against transformers'
Qwen3-Next functions, and the C++ kernels against the reference (float32 and bfloat16 inputs)."""
from __future__ import annotations

import os

# transformers imports triton, whose helpers (tl.sum, ...) take the interpreter only if TRITON_INTERPRET
# is set first: set here too, at collection, for test_recurrent_triton.py collected after this file.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from slot_batch_utils import batch_meta
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from pagellm.kernels import ops, recurrent

LENGTHS = [1, 5, 63, 64, 65, 200]


CHECKPOINTS = {1: [3], 2: [1, 17, 63], 4: [64], 5: [7, 70, 133, 200]}


def _gdr_inputs(lengths, Hk, Hv, Dk, Dv, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q = torch.randn(T, Hk, Dk, generator=gen).to(dtype)
    k = torch.randn(T, Hk, Dk, generator=gen).to(dtype)
    v = torch.randn(T, Hv, Dv, generator=gen).to(dtype)
    g = -torch.nn.functional.softplus(torch.randn(T, Hv, generator=gen)) * 0.5
    beta = torch.sigmoid(torch.randn(T, Hv, generator=gen))
    return q, k, v, g, beta


def _hf_gdr(fn, q, k, v, g, beta, init, **kw):
    out, final = fn(
        q[None], k[None], v[None], g[None], beta[None], initial_state=None if init is None else init[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True, **kw,
    )
    return out[0].float(), final[0]


@pytest.mark.parametrize("hf_fn", ["chunk", "recurrent"])
def test_gated_delta_rule_reference_matches_transformers(hf_fn):
    fn = hf.torch_chunk_gated_delta_rule if hf_fn == "chunk" else hf.torch_recurrent_gated_delta_rule
    Hk, Hv, Dk, Dv, S = 2, 4, 16, 8, 24
    q, k, v, g, beta = _gdr_inputs(LENGTHS, Hk, Hv, Dk, Dv)
    qsl, slots, has_init, cps = batch_meta(LENGTHS, S, seed=1, checkpoint_offsets=CHECKPOINTS)
    state0 = torch.randn(S, Hv, Dk, Dv) * 0.3
    state = state0.clone()
    out = recurrent.gated_delta_rule_reference(q, k, v, g, beta, state, qsl, slots, has_init, cps, Dk**-0.5)
    starts = qsl.tolist()
    for i in range(len(LENGTHS)):
        a, e = starts[i], starts[i + 1]
        init = state0[slots[i]] if has_init[i] else None
        ref_out, ref_final = _hf_gdr(fn, q[a:e], k[a:e], v[a:e], g[a:e], beta[a:e], init)
        torch.testing.assert_close(out[a:e], ref_out, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(state[slots[i]], ref_final, rtol=1e-4, atol=1e-4)
    for i, o, s in cps.tolist():
        a = starts[i]
        init = state0[slots[i]] if has_init[i] else None
        _, ref_state = _hf_gdr(fn, q[a:a + o], k[a:a + o], v[a:a + o], g[a:a + o], beta[a:a + o], init)
        torch.testing.assert_close(state[s], ref_state, rtol=1e-4, atol=1e-4)


def _split_prefill_check(fn, Hk=2, Hv=4, Dk=16, Dv=8):
    """One 230-token sequence in one call equals its first 100 tokens, then the rest from the state."""
    q, k, v, g, beta = _gdr_inputs([230], Hk, Hv, Dk, Dv, seed=3)
    init = torch.randn(1, Hv, Dk, Dv) * 0.3
    one = init.clone()
    out_one = fn(q, k, v, g, beta, one, torch.tensor([0, 230], dtype=torch.int32), torch.tensor([0]), torch.tensor([True]), None, Dk**-0.5)
    two = init.clone()
    parts = []
    for a, e in ((0, 100), (100, 230)):
        parts.append(fn(q[a:e], k[a:e], v[a:e], g[a:e], beta[a:e], two, torch.tensor([0, e - a], dtype=torch.int32),
                        torch.tensor([0]), torch.tensor([True]), None, Dk**-0.5))
    torch.testing.assert_close(torch.cat(parts), out_one, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(two, one, rtol=1e-4, atol=1e-4)


def test_gated_delta_rule_reference_chunked_prefill_split():
    _split_prefill_check(recurrent.gated_delta_rule_reference)


def _conv_inputs(lengths, C, K, S, seed=0, dtype=torch.float32, state_dtype=None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lengths), C, generator=gen).to(dtype)
    weight = (torch.randn(C, K, generator=gen) * 0.5).to(dtype)
    bias = (torch.randn(C, generator=gen) * 0.1).to(dtype)
    conv_state = torch.randn(S, K - 1, C, generator=gen).to(state_dtype or dtype)
    return x, weight, bias, conv_state


CONV_LENGTHS = [1, 2, 0, 3, 4, 9, 40, 1]  # decodes with a state and without
CONV_CHECKPOINTS = {1: [1, 2], 3: [1, 3], 5: [2, 5, 9], 6: [1, 33]}


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("with_bias", [True, False])
def test_causal_conv1d_reference_matches_transformers(activation, with_bias):
    C, K, S = 12, 4, 24
    x, weight, bias, conv_state = _conv_inputs(CONV_LENGTHS, C, K, S)
    bias = bias if with_bias else None
    qsl, slots, has_init, cps = batch_meta(CONV_LENGTHS, S, seed=2, checkpoint_offsets=CONV_CHECKPOINTS)
    state0 = conv_state.clone()
    out = recurrent.causal_conv1d_reference(x, weight, bias, conv_state, qsl, slots, has_init, cps, activation)
    starts = qsl.tolist()

    def hf_run(i, n):
        a = starts[i]
        xs = x[a:a + n].t()[None]  # [1, C, n]
        if has_init[i]:
            st = state0[slots[i]].t()[None].clone()  # [1, C, K - 1]
            y = hf.causal_conv1d_update(xs, st, weight, bias, activation) if n else xs.new_zeros(1, C, 0)
            if not n:
                st = state0[slots[i]].t()[None]
        else:
            y = hf.causal_conv1d_fn(xs, weight, bias, activation=activation)
            st = torch.cat([torch.zeros(1, C, K - 1), xs], dim=-1)[:, :, -(K - 1):]
        return y[0].t(), st[0].t()

    for i, n in enumerate(CONV_LENGTHS):
        y, final = hf_run(i, n)
        torch.testing.assert_close(out[starts[i]:starts[i + 1]], y, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(conv_state[slots[i]], final)
    for i, o, s in cps.tolist():
        torch.testing.assert_close(conv_state[s], hf_run(i, o)[1])


# --- C++ against the reference -------------------------------------------------------------------

needs_cpp = pytest.mark.skipif(not ops._recurrent_ops_loaded(), reason="C++ recurrent kernels unavailable")


def _assert_states_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32 states to 1e-4; bfloat16 ones (each the rounding of nearly equal float32 sums) to one unit in the last place."""
    assert got.dtype == want.dtype
    tol = 1e-4 if got.dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=1e-4)


@needs_cpp
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 4, 16, 24), (1, 1, 128, 128), (2, 2, 40, 136)])
def test_gated_delta_rule_cpp_matches_reference(dtype, shape, state_dtype):
    """Also with bfloat16 state slots (--mamba-ssm-cache-dtype): both sides update a state in float32 and
    round it only where they write it, so float32 outputs still agree to 1e-4."""
    Hk, Hv, Dk, Dv = shape
    lengths = LENGTHS if Dk < 128 else [1, 70, 1, 0, 3]
    S = 24
    q, k, v, g, beta = _gdr_inputs(lengths, Hk, Hv, Dk, Dv, dtype=dtype)
    qsl, slots, has_init, cps = batch_meta(lengths, S, seed=4, checkpoint_offsets=CHECKPOINTS)
    state0 = (torch.randn(S, Hv, Dk, Dv) * 0.3).to(state_dtype)
    ref_state, cpp_state = state0.clone(), state0.clone()
    ref = recurrent.gated_delta_rule_reference(q, k, v, g, beta, ref_state, qsl, slots, has_init, cps, Dk**-0.5)
    assert ops.gated_delta_rule_supports(q, k, v, cpp_state)
    out = recurrent.gated_delta_rule(q, k, v, g, beta, cpp_state, qsl, slots, has_init, cps, Dk**-0.5)
    assert out.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    _assert_states_close(cpp_state, ref_state)


@needs_cpp
def test_gated_delta_rule_bf16_state_stays_near_float32():
    """A bfloat16 state rounds once per call: over a prompt in 16-token calls and 40 decodes, the outputs
    stay within a few hundredths of a float32 state's (the error does not compound)."""
    Hk, Hv, Dk, Dv = 2, 4, 64, 64
    q, k, v, g, beta = _gdr_inputs([200], Hk, Hv, Dk, Dv, seed=3)
    outs = {}
    for state_dtype in (torch.float32, torch.bfloat16):
        state = torch.zeros(1, Hv, Dk, Dv, dtype=state_dtype)
        parts = []
        for a in list(range(0, 160, 16)) + list(range(160, 200)):
            e = a + 16 if a < 160 else a + 1
            meta = (torch.tensor([0, e - a], dtype=torch.int32), torch.tensor([0]), torch.tensor([a > 0]), None, Dk**-0.5)
            parts.append(recurrent.gated_delta_rule(q[a:e], k[a:e], v[a:e], g[a:e], beta[a:e], state, *meta))
        outs[state_dtype] = torch.cat(parts)
    err = (outs[torch.bfloat16] - outs[torch.float32]).abs()
    assert err.max() < 3e-2 and err.mean() < 3e-3, (err.max(), err.mean())


@needs_cpp
def test_gated_delta_rule_cpp_chunked_prefill_split():
    _split_prefill_check(recurrent.gated_delta_rule, Dv=32)


@needs_cpp
@pytest.mark.parametrize("dv", [16, 64])  # a decode's column chunks: part of one, and whole ones
def test_gated_delta_rule_cpp_zero_state_ignores_slot_contents(dv):
    q, k, v, g, beta = _gdr_inputs([1, 9], 1, 2, 16, dv)
    state = torch.full((2, 2, 16, dv), float("nan"))
    meta = (torch.tensor([0, 1, 10], dtype=torch.int32), torch.tensor([1, 0]), torch.tensor([False, False]), None, 0.25)
    out = recurrent.gated_delta_rule(q, k, v, g, beta, state, *meta)
    ref_state = torch.zeros_like(state)
    ref = recurrent.gated_delta_rule_reference(q, k, v, g, beta, ref_state, *meta)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, ref_state, rtol=1e-4, atol=1e-4)


@needs_cpp
@pytest.mark.parametrize(
    ("dtype", "state_dtype"),
    [(torch.float32, None), (torch.bfloat16, None), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)],
)
@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("C,K", [(12, 4), (100, 3), (64, 2)])
def test_causal_conv1d_cpp_matches_reference(dtype, activation, C, K, state_dtype):
    """The state in x's dtype, or in the other one (--mamba-cache-dtype): inputs are rounded into
    it exactly as the reference rounds them."""
    S = 24
    x, weight, bias, conv_state = _conv_inputs(CONV_LENGTHS, C, K, S, dtype=dtype, state_dtype=state_dtype)
    qsl, slots, has_init, cps = batch_meta(CONV_LENGTHS, S, seed=5, checkpoint_offsets=CONV_CHECKPOINTS)
    ref_state, cpp_state = conv_state.clone(), conv_state.clone()
    ref = recurrent.causal_conv1d_reference(x, weight, bias, ref_state, qsl, slots, has_init, cps, activation)
    assert ops.causal_conv1d_supports(x, weight, cpp_state)
    out = recurrent.causal_conv1d(x, weight, bias if C != 64 else None, cpp_state, qsl, slots, has_init, cps, activation)
    if C == 64:
        ref = recurrent.causal_conv1d_reference(x, weight, None, conv_state.clone(), qsl, slots, has_init, cps, activation)
    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    assert torch.equal(cpp_state, ref_state)


@needs_cpp
@pytest.mark.parametrize(("dtype", "state_dtype"), [(torch.float32, None), (torch.bfloat16, None), (torch.float32, torch.bfloat16)])
def test_causal_conv1d_cpp_spans_of_a_wide_strided_input(dtype, state_dtype):
    """Prompts longer than a work item's tokens, channels over several spans with a partial last
    vector, decodes beside them, and x a column slice of a wider projection (read in place)."""
    lengths, C, K, S = [1, 70, 1, 0, 5, 33], 1100, 4, 20
    wide, weight, bias, conv_state = _conv_inputs(lengths, C + 37, K, S, dtype=dtype, state_dtype=state_dtype)
    x, weight, bias, conv_state = wide[:, 5:5 + C], weight[:C], bias[:C], conv_state[..., :C].contiguous()
    qsl, slots, has_init, cps = batch_meta(lengths, S, seed=2, checkpoint_offsets={1: [2, 32, 33, 70], 4: [1, 2], 5: [33]})
    ref_state, cpp_state = conv_state.clone(), conv_state.clone()
    ref = recurrent.causal_conv1d_reference(x.contiguous(), weight, bias, ref_state, qsl, slots, has_init, cps, "silu")
    assert x.stride(0) == C + 37 and ops.causal_conv1d_supports(x, weight, cpp_state)
    out = recurrent.causal_conv1d(x, weight, bias, cpp_state, qsl, slots, has_init, cps, "silu")
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    assert torch.equal(cpp_state, ref_state)


def test_dispatch_falls_back_to_reference(monkeypatch):
    monkeypatch.setattr(ops, "gated_delta_rule_supports", lambda *a: False)
    monkeypatch.setattr(ops, "causal_conv1d_supports", lambda *a: False)
    q, k, v, g, beta = _gdr_inputs([3, 1], 1, 1, 8, 8)
    qsl, slots, has_init, _ = batch_meta([3, 1], 4, seed=6)
    a = torch.randn(4, 1, 8, 8)
    b = a.clone()
    out = recurrent.gated_delta_rule(q, k, v, g, beta, a, qsl, slots, has_init, None, 0.3)
    torch.testing.assert_close(out, recurrent.gated_delta_rule_reference(q, k, v, g, beta, b, qsl, slots, has_init, None, 0.3))
    x, w, bias, cs = _conv_inputs([3, 1], 8, 4, 4)
    cs2 = cs.clone()
    torch.testing.assert_close(recurrent.causal_conv1d(x, w, bias, cs, qsl, slots, has_init, None),
                               recurrent.causal_conv1d_reference(x, w, bias, cs2, qsl, slots, has_init, None))
