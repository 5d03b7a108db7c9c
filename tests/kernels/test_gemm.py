"""The packed-weight small-batch matmul against torch's, and the model's use of it."""
from __future__ import annotations

import pytest
import torch
from block_weights import not_quite_blocks

from pagellm.kernels import ops
from pagellm.kernels.tuning import block_quantized
from pagellm.models.layers import (
    PACKED_MAX_ROWS,
    Linear,
    SiluAndMulLinear,
    linear,
    linear_silu_and_mul,
    pack_weight,
    silu_and_mul,
)

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


def test_linear_module_uses_the_packed_copy_only_for_small_batches(monkeypatch) -> None:
    layer = Linear(64, 48, bias=True)
    assert layer.pack() == ops.pack_weight(layer.weight).numel() * 4  # random weights: no blocks
    calls = []
    real = ops.linear_packed
    monkeypatch.setattr(ops, "linear_packed", lambda *a: (calls.append(a[1].shape[0]), real(*a)))
    with torch.no_grad():
        for rows in (1, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 1):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert calls == [1, PACKED_MAX_ROWS]


def test_other_dtypes_are_not_packed() -> None:
    weight = torch.randn(8, 16, dtype=torch.float64)
    assert pack_weight(weight) is None
    x = torch.randn(2, 16, dtype=torch.float64)
    torch.testing.assert_close(linear(x, weight, None, None), x @ weight.T)


@pytest.mark.parametrize("bits,bytes_per_weight", [(4, 0.75), (8, 1.125)])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (50, 64), (576, 1536), (2080, 96)])
def test_gguf_block_weights_pack_as_blocks_with_bit_identical_results(
    bits: int, bytes_per_weight: float, out_features: int, in_features: int
) -> None:
    weight = block_quantized(out_features, in_features, bits, torch.Generator().manual_seed(bits + out_features))
    packed = pack_weight(weight)
    floats, blocks = packed.panels, packed.blocks
    assert blocks is not None and blocks.dtype == torch.uint8 and floats.dtype == torch.float32
    panels = floats.shape[0]  # output columns rounded up to whole panels
    assert blocks.numel() == panels * floats.shape[2] * in_features * bytes_per_weight
    assert packed.nbytes == floats.numel() * 4 + blocks.numel()
    bias = torch.randn(out_features)
    for rows in (1, 5, 12, 13, 32, 96):  # below, at and past a micro-tile, and the largest packed batch
        x = torch.randn(rows, in_features)
        got, want = torch.empty(rows, out_features), torch.empty(rows, out_features)
        ops.linear_packed(got, x, blocks, bias)
        ops.linear_packed(want, x, floats, bias)
        assert torch.equal(got, want), rows
        torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, bias), rtol=1e-4, atol=1e-3)


def test_weights_that_are_not_exactly_blocks_have_no_block_copy() -> None:
    for weight in not_quite_blocks():
        packed = pack_weight(weight)
        assert packed.blocks is None and packed.panels.dtype == torch.float32


@pytest.mark.parametrize("bits,limits", [(4, (8, 32)), (8, (8, 24))])  # (AVX2, AVX-512)
def test_linear_takes_blocks_up_to_their_row_limit(monkeypatch, bits: int, limits: tuple[int, int]) -> None:
    weight = block_quantized(48, 64, bits, torch.Generator().manual_seed(2))
    packed = pack_weight(weight)
    used = []
    real = ops.linear_packed
    monkeypatch.setattr(ops, "linear_packed", lambda *a: (used.append((a[1].shape[0], a[2].dtype)), real(*a)))
    limit = packed.blocks_max_rows
    assert limit in limits and limit == ops.blocks_max_rows(packed.blocks)
    for rows in (1, limit, limit + 1, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 1):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(linear(x, weight, None, packed), x @ weight.T, rtol=1e-5, atol=1e-5)
    assert used == [(1, torch.uint8), (limit, torch.uint8), (limit + 1, torch.float32), (PACKED_MAX_ROWS, torch.float32)]


def test_block_packed_input_width_is_checked() -> None:
    blocks = ops.pack_weight_blocks(block_quantized(40, 64, 4, torch.Generator().manual_seed(1)))
    assert blocks is not None and blocks.dtype == torch.uint8
    with pytest.raises(ValueError, match="input width"):
        ops.linear_packed(torch.empty(2, 40), torch.randn(2, 96), blocks, None)


def _silu_and_mul_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The unfused kernels: the plain panels' product, then the separate activation."""
    product = torch.empty(x.shape[0], weight.shape[0])
    ops.linear_packed(product, x, ops.pack_weight(weight), None)
    return silu_and_mul(product)


@pytest.mark.parametrize("rows", [1, 5, 12, 13, 32, 96, 200])
@pytest.mark.parametrize("half,in_features", [(1536, 576), (64, 1300), (32, 100)])  # 1300: three k slices
def test_fused_silu_and_mul_equals_the_separate_kernels_bit_for_bit(rows: int, half: int, in_features: int) -> None:
    gen = torch.Generator().manual_seed(rows + half)
    weight = torch.randn(2 * half, in_features, generator=gen) / in_features**0.5
    x = torch.randn(rows, in_features, generator=gen)
    packed = ops.pack_weight_silu_mul(weight)
    out = torch.empty(rows, half)
    ops.linear_packed_silu_mul(out, x, packed)
    assert torch.equal(out, _silu_and_mul_reference(x, weight))
    expected = torch.nn.functional.silu(x @ weight[:half].T) * (x @ weight[half:].T)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def test_fused_silu_and_mul_checks_its_shapes() -> None:
    with pytest.raises(ValueError, match="multiple of"):
        ops.pack_weight_silu_mul(torch.randn(2 * 20, 64))  # halves of 20: not whole vectors
    packed = ops.pack_weight_silu_mul(torch.randn(2 * 64, 64))
    with pytest.raises(ValueError, match="gate/up panel pairs"):
        ops.linear_packed_silu_mul(torch.empty(3, 128), torch.randn(3, 64), packed)
    with pytest.raises(ValueError, match="input width"):
        ops.linear_packed_silu_mul(torch.empty(3, 64), torch.randn(3, 65), packed)
    with pytest.raises(ValueError, match="pack_weight_silu_mul"):
        blocks = pack_weight(block_quantized(128, 64, 4, torch.Generator().manual_seed(0))).blocks
        ops.linear_packed_silu_mul(torch.empty(3, 64), torch.randn(3, 64), blocks)


@pytest.mark.parametrize("bits", [4, 8])
def test_silu_and_mul_linear_takes_blocks_fused_panels_then_blas(monkeypatch, bits: int) -> None:
    layer = SiluAndMulLinear(64, 2 * 48, bias=False)
    with torch.no_grad():
        layer.weight.copy_(block_quantized(96, 64, bits, torch.Generator().manual_seed(bits)))
    layer.pack()
    packed = layer.packed
    assert packed.silu_and_mul and packed.blocks is not None
    used = []
    for name in ("linear_packed", "linear_packed_silu_mul"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, name=name, real=real: (used.append((name, a[1].shape[0])), real(*a)))
    limit = packed.blocks_max_rows
    for rows in (1, limit, limit + 1, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 1):
        x = torch.randn(rows, 64)
        with torch.no_grad():
            got = layer(x)
        torch.testing.assert_close(got, silu_and_mul(x @ layer.weight.T), rtol=1e-5, atol=1e-5)
    assert used == [
        ("linear_packed", 1),
        ("linear_packed", limit),
        ("linear_packed_silu_mul", limit + 1),
        ("linear_packed_silu_mul", PACKED_MAX_ROWS),
    ]  # and BLAS past the packed kernel's limit
    # A plain product of the same weight never multiplies by the paired (reordered) panels.
    x = torch.randn(limit + 1, 64)
    with torch.no_grad():
        torch.testing.assert_close(linear(x, layer.weight, None, packed), x @ layer.weight.T, rtol=1e-5, atol=1e-5)


def test_silu_and_mul_linear_with_bias_or_odd_halves_keeps_plain_panels() -> None:
    biased = SiluAndMulLinear(64, 2 * 48, bias=True)
    odd = SiluAndMulLinear(64, 2 * 20, bias=False)
    for layer in (biased, odd):
        layer.pack()
        assert not layer.packed.silu_and_mul
        x = torch.randn(7, 64)
        with torch.no_grad():
            expected = silu_and_mul(torch.nn.functional.linear(x, layer.weight, layer.bias))
            torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(linear_silu_and_mul(x, layer.weight, layer.bias, None), expected, rtol=1e-5, atol=1e-5)
