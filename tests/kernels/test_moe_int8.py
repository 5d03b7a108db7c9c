"""ops.moe_int8, a mixture-of-experts layer's experts in one call, against its reference: each
expert's GGUFInt8Method calls on its rows, which it must equal bit for bit."""
from __future__ import annotations

import functools

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf_blocks import random_gguf_weight, random_moe_layer

from pagellm.kernels import ops
from pagellm.layers.linear_method import GGUFInt8Method
from pagellm.layers.moe import FusedMoE

pytestmark = [
    pytest.mark.skipif(not ops.int8_matmul_available(), reason="no int8 dot products in this build"),
    pytest.mark.usefixtures("no_amx"),  # every product on the int8 kernel, whatever its rows
]

T = GGMLQuantizationType
# (gate_up type, down type): Q4_K_M's mix both ways, the legacy types, one type for both.
TYPE_PAIRS = [(T.Q4_K, T.Q6_K), (T.Q6_K, T.Q4_K), (T.Q8_0, T.Q4_0), (T.Q4_0, T.Q8_0), (T.Q4_K, T.Q4_K)]
NUM_EXPERTS = 6


@pytest.fixture(autouse=True)
def _restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@functools.lru_cache(maxsize=None)
def experts(gate_up_type: T, down_type: T, hidden: int, inter: int) -> tuple[list[GGUFInt8Method], list[GGUFInt8Method]]:
    gate_ups, downs = [], []
    for e in range(NUM_EXPERTS):
        gate = random_gguf_weight(gate_up_type, inter, hidden, seed=3 * e)
        up = random_gguf_weight(gate_up_type, inter, hidden, seed=3 * e + 1)
        gate_ups.append(GGUFInt8Method([gate, up], gate_up=True))
        downs.append(GGUFInt8Method(random_gguf_weight(down_type, hidden, inter, seed=3 * e + 2)))
    assert all(m.fused_gate_up for m in gate_ups)
    return gate_ups, downs


def reference(
    x: torch.Tensor, counts: list[int], gate_ups: list[GGUFInt8Method], downs: list[GGUFInt8Method], activation: str = "silu"
) -> torch.Tensor:
    out = torch.empty_like(x)
    start = 0
    for e, count in enumerate(counts):
        if count:
            rows = x[start : start + count]
            out[start : start + count] = downs[e].apply(gate_ups[e].apply_gated(rows, None, activation), None)
            start += count
    return out


def fused(
    x: torch.Tensor, counts: list[int], gate_ups: list[GGUFInt8Method], downs: list[GGUFInt8Method], activation: str = "silu"
) -> torch.Tensor:
    out = torch.empty((x.shape[0], downs[0].out_features))
    ops.moe_int8(
        out, x, [m.packed for m in gate_ups], int(gate_ups[0].ggml_type), [m.packed for m in downs],
        int(downs[0].ggml_type), torch.tensor(counts, dtype=torch.int64), activation,
    )
    return out


# Row counts per expert: 0, 1, 2 and many rows, a lone expert, all rows on one, P from 1 to 300.
COUNTS = [
    [0, 0, 1, 0, 0, 0],
    [1, 1, 1, 1, 1, 1],
    [2, 0, 1, 0, 2, 1],
    [0, 7, 0, 0, 9, 0],
    [13, 1, 0, 2, 6, 8],
    [0, 0, 0, 40, 0, 0],
    [50, 3, 0, 100, 1, 146],
]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("hidden", "inter"), [(256, 512), (512, 256)])
@pytest.mark.parametrize(("gate_up_type", "down_type"), TYPE_PAIRS, ids=lambda t: t.name)
def test_moe_int8_equals_per_expert_methods(gate_up_type: T, down_type: T, hidden: int, inter: int, threads: int) -> None:
    torch.set_num_threads(threads)
    gate_ups, downs = experts(gate_up_type, down_type, hidden, inter)
    for i, counts in enumerate(COUNTS):
        x = torch.randn(sum(counts), hidden, generator=torch.Generator().manual_seed(i))
        got, want = fused(x, counts, gate_ups, downs), reference(x, counts, gate_ups, downs)
        assert torch.equal(got, want), f"counts {counts}: max diff {(got - want).abs().max().item()}"


def test_moe_int8_random_routing() -> None:
    gate_ups, downs = experts(T.Q4_K, T.Q6_K, 256, 512)
    gen = torch.Generator().manual_seed(7)
    for rows in (1, 3, 16, 64, 129, 300):
        ids = torch.randint(0, NUM_EXPERTS, (rows,), generator=gen)
        counts = torch.bincount(ids, minlength=NUM_EXPERTS).tolist()
        x = torch.randn(rows, 256, generator=gen)
        assert torch.equal(fused(x, counts, gate_ups, downs), reference(x, counts, gate_ups, downs))


@pytest.mark.parametrize("activation", [a for a in ops.FUSED_ACTIVATIONS if a != "silu"])
def test_moe_int8_takes_every_fused_activation(activation: str) -> None:
    gate_ups, downs = experts(T.Q8_0, T.Q4_K, 256, 512)
    counts = [13, 1, 0, 2, 6, 8]
    x = torch.randn(sum(counts), 256, generator=torch.Generator().manual_seed(3)) * 3
    got, want = fused(x, counts, gate_ups, downs, activation), reference(x, counts, gate_ups, downs, activation)
    assert torch.equal(got, want)
    assert not torch.equal(got, fused(x, counts, gate_ups, downs))


def test_moe_int8_rejects_bad_input() -> None:
    gate_ups, downs = experts(T.Q4_K, T.Q6_K, 256, 512)
    gu, dn = [m.packed for m in gate_ups], [m.packed for m in downs]
    x = torch.randn(4, 256)
    out = torch.empty(4, 256)
    counts = torch.tensor([1, 1, 2, 0, 0, 0])
    qk, q6 = int(T.Q4_K), int(T.Q6_K)
    with pytest.raises(ValueError, match="sum"):
        ops.moe_int8(out, x, gu, qk, dn, q6, torch.tensor([1, 1, 1, 0, 0, 0]))
    with pytest.raises(ValueError, match="negative"):
        ops.moe_int8(out, x, gu, qk, dn, q6, torch.tensor([5, -1, 0, 0, 0, 0]))
    with pytest.raises(ValueError, match="counts"):
        ops.moe_int8(out, x, gu, qk, dn, q6, counts[:5])
    with pytest.raises(ValueError, match="same number"):
        ops.moe_int8(out, x, gu, qk, dn[:5], q6, counts)
    with pytest.raises(ValueError, match="down"):  # the down panels read as another type
        ops.moe_int8(out, x, gu, qk, dn, qk, counts)
    with pytest.raises(ValueError, match="gate_up"):
        ops.moe_int8(out, x, gu[:1] + dn[1:], qk, dn, q6, counts)
    with pytest.raises(ValueError, match="not one"):
        ops.moe_int8(out, x, gu, 1, dn, q6, counts)


def moe_layer(gate_up_type: T, down_type: T, hidden: int = 256, inter: int = 512, num_experts: int = 8) -> FusedMoE:
    router = torch.randn(num_experts, hidden, generator=torch.Generator().manual_seed(0)) * 0.1
    return random_moe_layer(gate_up_type, down_type, hidden, inter, num_experts, 2, router)


@pytest.mark.parametrize(("gate_up_type", "down_type"), [(T.Q4_K, T.Q6_K), (T.Q8_0, T.Q8_0)], ids=lambda t: t.name)
def test_fused_moe_fast_path_equals_loop(gate_up_type: T, down_type: T, monkeypatch: pytest.MonkeyPatch) -> None:
    moe = moe_layer(gate_up_type, down_type)
    calls = []
    op = ops.moe_int8
    monkeypatch.setattr(ops, "moe_int8", lambda *args: calls.append(1) or op(*args))
    for tokens in (1, 5, 40):
        x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(tokens))
        fast = moe(x)
        assert calls, "the fused op was not used"
        calls.clear()
        with monkeypatch.context() as m:
            m.setattr(FusedMoE, "_int8_args", lambda self: None)
            loop = moe(x)
        assert not calls
        assert torch.equal(fast, loop)


def test_fused_moe_keeps_loop_for_other_methods(monkeypatch: pytest.MonkeyPatch) -> None:
    moe = FusedMoE(64, 4, 2, 32)
    for module in (moe.gate, *(p for e in moe.experts for p in (e.gate_up_proj, e.down_proj))):
        for shard in module.shard_sizes:
            module.load_shard(shard or None, torch.randn(module.shard_range(shard)[1], module.in_features) * 0.1)
        module.process_weights_after_loading()
    monkeypatch.setattr(ops, "moe_int8", lambda *args: pytest.fail("float experts took the int8 op"))
    assert moe(torch.randn(3, 64)).shape == (3, 64)
