"""The fused C++ layer ops against their torch paths (which follow transformers' arithmetic)."""
from __future__ import annotations

import pytest
import torch

from pagellm.kernels import ops
from pagellm.layers.activation import silu_and_mul
from pagellm.layers.norm import RMSNorm
from pagellm.layers.rotary import apply_rotary, rotate_in_place

pytestmark = pytest.mark.skipif(not ops.available(), reason="C++ kernels unavailable")

ROWS = [1, 3, 32, 300]  # one decode, odd, a decode batch, a prefill chunk split across threads


def _norm(hidden: int = 576) -> RMSNorm:
    norm = RMSNorm(hidden, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden) + 0.5)
    return norm


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden", [576, 70])  # 70: a tail past the last full vector
def test_rms_norm_matches_torch_path(rows: int, hidden: int) -> None:
    torch.manual_seed(rows)
    norm = _norm(hidden)
    x = torch.randn(rows, hidden) * 3
    assert ops.supports(x)
    fused = norm(x.clone())
    expected = ops.rms_norm_torch(x, norm.weight, norm.eps)
    torch.testing.assert_close(fused, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows", ROWS)
def test_fused_add_rms_norm_updates_both_in_place(rows: int) -> None:
    torch.manual_seed(rows)
    norm = _norm()
    x, residual = torch.randn(rows, 576), torch.randn(rows, 576)
    x_in, residual_in = x.clone(), residual.clone()
    normed, stream = norm(x, residual)
    assert normed.data_ptr() == x.data_ptr() and stream.data_ptr() == residual.data_ptr()
    torch.testing.assert_close(stream, x_in + residual_in, rtol=0, atol=0)  # the add is exact
    torch.testing.assert_close(normed, ops.rms_norm_torch(x_in + residual_in, norm.weight, norm.eps), rtol=1e-6, atol=1e-6)


def test_rms_norm_reads_strided_rows() -> None:
    norm = _norm(64)
    wide = torch.randn(5, 100)
    x = wide[:, :64]  # rows of 64 floats, 100 apart
    torch.testing.assert_close(norm(x), ops.rms_norm_torch(x.contiguous(), norm.weight, norm.eps), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("channels", "group"), [(4096, 4096), (512, 64), (70, 35)])  # one group, many, a vector tail
def test_group_gated_rms_norm_matches_torch_path(rows: int, channels: int, group: int) -> None:
    """Mamba-2's gated norm in one kernel, z a column slice of a wider projection as the layer passes it."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, channels, generator=gen) * 3
    z = torch.randn(rows, channels + 40, generator=gen)[:, 7:7 + channels]
    weight = torch.rand(channels, generator=gen) + 0.5
    got = ops.group_gated_rms_norm(x, z, weight, group, 1e-5)
    torch.testing.assert_close(got, ops.group_gated_rms_norm_torch(x, z, weight, group, 1e-5), rtol=1e-5, atol=1e-5)
    from transformers.models.mamba2.modeling_mamba2 import MambaRMSNormGated  # transformers' own layer

    hf = MambaRMSNormGated(channels, group_size=group, eps=1e-5)
    with torch.no_grad():
        hf.weight.copy_(weight)
        torch.testing.assert_close(got, hf(x, z), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", ROWS)
def test_silu_and_mul_matches_torch(rows: int) -> None:
    torch.manual_seed(rows)
    x = torch.randn(rows, 2 * 1536) * 4
    x[0, :8] = torch.tensor([0.0, -0.0, 90.0, -90.0, 1e-30, -1e-30, 20.0, -20.0])
    expected = torch.nn.functional.silu(x[:, :1536]) * x[:, 1536:]
    torch.testing.assert_close(silu_and_mul(x), expected, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("activation", list(ops.FUSED_ACTIVATIONS))
@pytest.mark.parametrize("half", [1536, 37])  # 37: a row tail past the last whole vector
def test_every_gated_kernel_matches_transformers_arithmetic(activation: str, half: int) -> None:
    gen = torch.Generator().manual_seed(half)
    x = torch.randn(9, 2 * half, generator=gen) * 4
    specials = torch.tensor([0.0, -0.0, 90.0, -90.0, 1e-30, -1e-30, 7.0, -7.0, 7.5, -7.5, 20.0, -20.0])
    x[0, : len(specials)] = specials
    x[1, half : half + len(specials)] = specials  # up values around gpt-oss's clamp
    got = ops.gated_and_mul(x, activation)
    torch.testing.assert_close(got, ops.gated_and_mul_torch(x, activation), rtol=4e-6, atol=2e-6)


@pytest.mark.parametrize("rows", ROWS)
def test_rotary_in_place_matches_apply_rotary(rows: int) -> None:
    torch.manual_seed(rows)
    num_heads, num_kv_heads, head_dim, max_pos = 9, 3, 64, 4096
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), torch.rand(head_dim // 2))
    cos, sin = freqs.cos(), freqs.sin()
    positions = torch.randint(0, max_pos, (rows,))
    qkv = torch.randn(rows, (num_heads + 2 * num_kv_heads) * head_dim)
    q = qkv[:, : num_heads * head_dim].reshape(rows, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].reshape(rows, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :].clone()
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    expected_q, expected_k = apply_rotary(q, c, s), apply_rotary(k, c, s)
    rotate_in_place(qkv, positions, cos, sin, num_heads + num_kv_heads, head_dim)
    torch.testing.assert_close(qkv[:, : num_heads * head_dim].view(rows, num_heads, head_dim), expected_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(rows, num_kv_heads, head_dim),
        expected_k,
        rtol=1e-6,
        atol=1e-6,
    )
    assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_dim :], v)  # v is left alone


def test_rotary_rejects_positions_outside_the_table() -> None:
    cos = sin = torch.ones(16, 32)
    qkv = torch.zeros(2, 64 * 3)
    with pytest.raises(ValueError, match="position 16 outside"):
        rotate_in_place(qkv, torch.tensor([0, 16]), cos, sin, 2, 64)
    with pytest.raises(ValueError, match="too short"):
        rotate_in_place(qkv, torch.tensor([0, 1]), cos, sin, 4, 64)


def test_other_dtypes_take_the_torch_path() -> None:
    norm = _norm(64).to(torch.float64)
    x = torch.randn(3, 64, dtype=torch.float64)
    assert not ops.supports(x)
    torch.testing.assert_close(norm(x), ops.rms_norm_torch(x, norm.weight, norm.eps))
    gate_up = torch.randn(3, 8, dtype=torch.float64)
    torch.testing.assert_close(silu_and_mul(gate_up), torch.nn.functional.silu(gate_up[:, :4]) * gate_up[:, 4:])
