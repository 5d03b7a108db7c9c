"""The grouped LoRA product, the step's segments, and the layers' unfused gate/up product."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf_blocks import random_gguf_weight

from pagellm.config import LinearPrecision
from pagellm.kernels import ops
from pagellm.layers.linear import GatedLinear, Linear
from pagellm.lora.layers import LoRABatch, LoRALayerWeights, LoRAStepContext, lora_shrink_expand


def test_lora_shrink_expand_adds_each_segments_delta():
    torch.manual_seed(0)
    x, y = torch.randn(10, 12), torch.randn(10, 7)
    lora_a, lora_b = torch.randn(3, 4, 12), torch.randn(3, 7, 4)
    starts, slots = torch.tensor([0, 3, 4, 8, 10]), torch.tensor([2, -1, 0, 2])
    expected = y.clone()
    for (a, b), k in zip([(0, 3), (3, 4), (4, 8), (8, 10)], [2, -1, 0, 2]):
        if k >= 0:
            expected[a:b] += x[a:b] @ lora_a[k].T @ lora_b[k].T
    lora_shrink_expand(y, x, lora_a, lora_b, starts, slots)
    torch.testing.assert_close(y, expected)


@pytest.mark.parametrize(
    "length, slots",
    [
        (1, [3, 0, -1, 2, 1, 0]),  # a slot twice: each segment's adapter gathered
        (3, [3, 0, -1, 2, 1, 0]),
        (1, [3, 0, -1, 2, 1]),  # every slot once: the pools read in place
        (2, [1, -1, 3, 0]),
        (1, [2, 1, 2, -1]),  # two of four slots: gathered
    ],
)
def test_lora_shrink_expand_on_equal_segments_matches_the_per_segment_sum(length, slots):
    """Decode steps (one row per request, a base row between) take the batched paths."""
    torch.manual_seed(5)
    x, y = torch.randn(len(slots) * length, 16), torch.randn(len(slots) * length, 9)
    lora_a, lora_b = torch.randn(4, 5, 16), torch.randn(4, 9, 5)
    expected = y.clone()
    for i, k in enumerate(slots):
        if k >= 0:
            rows = slice(i * length, (i + 1) * length)
            expected[rows] += x[rows] @ lora_a[k].T @ lora_b[k].T
    starts = torch.arange(0, len(slots) * length + 1, length)
    lora_shrink_expand(y, x, lora_a, lora_b, starts, torch.tensor(slots))
    torch.testing.assert_close(y, expected)


def test_lora_shrink_expand_takes_bfloat16_pools():
    torch.manual_seed(1)
    x, y = torch.randn(4, 8), torch.zeros(4, 5)
    lora_a, lora_b = torch.randn(2, 3, 8).bfloat16(), torch.randn(2, 5, 3).bfloat16()
    lora_shrink_expand(y, x, lora_a, lora_b, torch.tensor([0, 4]), torch.tensor([1]))
    torch.testing.assert_close(y, x @ lora_a[1].float().T @ lora_b[1].float().T)


def test_segments_merge_neighbours_and_vanish_without_adapters():
    batch = LoRABatch.from_rows([3, 1, 1, 5, 2], [0, 0, -1, 1, 1])
    assert batch.seg_starts.tolist() == [0, 4, 5, 12]
    assert batch.seg_slots.tolist() == [0, -1, 1]
    assert batch.seg_starts.dtype == batch.seg_slots.dtype == torch.int64
    assert LoRABatch.from_rows([2, 3], [-1, -1]) is None


def test_fused_shards_get_their_own_deltas():
    """q/k/v's adapters: an untargeted shard (k) gets no delta, each other shard its own."""
    torch.manual_seed(2)
    context = LoRAStepContext()
    weights = LoRALayerWeights(6, {"q": 4, "k": 2, "v": 2}, num_slots=2, max_rank=3, context=context)
    a_q, b_q, a_v, b_v = torch.randn(2, 6), torch.randn(4, 2), torch.randn(3, 6), torch.randn(2, 3)
    weights.set_slot(1, {"q": (a_q, b_q), "v": (a_v, b_v)})
    x, y = torch.randn(5, 6), torch.zeros(5, 8)
    weights.add_delta(y, x)  # no batch published: nothing added
    assert not y.any()
    context.batch = LoRABatch.from_rows([2, 3], [-1, 1])
    weights.add_delta(y, x)
    assert not y[:2].any()
    torch.testing.assert_close(y[2:, :4], x[2:] @ a_q.T @ b_q.T)
    assert not y[2:, 4:6].any()
    torch.testing.assert_close(y[2:, 6:], x[2:] @ a_v.T @ b_v.T)
    with pytest.raises(ValueError, match="do not fit"):
        weights.set_slot(0, {"q": (torch.randn(4, 6), torch.randn(4, 4))})  # rank 4 > max_rank 3


def _gate_up(precision: LinearPrecision, sources) -> GatedLinear:
    layer = GatedLinear(64, 128, shard_sizes={"gate": 64, "up": 64})
    layer.load_shard("gate", sources[0])
    layer.load_shard("up", sources[1])
    layer.process_weights_after_loading(precision)
    return layer


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
def test_gate_up_with_an_adapter_adds_the_delta_before_the_activation(kind):
    ops.available()
    if kind == "bfloat16" and not ops.bf16_matmul_available():
        pytest.skip("no bfloat16 dot products on this CPU")
    if kind == "int8" and not ops.int8_matmul_available():
        pytest.skip("no int8 dot products on this CPU")
    torch.manual_seed(3)
    if kind == "int8":
        sources = [random_gguf_weight(T.Q8_0, 64, 64, seed=s) for s in (0, 1)]
        dense = torch.cat([s.dequantize() for s in sources])
    else:
        sources = [torch.randn(64, 64) * 0.1, torch.randn(64, 64) * 0.1]
        dense = torch.cat(sources)
    layer = _gate_up(LinearPrecision(kind, kind), sources)
    x = torch.randn(5, 64)
    fused = layer(x)
    # The unfused product is the fused one's pre-activation, in the same arithmetic.
    unfused = layer.method.apply_gate_up(x, None)
    torch.testing.assert_close(ops.silu_and_mul(unfused), fused, rtol=1e-4, atol=1e-4)
    tol = 1e-4 if kind == "float32" else 0.1
    torch.testing.assert_close(unfused, x @ dense.T, rtol=tol, atol=tol)
    context = LoRAStepContext()
    layer.lora = LoRALayerWeights(64, layer.shard_sizes, 1, 4, context)
    a, b = torch.randn(4, 64), torch.randn(64, 4)
    layer.lora.set_slot(0, {"up": (a, b)})
    torch.testing.assert_close(layer(x), fused)  # no row has an adapter: the fused path
    context.batch = LoRABatch.from_rows([5], [0])
    delta = torch.cat([torch.zeros(5, 64), x @ a.T @ b.T], dim=1)
    torch.testing.assert_close(layer(x), ops.silu_and_mul(unfused + delta), rtol=1e-4, atol=1e-4)


def test_plain_linear_adds_its_delta():
    torch.manual_seed(4)
    layer = Linear(8, 6)
    weight = torch.randn(6, 8)
    layer.load_shard(None, weight)
    layer.process_weights_after_loading()
    context = LoRAStepContext()
    layer.lora = LoRALayerWeights(8, layer.shard_sizes, 2, 2, context)
    a, b = torch.randn(2, 8), torch.randn(6, 2)
    layer.lora.set_slot(1, {"": (a, b)})
    context.batch = LoRABatch.from_rows([1, 2], [1, -1])
    x = torch.randn(3, 8)
    expected = x @ weight.T
    expected[:1] += x[:1] @ a.T @ b.T
    torch.testing.assert_close(layer(x), expected)
