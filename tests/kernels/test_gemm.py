"""The packed-weight small-batch matmul against torch's, and the model's use of it."""
from __future__ import annotations

import pytest
import torch

from pagellm.kernels.build import load_kernels
from pagellm.models.layers import PACKED_MAX_ROWS, Linear, linear, pack_weight

pytestmark = pytest.mark.skipif(not load_kernels(), reason="C++ kernels unavailable")


@pytest.mark.parametrize("rows", [1, 5, 12, 13, 32, 96, 200])  # below, at and past a 12-row micro-tile
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (50, 70), (576, 1536), (33, 1200)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_packed_matches_torch(rows: int, out_features: int, in_features: int, with_bias: bool) -> None:
    torch.manual_seed(rows * 7 + out_features)
    weight = torch.randn(out_features, in_features) * 0.05
    bias = torch.randn(out_features) if with_bias else None
    x = torch.randn(rows, in_features)
    out = torch.empty(rows, out_features)
    torch.ops.pagellm_gemm.linear_packed(out, x, pack_weight(weight), bias)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=2e-5)


def test_linear_packed_reads_strided_rows_and_rejects_mismatches() -> None:
    weight = torch.randn(40, 64)
    packed = pack_weight(weight)
    x = torch.randn(6, 100)[:, :64]
    out = torch.empty(6, 40)
    torch.ops.pagellm_gemm.linear_packed(out, x, packed, None)
    torch.testing.assert_close(out, x @ weight.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="input width"):
        torch.ops.pagellm_gemm.linear_packed(out, torch.randn(6, 65), packed, None)
    with pytest.raises(ValueError, match="columns"):
        torch.ops.pagellm_gemm.linear_packed(torch.empty(6, 80), x, packed, None)


def test_linear_module_uses_the_packed_copy_only_for_small_batches(monkeypatch) -> None:
    layer = Linear(64, 48, bias=True)
    assert layer.pack() == pack_weight(layer.weight).numel() * 4
    calls = []
    real = torch.ops.pagellm_gemm.linear_packed
    monkeypatch.setattr(torch.ops.pagellm_gemm, "linear_packed", lambda *a: (calls.append(a[1].shape[0]), real(*a)))
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
