"""The int8 dot-product matmul for GGUF block weights against float64 references."""
from __future__ import annotations

import pytest
import torch
from block_weights import not_quite_blocks
from torch.nn import functional as F

from pagellm.kernels import ops
from pagellm.kernels.tuning import block_quantized

pytestmark = pytest.mark.skipif(not ops.int8_matmul_available(), reason="no int8 dot products in this build")

# Around the micro-tiles (AVX-512: 6 rows, or one of up to 8; AVX2: 3) and past them.
ROWS = (1, 5, 6, 7, 8, 9, 13, 32, 200)


def quantized_x(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it, in float64: per 32 inputs, round(x / d) * d with d = amax / 127
    (through the inverse 1 / d, in float32, as the kernel and llama.cpp compute it)."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    return (torch.round(blocks * inverse).double() * d.double()).reshape(x.shape)


def check(out: torch.Tensor, exact: torch.Tensor, full: torch.Tensor, tolerance: float = 1e-2) -> None:
    # Exact: the same quantization of x, so only float32 rounding of the block sums remains.
    torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())
    # Full precision: the error of 8-bit activations (~0.5% for Gaussian x).
    assert (out - full).norm() / full.norm() < tolerance


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("out_features,in_features", [(192, 576), (50, 64), (40, 1536), (17, 96)])
def test_linear_int8_matches_the_quantized_product(bits: int, out_features: int, in_features: int) -> None:
    gen = torch.Generator().manual_seed(bits * 1000 + out_features)
    weight = block_quantized(out_features, in_features, bits, gen)
    packed = ops.pack_weight_int8(weight)
    assert packed is not None and packed.dtype == torch.int8
    bias = torch.randn(out_features, generator=gen)
    for rows in ROWS:
        x = torch.randn(rows, in_features, generator=gen)
        for b in (None, bias):
            out = torch.empty(rows, out_features)
            ops.linear_int8(out, x, packed, b)
            exact = quantized_x(x) @ weight.double().T + (0 if b is None else b.double())
            check(out, exact, F.linear(x, weight, b))


@pytest.mark.parametrize("bits", [4, 8])
def test_silu_mul_mode_fuses_the_activation(bits: int) -> None:
    half, in_features = 64, 192
    gen = torch.Generator().manual_seed(bits)
    weight = block_quantized(2 * half, in_features, bits, gen)
    packed = ops.pack_weight_int8(weight, silu_mul=True)
    assert packed is not None
    bias = torch.randn(2 * half, generator=gen)
    for rows in ROWS:
        x = torch.randn(rows, in_features, generator=gen)
        for b in (None, bias):
            out = torch.empty(rows, half)
            ops.linear_int8(out, x, packed, b, silu_mul=True)
            product = quantized_x(x) @ weight.double().T + (0 if b is None else b.double())
            exact = F.silu(product[:, :half]) * product[:, half:]
            full = F.linear(x, weight, b)
            # A product of two such sums: about twice the relative error.
            check(out, exact, F.silu(full[:, :half]) * full[:, half:], tolerance=2e-2)


def test_weights_that_are_not_exactly_blocks_are_not_packed() -> None:
    for weight in not_quite_blocks():
        assert ops.pack_weight_int8(weight) is None


def test_bad_inputs_raise_value_errors() -> None:
    weight = block_quantized(2 * 32, 64, 4, torch.Generator().manual_seed(1))
    packed = ops.pack_weight_int8(weight)
    assert packed is not None
    with pytest.raises(ValueError, match="float32"):
        ops.pack_weight_int8(weight.double())
    with pytest.raises(ValueError, match="multiple of"):
        ops.pack_weight_int8(block_quantized(2 * 20, 64, 4, torch.Generator().manual_seed(1)), silu_mul=True)
    with pytest.raises(ValueError, match="x must be"):
        ops.linear_int8(torch.empty(3, 64), torch.randn(3, 64).double(), packed, None)
    with pytest.raises(ValueError, match="x must be"):
        ops.linear_int8(torch.empty(3, 64), torch.randn(64, 3).T, packed, None)  # strided rows
    with pytest.raises(ValueError, match="input width"):
        ops.linear_int8(torch.empty(3, 64), torch.randn(3, 96), packed, None)
    with pytest.raises(ValueError, match="pack_weight_int8"):
        ops.linear_int8(torch.empty(3, 64), torch.randn(3, 64), ops.pack_weight_blocks(weight), None)
    with pytest.raises(ValueError, match="columns"):
        ops.linear_int8(torch.empty(3, 70), torch.randn(3, 64), packed, None)
    with pytest.raises(ValueError, match="out must be"):
        ops.linear_int8(torch.empty(4, 64), torch.randn(3, 64), packed, None)
    with pytest.raises(ValueError, match="bias"):
        ops.linear_int8(torch.empty(3, 64), torch.randn(3, 64), packed, torch.randn(63))
    with pytest.raises(ValueError, match="gate/up"):
        ops.linear_int8(torch.empty(3, 64), torch.randn(3, 64), packed, None, silu_mul=True)
