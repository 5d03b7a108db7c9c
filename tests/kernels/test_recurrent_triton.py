"""The Triton recurrent kernels (pagellm.kernels.triton_recurrent) against the torch reference, on the CPU
under the Triton interpreter with tiny shapes.

TRITON_INTERPRET must be set before the kernels are defined (Triton reads it in ``triton.jit``), so it
is set here, at collection, before anything imports them.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install 'pagellm[gpu]')")

from pagellm.kernels import (
    recurrent,
    triton_recurrent,
)

pytestmark = pytest.mark.skipif(os.environ["TRITON_INTERPRET"] != "1", reason="needs TRITON_INTERPRET=1 on CPU")

LENGTHS = [1, 5, 0, 12, 1]
CHECKPOINTS = [(1, 2, 10), (1, 5, 11), (3, 1, 12), (3, 7, 13), (3, 7, 14), (4, 1, 15)]


def _meta(lengths):
    qsl = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    slots = torch.tensor([3, 0, 5, 1, 7], dtype=torch.int64)[: len(lengths)]
    has_init = torch.tensor([True, False, True, True, False])[: len(lengths)]
    return qsl, slots, has_init, torch.tensor(CHECKPOINTS, dtype=torch.int64)


@pytest.mark.parametrize("dtype,state_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                               (torch.float32, torch.bfloat16)])
def test_triton_gated_delta_rule_matches_reference(dtype, state_dtype):
    Hk, Hv, Dk, Dv, S = 1, 2, 16, 24, 16
    gen = torch.Generator().manual_seed(0)
    T = sum(LENGTHS)
    q = torch.randn(T, Hk, Dk, generator=gen).to(dtype)
    k = torch.randn(T, Hk, Dk, generator=gen).to(dtype)
    v = torch.randn(T, Hv, Dv, generator=gen).to(dtype)
    g = -torch.nn.functional.softplus(torch.randn(T, Hv, generator=gen))
    beta = torch.sigmoid(torch.randn(T, Hv, generator=gen))
    state0 = (torch.randn(S, Hv, Dk, Dv, generator=gen) * 0.3).to(state_dtype)
    qsl, slots, has_init, cps = _meta(LENGTHS)
    ref_state, tri_state = state0.clone(), state0.clone()
    ref = recurrent.gated_delta_rule_reference(q, k, v, g, beta, ref_state, qsl, slots, has_init, cps, Dk**-0.5)
    out = triton_recurrent.gated_delta_rule(q, k, v, g, beta, tri_state, qsl, slots, has_init, cps, Dk**-0.5)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    assert tri_state.dtype == state_dtype
    state_tol = 1e-4 if state_dtype == torch.float32 else 2**-7  # bfloat16: one unit in the last place
    torch.testing.assert_close(tri_state.float(), ref_state.float(), rtol=state_tol, atol=1e-4)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])  # bfloat16: --mamba-cache-dtype
@pytest.mark.parametrize("activation", ["silu", None])
def test_triton_causal_conv1d_matches_reference(activation, state_dtype):
    C, K, S = 20, 4, 16
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(sum(LENGTHS), C, generator=gen)
    weight = torch.randn(C, K, generator=gen) * 0.5
    bias = torch.randn(C, generator=gen) * 0.1
    state0 = torch.randn(S, K - 1, C, generator=gen).to(state_dtype)
    qsl, slots, has_init, cps = _meta(LENGTHS)
    ref_state, tri_state = state0.clone(), state0.clone()
    ref = recurrent.causal_conv1d_reference(x, weight, bias, ref_state, qsl, slots, has_init, cps, activation)
    out = triton_recurrent.causal_conv1d(x, weight, bias, tri_state, qsl, slots, has_init, cps, activation)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tri_state, ref_state)
