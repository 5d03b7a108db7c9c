"""Wide int8 products on AMX tiles: each panel of GGUF blocks dequantized to bfloat16 (gguf's values
rounded once), x rounded to bfloat16, float32 sums; below 64 rows the int8 kernel as before."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf_blocks import random_blocks
from test_gemm_int8 import TYPES, act_span, interleaved, quantized_x, reference

from pagellm.kernels import ops

pytestmark = pytest.mark.skipif(not ops.amx_available(), reason="no AMX tiles on this CPU")

T = GGMLQuantizationType
AMX_MIN_ROWS = 64


def bf16_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What the tiles compute: both sides rounded to bfloat16, the sums exact."""
    return x.bfloat16().double() @ weight.float().bfloat16().double().T


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [AMX_MIN_ROWS, 65, 100])  # whole 32-row blocks, a 1-row and a 4-row tail
def test_wide_products_sum_bfloat16_products(qtype: T, rows: int) -> None:
    out_features, in_features = 70, 512  # an edge panel of 6 columns
    raw = random_blocks(qtype, out_features, in_features, int(qtype))
    weight = reference(raw, qtype)
    packed = ops.pack_weight_int8(torch.from_numpy(raw), int(qtype), in_features)
    gen = torch.Generator().manual_seed(rows)
    bias = torch.randn(out_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    for b in (None, bias):
        wide = torch.full((rows, out_features + 5), float("nan"))
        out = wide[:, 2 : 2 + out_features]
        ops.linear_int8(out, x, packed, int(qtype), b)
        assert torch.isnan(wide[:, :2]).all() and torch.isnan(wide[:, 2 + out_features :]).all()
        want = bf16_product(x, weight) + (0 if b is None else b.double())
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        # against the float32 product: bfloat16 rounding of both sides, well under 1%
        full = x.double() @ weight.T + (0 if b is None else b.double())
        assert ((out.double() - full).norm() / full.norm()).item() < 1e-2


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("activation", list(ops.FUSED_ACTIVATIONS))
def test_wide_gated_products(qtype: T, activation: str) -> None:
    half, in_features, rows = 48, 256, 80
    raw = random_blocks(qtype, 2 * half, in_features, int(qtype))
    weight = reference(raw, qtype)
    packed = ops.pack_weight_int8(torch.from_numpy(interleaved(raw)), int(qtype), in_features)
    gen = torch.Generator().manual_seed(3)
    bias = torch.randn(2 * half, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    for b in (None, bias):
        out = torch.empty(rows, half)
        ops.linear_int8(out, x, packed, int(qtype), b, activation)
        want = ops.gated_and_mul_torch(bf16_product(x, weight) + (0 if b is None else b.double()), activation)
        torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_narrow_products_stay_on_the_int8_kernel() -> None:
    qtype, out_features, in_features = T.Q4_K, 64, 512
    raw = random_blocks(qtype, out_features, in_features, 5)
    packed = ops.pack_weight_int8(torch.from_numpy(raw), int(qtype), in_features)
    x = torch.randn(AMX_MIN_ROWS - 1, in_features, generator=torch.Generator().manual_seed(5))
    out = torch.empty(x.shape[0], out_features)
    ops.linear_int8(out, x, packed, int(qtype), None)
    # x quantized to int8 per act_span, not rounded to bfloat16: the int8 kernel's sums
    want = quantized_x(x, act_span(qtype)) @ reference(raw, qtype).T
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
