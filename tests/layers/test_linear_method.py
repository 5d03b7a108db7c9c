"""Each linear layer's method, chosen from the checkpoint's tensors as stored and the precision."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf_blocks import random_gguf_weight
from torch.nn import functional as F

from pagellm.config import EXACT_LINEAR, LinearPrecision
from pagellm.kernels import ops
from pagellm.layers.gguf_types import GGUFWeight
from pagellm.layers.linear import GatedLinear, Linear, narrow
from pagellm.layers.linear_method import PACKED_MAX_ROWS, BF16Method, DenseMethod, GGUFInt8Method, SegmentedMethod, create_linear_method

INT8 = LinearPrecision(kind="int8", fallback="bfloat16")
needs_int8 = pytest.mark.skipif(not ops.int8_matmul_available(), reason="no int8 dot products in this build")
needs_bf16 = pytest.mark.skipif(not ops.bf16_matmul_available(), reason="no bf16 dot products in this build")
CPU = torch.device("cpu")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def test_the_exact_path_dequantizes_with_ggufs_own_dequantizer() -> None:
    source = random_gguf_weight(T.Q4_K, 64, 512)
    method = create_linear_method([source], EXACT_LINEAR, CPU, torch.float32)
    assert isinstance(method, DenseMethod)
    assert torch.equal(method.weight, source.dequantize())
    x = torch.randn(5, 512)
    torch.testing.assert_close(method.apply(x, None), x @ source.dequantize().T, rtol=1e-4, atol=1e-4)


@needs_int8
@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K])
def test_gguf_blocks_go_to_the_int8_kernel_at_every_batch_size(ggml_type: T) -> None:
    source = random_gguf_weight(ggml_type, 96, 512, seed=int(ggml_type))
    method = create_linear_method([source], INT8, CPU, torch.float32)
    assert isinstance(method, GGUFInt8Method) and method.ggml_type == ggml_type
    weight = source.dequantize()
    generator = torch.Generator().manual_seed(int(ggml_type))
    bias = torch.randn(96, generator=generator)
    for rows in (1, 13, 300):
        x = torch.randn(rows, 512, generator=generator)
        # One row's error is wider than many rows' (docs/kernels.md, "One row's error").
        assert rel_err(method.apply(x, bias), F.linear(x, weight, bias)) < 2.5e-2


@needs_int8
def test_a_fused_projection_of_mixed_types_runs_each_part_into_its_columns() -> None:
    # Q4_K_M keeps attn_v in Q6_K beside Q4_K attn_q / attn_k; an F16 part goes to the fallback.
    parts = [random_gguf_weight(T.Q4_K, 64, 256, 1), random_gguf_weight(T.Q4_K, 32, 256, 2), random_gguf_weight(T.Q6_K, 32, 256, 3)]
    f16 = (torch.randn(16, 256) * 0.05).half()
    method = create_linear_method([*parts, f16], INT8, CPU, torch.float32)
    assert isinstance(method, SegmentedMethod)
    assert [type(p).__name__ for p in method.parts] == ["GGUFInt8Method", "GGUFInt8Method", "BF16Method"]
    assert [p.out_features for p in method.parts] == [96, 32, 16]  # the two Q4_K parts are one
    weight = torch.cat([p.dequantize() for p in parts] + [f16.float()])
    bias = torch.randn(144)
    x = torch.randn(7, 256)
    assert rel_err(method.apply(x, bias), F.linear(x, weight, bias)) < 1e-2


@needs_int8
def test_gate_up_blocks_fuse_the_activation() -> None:
    layer = GatedLinear(256, 128, shard_sizes={"gate": 64, "up": 64}, activation="silu")
    gate, up = random_gguf_weight(T.Q4_K, 64, 256, 4), random_gguf_weight(T.Q4_K, 64, 256, 5)
    layer.load_shard("gate", gate)
    layer.load_shard("up", up)
    layer.process_weights_after_loading(INT8)
    assert layer.method.fused_gate_up
    x = torch.randn(9, 256)
    want = F.silu(x @ gate.dequantize().T) * (x @ up.dequantize().T)
    assert rel_err(layer(x), want) < 2e-2


@needs_bf16
def test_a_bfloat16_checkpoint_packs_from_its_own_values() -> None:
    weight = (torch.randn(64, 128) * 0.1).bfloat16()
    method = create_linear_method([weight], LinearPrecision(kind="bfloat16", fallback="bfloat16"), CPU, torch.float32)
    assert isinstance(method, BF16Method)
    assert method.nbytes == 2 * weight.numel()  # no float32 copy beside the panels
    x = torch.randn(3, 128)
    assert rel_err(method.apply(x, None), x @ weight.float().T) < 1e-2


def test_a_layer_checks_its_shards_and_frees_them_once_processed() -> None:
    layer = Linear(32, 48, shard_sizes={"q": 32, "k": 8, "v": 8})
    with pytest.raises(ValueError, match="expected"):
        layer.load_shard("k", torch.zeros(9, 32))
    layer.load_shard("q", torch.randn(32, 32))
    layer.load_shard("k", torch.randn(8, 32))
    assert layer.missing_shards == ["v"]
    with pytest.raises(ValueError, match="never loaded"):
        layer.process_weights_after_loading()
    layer.load_shard("v", torch.randn(8, 32))
    assert layer.process_weights_after_loading() > 0
    assert layer.missing_shards == [] and layer._loaded == {}
    assert layer.shard_range("k") == (32, 8)


def test_column_cuts_move_whole_blocks_or_dequantize() -> None:
    source = random_gguf_weight(T.Q4_K, 8, 1024, 6)
    cut = narrow(source, 1, 512, 512)
    assert isinstance(cut, GGUFWeight) and torch.equal(cut.dequantize(), source.dequantize()[:, 512:])
    inside = narrow(source, 1, 128, 512)  # falls inside a 256-wide block: values instead
    assert isinstance(inside, torch.Tensor) and torch.equal(inside, source.dequantize()[:, 128:640])
    rows = narrow(source, 0, 2, 3)
    assert torch.equal(rows.dequantize(), source.dequantize()[2:5])


@pytest.mark.skipif(not ops.available(), reason="C++ kernels unavailable")
def test_float32_panels_take_small_batches_up_to_the_measured_limit(monkeypatch) -> None:
    from pagellm.kernels.context import KernelContext
    from pagellm.kernels.tuning import F32_PANELS, CpuTuning, RowLimits

    weight = torch.randn(48, 64)
    kernels = KernelContext()
    method = create_linear_method([weight], EXACT_LINEAR, CPU, torch.float32, kernels=kernels)
    assert isinstance(method, DenseMethod) and method.panels is not None
    assert method.packed_max_rows == PACKED_MAX_ROWS  # nothing measured yet: the default
    kernels.tuning = CpuTuning(row_limits=((F32_PANELS, RowLimits(8)),))  # measured after the load
    assert method.packed_max_rows == 8
    calls: list[int] = []
    real = ops.linear_packed
    monkeypatch.setattr(ops, "linear_packed", lambda out, x, *a: (calls.append(x.shape[0]), real(out, x, *a)))
    for rows in (1, 8, 9, 200):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(method.apply(x, None), x @ weight.T, rtol=1e-5, atol=1e-5)
    assert calls == [1, 8]  # BLAS beyond the limit


def test_a_row_permutation_is_copied_only_when_the_rows_are_read() -> None:
    source = random_gguf_weight(T.Q4_K, 16, 512, 7)
    order = torch.randperm(16, generator=torch.Generator().manual_seed(0))
    permuted = source.permute_rows(order)
    assert permuted.stored is source.stored and permuted._ordered is None  # nothing copied yet
    assert permuted.shape == (16, 512) and permuted.nbytes == source.nbytes
    eager = source.data.index_select(0, order)
    twice = permuted.permute_rows(torch.arange(15, -1, -1))
    cut = permuted.narrow_rows(4, 8).narrow_cols(256, 256)
    assert cut.stored.data_ptr() == source.stored.data_ptr() + cut.row_bytes  # still a view of the file's rows
    assert torch.equal(permuted.data, eager)
    assert torch.equal(twice.data, eager.flip(0))
    assert torch.equal(cut.dequantize(), source.dequantize()[order][4:12, 256:])
