"""The bfloat16 dot-product matmul against float64 products of the same bfloat16-rounded inputs,
on AVX-512 and, where the CPU has them, on AMX tiles (products of 4 rows or more whose width is a
multiple of 32)."""
from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from pagellm.kernels import ops

pytestmark = pytest.mark.skipif(
    not ops.bf16_matmul_available(), reason="no bfloat16 dot products (AVX512_BF16) in this build"
)


@pytest.fixture(params=["amx", "avx512"])
def kernel_path(request: pytest.FixtureRequest):
    if request.param == "amx" and not ops.amx_available():
        pytest.skip("no AMX tiles on this CPU")
    was_on = ops.set_amx(request.param == "amx")
    yield request.param
    ops.set_amx(was_on)


def _reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What the kernel computes: both inputs rounded to bfloat16, the sums exact."""
    return x.bfloat16().double() @ weight.bfloat16().double().T


# below, at and past a 12-row micro-tile, and a 16-row AMX tile (17, 200: a part tile)
@pytest.mark.parametrize("rows", [1, 5, 12, 13, 17, 32, 200])
# (50, 70): a part panel; (33, 1201): an odd input width, padded with a zero input.
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (50, 70), (576, 1536), (33, 1201)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_bf16_sums_bfloat16_products_in_float32(
    rows: int, out_features: int, in_features: int, with_bias: bool, kernel_path: str
) -> None:
    gen = torch.Generator().manual_seed(rows * 31 + out_features)
    weight = torch.randn(out_features, in_features, generator=gen) * 0.05
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    x = torch.randn(rows, in_features, generator=gen)
    out = torch.empty(rows, out_features)
    ops.linear_bf16(out, x, ops.pack_weight_bf16(weight), bias)
    want = _reference(x, weight) + (bias.double() if bias is not None else 0)
    # float32 accumulation over K terms of size ~0.05: a few ulps of the running sum
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=2e-5)
    # and bfloat16's rounding of both inputs is all that separates it from the float32 product
    exact = F.linear(x, weight, bias)
    assert (out - exact).norm() / exact.norm() < 1e-2


@pytest.mark.parametrize("activation", list(ops.FUSED_ACTIVATIONS))
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rows", [1, 13, 17, 64])
@pytest.mark.parametrize("in_features", [200, 256])  # 256: AMX's 32-input steps
def test_fused_gated_activation(rows: int, in_features: int, with_bias: bool, activation: str, kernel_path: str) -> None:
    gen = torch.Generator().manual_seed(rows)
    half = 96
    weight = torch.randn(2 * half, in_features, generator=gen) * 0.3  # sums past gpt-oss's clamp at 7 too
    bias = torch.randn(2 * half, generator=gen) if with_bias else None
    x = torch.randn(rows, in_features, generator=gen)
    out = torch.empty(rows, half)
    ops.linear_bf16(out, x, ops.pack_weight_bf16(weight, gate_up=True), bias, activation)
    product = _reference(x, weight) + (bias.double() if bias is not None else 0)
    want = ops.gated_and_mul_torch(product, activation)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def test_strided_rows_and_bad_inputs() -> None:
    weight = torch.randn(40, 64)
    packed = ops.pack_weight_bf16(weight)
    x = torch.randn(6, 100)[:, :64]  # rows 100 apart
    out = torch.empty(6, 40)
    ops.linear_bf16(out, x, packed, None)
    torch.testing.assert_close(out.double(), _reference(x, weight), rtol=1e-5, atol=1e-5)
    ops.linear_bf16(torch.empty(0, 40), torch.empty(0, 64), packed, None)  # no rows: nothing to do
    with pytest.raises(ValueError, match="input width"):
        ops.linear_bf16(out, torch.randn(6, 66), packed, None)
    with pytest.raises(ValueError, match="columns"):
        ops.linear_bf16(torch.empty(6, 80), x, packed, None)
    with pytest.raises(ValueError, match="multiple of 16"):
        ops.pack_weight_bf16(torch.randn(40, 64), gate_up=True)  # halves of 20 columns
    with pytest.raises(ValueError, match="float32"):
        ops.pack_weight_bf16(torch.randn(40, 64, dtype=torch.float64))


# (50, 70): a part panel; (33, 1201): an odd input width.
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (50, 70), (33, 1201)])
def test_a_bfloat16_weight_packs_as_its_float32_upcast(out_features: int, in_features: int) -> None:
    gen = torch.Generator().manual_seed(out_features)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).bfloat16()
    upcast = weight.float()
    assert torch.equal(ops.pack_weight_bf16(weight), ops.pack_weight_bf16(upcast))
    # Columns of a transposed weight: packed from the same values.
    assert torch.equal(ops.pack_weight_bf16(weight.T.contiguous().T), ops.pack_weight_bf16(upcast))
    x = torch.randn(5, in_features, generator=gen)
    out = torch.empty(5, out_features)
    ops.linear_bf16(out, x, ops.pack_weight_bf16(weight), None)
    torch.testing.assert_close(out.double(), _reference(x, upcast), rtol=1e-5, atol=2e-5)


def test_a_bfloat16_gate_up_weight_packs_as_its_float32_upcast() -> None:
    gen = torch.Generator().manual_seed(1)
    half, in_features = 96, 201
    weight = (torch.randn(2 * half, in_features, generator=gen) * 0.1).bfloat16()
    packed = ops.pack_weight_bf16(weight, gate_up=True)
    assert torch.equal(packed, ops.pack_weight_bf16(weight.float(), gate_up=True))
    x = torch.randn(13, in_features, generator=gen)
    out = torch.empty(13, half)
    ops.linear_bf16(out, x, packed, None, "silu")
    product = _reference(x, weight.float())
    torch.testing.assert_close(out.double(), F.silu(product[:, :half]) * product[:, half:], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="multiple of 16"):
        ops.pack_weight_bf16(weight[:40], gate_up=True)


def test_amx_and_avx512_give_the_same_sums() -> None:
    if not ops.amx_available():
        pytest.skip("no AMX tiles on this CPU")
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(200, 512, generator=gen) * 0.05
    packed = ops.pack_weight_bf16(weight)
    x = torch.randn(40, 512, generator=gen)
    out_amx, out_avx = torch.empty(40, 200), torch.empty(40, 200)
    assert ops.set_amx(False)
    try:
        ops.linear_bf16(out_avx, x, packed, None)
    finally:
        assert not ops.set_amx(True)
    ops.linear_bf16(out_amx, x, packed, None)
    # the same float32 sums of the same products, in another order
    torch.testing.assert_close(out_amx, out_avx, rtol=1e-5, atol=1e-5)
