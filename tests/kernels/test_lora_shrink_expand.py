"""ops.lora_shrink_expand, batched multi-LoRA's grouped low-rank update, against its torch reference."""
from __future__ import annotations

import pytest
import torch

from pagellm.kernels import ops

pytestmark = pytest.mark.skipif(not ops.available(), reason="C++ kernels unavailable")


def adapter_pool(
    num_slots: int, max_rank: int, in_features: int, out_features: int, dtype: torch.dtype, ranks: list[int] | None = None, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """A pool of random adapters; slot ``i`` of rank ``ranks[i]`` is zero past it, as a served pool pads smaller ranks."""
    gen = torch.Generator().manual_seed(seed)
    lora_a = torch.randn(num_slots, max_rank, in_features, generator=gen) / in_features**0.5
    lora_b = torch.randn(num_slots, out_features, max_rank, generator=gen) / max_rank**0.5
    for slot, rank in enumerate(ranks or []):
        lora_a[slot, rank:] = 0
        lora_b[slot, :, rank:] = 0
    return lora_a.to(dtype), lora_b.to(dtype)


def segments(lengths: list[int], slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.tensor([0, *lengths]).cumsum(0)
    return starts, torch.tensor(slots, dtype=torch.int64)


def run_both(
    x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor, **kw
) -> tuple[torch.Tensor, torch.Tensor]:
    got, want = y.clone(), y.clone()
    ops.lora_shrink_expand(got, x, lora_a, lora_b, starts, slots, **kw)
    ops.lora_shrink_expand_reference(want, x, lora_a, lora_b, starts, slots)
    return got, want


# (in, out): SmolLM2-135M's fused q/k/v, and odd widths that cut vectors and output blocks.
SHAPES = [(576, 960), (77, 131), (33, 1000)]


@pytest.mark.parametrize("max_rank", [1, 8, 16, 64, 12, 24])  # 12, 24: neither a power of two nor a multiple of a vector
@pytest.mark.parametrize("in_features,out_features", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rows_each_with_its_own_adapter(max_rank: int, in_features: int, out_features: int, dtype: torch.dtype) -> None:
    num_rows = 32
    ranks = [max(1, max_rank >> (slot % 4)) for slot in range(num_rows)]  # smaller ranks zero-padded
    lora_a, lora_b = adapter_pool(num_rows, max_rank, in_features, out_features, dtype, ranks, seed=max_rank)
    x = torch.randn(num_rows, in_features)
    y = torch.randn(num_rows, out_features)
    starts, slots = segments([1] * num_rows, list(range(num_rows))[::-1])
    got, want = run_both(x, y, lora_a, lora_b, starts, slots)
    # float32 sums in another order; a bfloat16 pool is widened exactly, so the same bound holds
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("aten_min_rows", [ops.LORA_ATEN_MIN_ROWS, 10_000])  # long runs through ATen, and through the kernel's loops
def test_prefill_chunks_decode_rows_repeated_and_absent_slots(dtype: torch.dtype, aten_min_rows: int) -> None:
    in_features, out_features, max_rank = 200, 333, 16
    lora_a, lora_b = adapter_pool(5, max_rank, in_features, out_features, dtype, [16, 8, 1, 16, 4], seed=1)
    # a prefill chunk, decode rows, a chunk split into adjacent segments of one slot, an empty
    # segment, rows with no adapter, slot 0 again far from its first use
    lengths = [300, 1, 1, 0, 120, 130, 1, 7, 257, 1, 3]
    slot_ids = [2, 0, 4, 3, 1, 1, -1, 0, 3, -1, 2]
    starts, slots = segments(lengths, slot_ids)
    num_tokens = sum(lengths) + 5  # and rows past the last segment
    x = torch.randn(num_tokens, in_features)
    y = torch.randn(num_tokens, out_features)
    got, want = run_both(x, y, lora_a, lora_b, starts, slots, aten_min_rows=aten_min_rows)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)
    untouched = torch.zeros(num_tokens, dtype=torch.bool)
    for s, slot in enumerate(slot_ids):
        if slot < 0:
            untouched[starts[s] : starts[s + 1]] = True
    untouched[starts[-1] :] = True
    assert torch.equal(got[untouched], y[untouched])


def test_every_row_count_of_a_segment() -> None:
    # 1..9 rows cover every partial shrink tile (4 rows) in both the kernel's loops
    lora_a, lora_b = adapter_pool(3, 8, 64, 48, torch.float32, seed=2)
    lengths = list(range(1, 10))
    starts, slots = segments(lengths, [i % 3 for i in range(len(lengths))])
    x = torch.randn(sum(lengths), 64)
    got, want = run_both(x, torch.zeros(sum(lengths), 48), lora_a, lora_b, starts, slots)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_no_segments_and_all_skipped_leave_y_alone() -> None:
    lora_a, lora_b = adapter_pool(2, 8, 32, 40, torch.float32)
    x, y = torch.randn(4, 32), torch.randn(4, 40)
    for starts, slots in (segments([], []), segments([2, 0, 2], [-1, 0, -1])):
        got = y.clone()
        ops.lora_shrink_expand(got, x, lora_a, lora_b, starts, slots)
        assert torch.equal(got, y)


def test_threads_agree_with_one_thread() -> None:
    lora_a, lora_b = adapter_pool(32, 16, 576, 960, torch.bfloat16, seed=3)
    starts, slots = segments([1] * 32, list(range(32)))
    x, y = torch.randn(32, 576), torch.randn(32, 960)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = y.clone()
        ops.lora_shrink_expand(one, x, lora_a, lora_b, starts, slots)
    finally:
        torch.set_num_threads(threads)
    many = y.clone()
    ops.lora_shrink_expand(many, x, lora_a, lora_b, starts, slots)
    assert torch.equal(one, many)  # each task's sums are the same however tasks are shared out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [[1, 1, 1, 1], [40, 3, 1]])  # decode rows; a run long enough for ATen
def test_a_column_slice_of_y_is_updated_in_place(lengths: list[int], dtype: torch.dtype) -> None:
    """One shard of a fused projection's output: its columns take the delta, the others stay."""
    lora_a, lora_b = adapter_pool(3, 16, 64, 48, dtype)
    starts, slots = segments(lengths, [2, 0, 1, 0][: len(lengths)])
    x = torch.randn(sum(lengths), 64)
    fused = torch.randn(sum(lengths), 100)
    want = fused.clone()
    ops.lora_shrink_expand_reference(want[:, 30:78], x, lora_a, lora_b, starts, slots)
    got = fused.clone()
    ops.lora_shrink_expand(got[:, 30:78], x, lora_a, lora_b, starts, slots)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[:, :30], fused[:, :30]) and torch.equal(got[:, 78:], fused[:, 78:])


@pytest.mark.parametrize("impl", [ops.lora_shrink_expand, ops.lora_shrink_expand_reference])
def test_bad_inputs_raise_value_errors(impl) -> None:
    lora_a, lora_b = adapter_pool(2, 8, 32, 40, torch.float32)
    x, y = torch.randn(4, 32), torch.randn(4, 40)
    starts, slots = segments([2, 2], [0, 1])
    cases = [
        (dict(x=torch.randn(32, 4).T), "x must be a contiguous float32"),
        (dict(x=x.double()), "x must be a contiguous float32"),
        (dict(y=torch.randn(40, 4).T), "y must be a float32"),
        (dict(y=torch.randn(5, 40)), "x's rows"),
        (dict(lora_a=lora_a.bfloat16()), "both be float32 or both bfloat16"),
        (dict(lora_a=lora_a.half(), lora_b=lora_b.half()), "both be float32 or both bfloat16"),
        (dict(lora_a=lora_a[:, :, :16].contiguous()), "in_features"),
        (dict(lora_b=lora_b[:, :20].contiguous()), "lora_b must be"),
        (dict(seg_starts=starts.int()), "seg_starts must be"),
        (dict(seg_slots=slots[:1]), "seg_slots must be"),
        (dict(seg_starts=torch.tensor([0, 3, 2])), "ascending"),
        (dict(seg_starts=torch.tensor([0, 2, 5])), "seg_starts must"),
        (dict(seg_slots=torch.tensor([0, 2])), "not -1 or a slot"),
        (dict(seg_slots=torch.tensor([-2, 0])), "not -1 or a slot"),
    ]
    if impl is ops.lora_shrink_expand:  # the kernel's own layout rule; the reference takes strided pools
        cases.append((dict(lora_a=lora_a.transpose(1, 2).contiguous().transpose(1, 2)), "contiguous"))
    for change, message in cases:
        args = dict(y=y.clone(), x=x, lora_a=lora_a, lora_b=lora_b, seg_starts=starts, seg_slots=slots) | change
        with pytest.raises(ValueError, match=message):
            impl(**args)


def test_other_devices_take_the_reference(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(ops, "available", lambda: False)
    monkeypatch.setattr(ops, "lora_shrink_expand_reference", lambda *args: calls.append(args))
    lora_a, lora_b = adapter_pool(1, 4, 8, 8, torch.float32)
    starts, slots = segments([2], [0])
    ops.lora_shrink_expand(torch.zeros(2, 8), torch.randn(2, 8), lora_a, lora_b, starts, slots)
    assert len(calls) == 1
