"""The packed-weight small-batch matmul (float32 panels) against torch's."""
from __future__ import annotations

import pytest
import torch

from pagellm.kernels import ops

pytestmark = pytest.mark.skipif(not ops.available(), reason="C++ kernels unavailable")


@pytest.mark.parametrize("rows", [1, 5, 12, 13, 32, 96, 200])  # below, at and past a 12-row micro-tile
# (2080, 96): enough panels (65 or more) that x is first packed k-major rather than read in place.
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (50, 70), (576, 1536), (33, 1200), (2080, 96)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_packed_matches_torch(rows: int, out_features: int, in_features: int, with_bias: bool) -> None:
    torch.manual_seed(rows * 7 + out_features)
    weight = torch.randn(out_features, in_features) * 0.05
    bias = torch.randn(out_features) if with_bias else None
    x = torch.randn(rows, in_features)
    out = torch.empty(rows, out_features)
    ops.linear_packed(out, x, ops.pack_weight(weight), bias)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=2e-5)


def test_linear_packed_reads_strided_rows_and_rejects_mismatches() -> None:
    weight = torch.randn(40, 64)
    packed = ops.pack_weight(weight)
    x = torch.randn(6, 100)[:, :64]
    out = torch.empty(6, 40)
    ops.linear_packed(out, x, packed, None)
    torch.testing.assert_close(out, x @ weight.T, rtol=1e-5, atol=1e-5)
    wide = torch.randn(2080, 64)  # enough panels that the strided rows are packed first
    x_wide = torch.randn(30, 100)[:, :64]
    out_wide = torch.empty(30, 2080)
    ops.linear_packed(out_wide, x_wide, ops.pack_weight(wide), None)
    torch.testing.assert_close(out_wide, x_wide @ wide.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="input width"):
        ops.linear_packed(out, torch.randn(6, 65), packed, None)
    with pytest.raises(ValueError, match="columns"):
        ops.linear_packed(torch.empty(6, 80), x, packed, None)
    for other in (packed.to(torch.bfloat16), packed.view(torch.uint8)):  # float32 panels only
        with pytest.raises(ValueError, match="pack_weight"):
            ops.linear_packed(out, x, other, None)


def test_only_float32_weights_are_packed() -> None:
    for weight in (torch.randn(8, 16, dtype=torch.float64), torch.randn(8, 16).bfloat16(), torch.randn(16)):
        with pytest.raises(ValueError, match="float32"):
            ops.pack_weight(weight)


def _gated_reference(x: torch.Tensor, weight: torch.Tensor, bias, activation: str) -> torch.Tensor:
    """The unfused kernels: the plain panels' product, then the separate activation."""
    product = torch.empty(x.shape[0], weight.shape[0])
    ops.linear_packed(product, x, ops.pack_weight(weight), bias)
    return ops.gated_and_mul(product, activation)


def _check_fused_gated(rows: int, half: int, in_features: int, activation: str, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows + half)
    # Large enough that gpt-oss's clamp at 7 cuts some gate and up sums.
    weight = torch.randn(2 * half, in_features, generator=gen) * (4 / in_features**0.5)
    bias = torch.randn(2 * half, generator=gen) if with_bias else None
    x = torch.randn(rows, in_features, generator=gen)
    packed = ops.pack_weight_gate_up(weight)
    out = torch.empty(rows, half)
    ops.linear_packed_gated(out, x, packed, bias, activation)
    assert torch.equal(out, _gated_reference(x, weight, bias, activation))
    expected = ops.gated_and_mul_torch(torch.nn.functional.linear(x, weight, bias), activation)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 5, 12, 13, 32, 96, 200])
@pytest.mark.parametrize("half,in_features", [(1536, 576), (64, 1300), (32, 100)])  # 1300: three k slices
def test_fused_silu_and_mul_equals_the_separate_kernels_bit_for_bit(rows: int, half: int, in_features: int) -> None:
    _check_fused_gated(rows, half, in_features, "silu", with_bias=False)


@pytest.mark.parametrize("activation", list(ops.FUSED_ACTIVATIONS))
@pytest.mark.parametrize("rows", [1, 13, 96])
@pytest.mark.parametrize("half,in_features", [(64, 1300), (32, 100)])
def test_every_fused_activation_with_a_bias_equals_the_separate_kernels(rows: int, half: int, in_features: int, activation: str) -> None:
    _check_fused_gated(rows, half, in_features, activation, with_bias=True)


def test_fused_gated_product_checks_its_inputs() -> None:
    with pytest.raises(ValueError, match="multiple of"):
        ops.pack_weight_gate_up(torch.randn(2 * 20, 64))  # halves of 20: not whole vectors
    packed = ops.pack_weight_gate_up(torch.randn(2 * 64, 64))
    with pytest.raises(ValueError, match="gate/up panel pairs"):
        ops.linear_packed_gated(torch.empty(3, 128), torch.randn(3, 64), packed, None, "silu")
    with pytest.raises(ValueError, match="input width"):
        ops.linear_packed_gated(torch.empty(3, 64), torch.randn(3, 65), packed, None, "silu")
    with pytest.raises(ValueError, match="pack_weight_gate_up"):
        ops.linear_packed_gated(torch.empty(3, 64), torch.randn(3, 64), packed.double(), None, "silu")
    with pytest.raises(ValueError, match="gate/up bias"):
        ops.linear_packed_gated(torch.empty(3, 64), torch.randn(3, 64), packed, torch.randn(64), "silu")
    with pytest.raises(ValueError, match="no fused kernel"):
        ops.linear_packed_gated(torch.empty(3, 64), torch.randn(3, 64), packed, None, "gelu")
