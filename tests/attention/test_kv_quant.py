"""The KV cache's 8-bit formats: layout, rounding, scales, and the kernels' bytes against torch's."""
from __future__ import annotations

import pytest
import torch

from pagellm.attention.kv_quant import (
    K_SCALE_CONSTANT,
    V_SCALE_CONSTANT,
    KVScales,
    bytes_per_token_head,
    cache_head_dim,
    dequantize,
    has_padded_rows,
    kv_cache_dtype_name,
    narrow_kv_view,
    quantize,
    row_width,
    write_kv_cache,
)
from pagellm.kernels import ops

EIGHT_BIT = [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]


def test_row_layout_and_sizes() -> None:
    assert row_width(64, torch.int8) == 66 and row_width(64, torch.float8_e4m3fn) == 64 and row_width(64, torch.bfloat16) == 64
    assert bytes_per_token_head(64, torch.int8) == 66
    assert bytes_per_token_head(64, torch.float8_e5m2) == 64
    assert bytes_per_token_head(64, torch.bfloat16) == 128
    assert cache_head_dim(torch.zeros(2, 1, 16, 3, 66, dtype=torch.int8)) == 64
    assert cache_head_dim(torch.zeros(2, 1, 16, 3, 64, dtype=torch.float8_e4m3fn)) == 64
    assert [kv_cache_dtype_name(d) for d in EIGHT_BIT + [torch.bfloat16]] == ["fp8_e4m3", "fp8_e5m2", "int8", "bfloat16"]


def test_int8_rows_hold_values_then_their_float16_scale() -> None:
    x = torch.tensor([[1.0, -2.0, 0.5, 127.0], [0.0, 0.0, 0.0, 0.0]])
    stored = quantize(x, torch.int8)
    assert stored.shape == (2, 6) and stored.dtype == torch.int8
    scale = stored[:, 4:].contiguous().view(torch.float16).float().squeeze(1)
    assert scale.tolist() == [1.0, 0.0]  # absmax / 127, and 0 for an all-zero row
    assert stored[0, :4].tolist() == [1, -2, 0, 127]  # 0.5 rounds half to even
    assert stored[1, :4].tolist() == [0, 0, 0, 0]
    torch.testing.assert_close(dequantize(stored), torch.tensor([[1.0, -2.0, 0.0, 127.0], [0.0] * 4]))


def test_int8_error_is_at_most_half_a_step() -> None:
    x = torch.randn(500, 3, 64) * torch.logspace(-3, 2, 500)[:, None, None]
    stored = quantize(x, torch.int8)
    step = stored[..., -2:].contiguous().view(torch.float16).float()
    assert ((dequantize(stored) - x).abs() <= step * 0.5 * (1 + 1e-3) + 1e-12).all()


@pytest.mark.parametrize(("dtype", "mantissa_bits"), [(torch.float8_e4m3fn, 3), (torch.float8_e5m2, 2)])
def test_fp8_divides_by_the_scale_saturates_and_rounds(dtype: torch.dtype, mantissa_bits: int) -> None:
    limit = torch.finfo(dtype).max
    x = torch.tensor([0.0, 1.0, -3.0, 1e6, -1e6, 0.3])
    stored = quantize(x, dtype, scale=0.5)
    assert stored.dtype == dtype
    values = dequantize(stored, scale=0.5)
    assert values[:3].tolist() == [0.0, 1.0, -3.0]
    assert values[3].item() == limit * 0.5 and values[4].item() == -limit * 0.5  # saturated, not NaN
    assert abs(values[5].item() - 0.3) <= 0.3 * 2.0 ** -(mantissa_bits + 1)


def test_scales_are_checked_measured_and_updated_in_place() -> None:
    scales = KVScales()
    tensor = scales.device_tensor(torch.device("cpu"))
    assert tensor.tolist() == [1.0, 1.0]
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="positive finite"):
            scales.set(bad, 1.0)
    scales.calculate = True
    scales.measure(torch.tensor([[[3.0, -400.0]]]), torch.tensor([[[50.0, 2.0]]]))
    assert not scales.calculate
    assert (scales.k_scale, scales.v_scale) == (400.0 / K_SCALE_CONSTANT, 50.0 / V_SCALE_CONSTANT)
    assert scales.device_tensor(torch.device("cpu")) is tensor and tensor.tolist() == [2.0, 0.5]


@pytest.mark.parametrize("dtype", EIGHT_BIT)
def test_torch_write_puts_each_token_in_its_slot(dtype: torch.dtype) -> None:
    cache = torch.zeros(2, 3, 4, 2, row_width(8, dtype), dtype=dtype)
    key, value = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    write_kv_cache(key, value, cache, torch.tensor([5, 10]), KVScales(0.5, 0.25))
    flat = cache.view(2, 12, 2, -1)
    k_scale, v_scale = (0.5, 0.25) if dtype != torch.int8 else (1.0, 1.0)
    assert torch.equal(flat[0, [5, 10]].view(torch.uint8), quantize(key, dtype, k_scale).view(torch.uint8))
    assert torch.equal(flat[1, [5, 10]].view(torch.uint8), quantize(value, dtype, v_scale).view(torch.uint8))
    assert not flat[:, [0, 1, 2, 3, 4, 6, 7, 8, 9, 11]].view(torch.uint8).any()


@pytest.mark.skipif(not ops.available(), reason="the C++ kernels did not build")
@pytest.mark.parametrize("dtype", EIGHT_BIT)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_kernel_writes_the_bytes_torch_writes(dtype: torch.dtype, head_dim: int) -> None:
    # Magnitudes from subnormal fp8 to past saturation, exact halves, zero rows and float16 scale edges.
    gen = torch.Generator().manual_seed(0)
    num_tokens, num_kv_heads = 40, 3
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * torch.logspace(-6, 4, num_tokens)[:, None, None]
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * 3
    key[0] = 0.0
    key[1] = torch.arange(head_dim).float() / 2 - 16  # halves: round to even
    value[2, 0] = 1e-9  # an int8 scale below float16's range
    value[3] = 1e12  # an int8 scale clamped to float16's largest
    slots = torch.randperm(4 * 16, generator=gen)[:num_tokens]
    k_scale, v_scale = 0.37, 2.5
    cache = torch.zeros(2, 4, 16, num_kv_heads, row_width(head_dim, dtype), dtype=dtype)
    expected = cache.clone()
    assert ops.write_kv_cache_supports(key, value, cache, slots)
    ops.write_kv_cache(cache, key, value, slots, k_scale, v_scale)
    write_kv_cache(key, value, expected, slots, KVScales(k_scale, v_scale))
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.skipif(not ops.available(), reason="the C++ kernels did not build")
def test_kernel_takes_only_float32_for_an_eight_bit_cache() -> None:
    cache = torch.zeros(2, 1, 16, 1, 64, dtype=torch.float8_e4m3fn)
    rows = torch.zeros(1, 1, 64, dtype=torch.float8_e4m3fn)
    assert not ops.write_kv_cache_supports(rows, rows, cache, torch.tensor([0]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8], ids=str)
def test_narrow_view_pads_into_wider_token_rows(dtype) -> None:
    wide = torch.zeros(2, 5, 4, 2, row_width(32, dtype), dtype=dtype)
    narrow = narrow_kv_view(wide, 3, 16)
    token = 2 * row_width(32, dtype)
    assert narrow.shape == (2, 5, 4, 3, row_width(16, dtype)) and narrow.data_ptr() == wide.data_ptr()
    assert narrow.stride()[:3] == (5 * 4 * token, 4 * token, token) and not narrow.is_contiguous()
    assert has_padded_rows(narrow) and has_padded_rows(wide) and not has_padded_rows(wide[:, ::2])
    same_width = narrow_kv_view(torch.zeros(2, 5, 4, 2, 32), 4, 16)  # 4 x 16 in rows of 2 x 32: a plain view
    assert same_width.shape == (2, 5, 4, 4, 16) and same_width.is_contiguous()
    with pytest.raises(ValueError, match="do not fit"):
        narrow_kv_view(wide, 3, 32)
    with pytest.raises(ValueError, match="contiguous"):
        narrow_kv_view(narrow, 1, 16)
