"""Bad inputs raise ValueError in every backend, before anything is written."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pagellm.attention.backend import AttentionOptions
from pagellm.attention.selector import get_attn_backend
from pagellm.attention.synthetic import make_batch
from pagellm.kernels import ops

BACKENDS = ["torch_ref", "torch_sdpa"] + (["cpu_paged"] if ops.available() else [])
SEQS = [(3, 10), (1, 5)]


def call(name: str, batch, **overrides) -> torch.Tensor:
    args = dict(query=batch.query, key=batch.key, value=batch.value, kv_cache=batch.kv_cache,
                metadata=batch.metadata, scale=batch.scale)
    args.update(overrides)
    return get_attn_backend(name, "cpu").forward(**args)


@pytest.mark.parametrize("name", BACKENDS)
def test_num_heads_not_a_multiple_of_kv_heads(name: str) -> None:
    batch = make_batch(SEQS, 4, 3, 16, 8)
    with pytest.raises(ValueError, match="multiple"):
        call(name, batch)


@pytest.mark.parametrize("name", BACKENDS)
def test_head_dim_mismatch(name: str) -> None:
    batch = make_batch(SEQS, 4, 2, 16, 8)
    with pytest.raises(ValueError):
        call(name, batch, kv_cache=torch.zeros(2, 8, 8, 2, 32))


@pytest.mark.parametrize("name", BACKENDS)
def test_query_start_loc_must_cover_the_tokens(name: str) -> None:
    batch = make_batch(SEQS, 4, 2, 16, 8)
    meta = dataclasses.replace(batch.metadata, query_start_loc_cpu=[0, 3, 5])
    with pytest.raises(ValueError, match="query_start_loc"):
        call(name, batch, metadata=meta)


@pytest.mark.parametrize("name", BACKENDS)
def test_context_shorter_than_new_tokens(name: str) -> None:
    batch = make_batch(SEQS, 4, 2, 16, 8)
    meta = dataclasses.replace(batch.metadata, seq_lens_cpu=[2, 5])
    with pytest.raises(ValueError, match="shorter"):
        call(name, batch, metadata=meta)


@pytest.mark.parametrize("name", BACKENDS)
def test_block_table_too_narrow(name: str) -> None:
    batch = make_batch(SEQS, 4, 2, 16, 8)
    meta = dataclasses.replace(batch.metadata, block_table=batch.metadata.block_table[:, :1])
    with pytest.raises(ValueError, match="block_table"):
        call(name, batch, metadata=meta)


@pytest.mark.parametrize("name", BACKENDS)
def test_slot_mapping_length(name: str) -> None:
    batch = make_batch(SEQS, 4, 2, 16, 8)
    meta = dataclasses.replace(batch.metadata, slot_mapping=batch.metadata.slot_mapping[:-1])
    with pytest.raises(ValueError, match="slot_mapping"):
        call(name, batch, metadata=meta)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("bad", ["metadata", "options"])
def test_a_rejected_call_writes_nothing(name: str, bad: str) -> None:
    # AttentionBackend.forward checks the inputs and the options before the backend's cache write.
    batch = make_batch(SEQS, 4, 2, 32, 8)
    before = batch.kv_cache.clone()
    if bad == "metadata":
        overrides = dict(metadata=dataclasses.replace(batch.metadata, seq_lens_cpu=[2, 5]))
    else:
        overrides = dict(options=AttentionOptions(sliding_window=0))
    with pytest.raises(ValueError):
        call(name, batch, **overrides)
    assert torch.equal(batch.kv_cache.view(torch.uint8), before.view(torch.uint8))  # bytes: unused slots hold NaN


@pytest.mark.skipif(not ops.available(), reason="C++ kernel unavailable")
def test_kernel_rejects_out_of_range_block_ids() -> None:
    # A corrupt block table must not read outside the cache.
    batch = make_batch(SEQS, 4, 2, 32, 8)  # a head size the kernel itself handles
    table = batch.metadata.block_table.clone()
    table[0, 0] = batch.kv_cache.shape[1] + 5
    meta = dataclasses.replace(batch.metadata, block_table=table)
    with pytest.raises(ValueError, match="uses block"):
        call("cpu_paged", batch, metadata=meta)


@pytest.mark.skipif(not ops.available(), reason="C++ kernel unavailable")
def test_kernel_rejects_out_of_range_slots() -> None:
    batch = make_batch(SEQS, 4, 2, 32, 8)
    slots = batch.metadata.slot_mapping.clone()
    slots[-1] = batch.kv_cache.shape[1] * batch.kv_cache.shape[2]
    meta = dataclasses.replace(batch.metadata, slot_mapping=slots)
    with pytest.raises(ValueError, match="slot"):
        call("cpu_paged", batch, metadata=meta)
