"""The pooling math (pagellm.worker.pooler) on made-up hidden states: chunks fold into what one pass gives."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams
from pagellm.worker.input_batch import InputBatch
from pagellm.worker.pooler import Pooler, PoolingChunk, finish_embeddings, pooling_chunks

HIDDEN = 8
RAW = PoolingParams(dimensions=HIDDEN, normalize=False)


def reference(states: torch.Tensor, pooling_type: str) -> torch.Tensor:
    return {"LAST": states[-1], "MEAN": states.mean(dim=0), "CLS": states[0]}[pooling_type]


def run_in_chunks(pooler: Pooler, states: dict[str, torch.Tensor], chunk_sizes: list[dict[str, int]]) -> dict[str, list[float]]:
    """Feeds each step's chunks of several requests through one flat hidden tensor, as the runner lays them out."""
    done: dict[str, int] = {r: 0 for r in states}
    results: dict[str, list[float]] = {}
    for sizes in chunk_sizes:
        rows, chunks, flat = [], [], 0
        for req_id, n in sizes.items():
            start = done[req_id]
            rows.append(states[req_id][start : start + n])
            chunks.append(PoolingChunk(req_id, flat, flat + n, start, len(states[req_id]), RAW))
            flat += n
            done[req_id] += n
        out = pooler.pool(torch.cat(rows), chunks)
        assert set(out) == {c.req_id for c in chunks if c.finishes_prompt}
        results.update(out)
    return results


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_chunks_of_several_requests_pool_as_one_pass(pooling_type):
    gen = torch.Generator().manual_seed(0)
    states = {name: torch.randn(n, HIDDEN, generator=gen) for name, n in (("a", 10), ("b", 7), ("c", 1))}
    steps = [{"a": 4, "b": 3}, {"a": 4, "b": 4, "c": 1}, {"a": 2}]
    pooler = Pooler(pooling_type)
    results = run_in_chunks(pooler, states, steps)
    assert set(results) == {"a", "b", "c"}
    for req_id, s in states.items():
        torch.testing.assert_close(torch.tensor(results[req_id]), reference(s, pooling_type), rtol=1e-6, atol=1e-6)
    assert pooler.num_partial == 0


def test_a_removed_request_starts_over():
    gen = torch.Generator().manual_seed(1)
    states = {"a": torch.randn(6, HIDDEN, generator=gen)}
    pooler = Pooler("MEAN")
    run_in_chunks(pooler, states, [{"a": 3}])
    assert pooler.num_partial == 1
    pooler.remove_request("a")  # preempted: the runner drops its row, and the prompt is recomputed from 0
    assert pooler.num_partial == 0
    results = run_in_chunks(pooler, states, [{"a": 2}, {"a": 4}])
    torch.testing.assert_close(torch.tensor(results["a"]), states["a"].mean(dim=0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("pooling_type", ["MEAN", "CLS"])
def test_a_prompt_that_starts_past_position_0_is_refused_where_the_type_needs_it(pooling_type):
    with pytest.raises(RuntimeError, match="not 0"):
        Pooler(pooling_type).pool(torch.zeros(2, HIDDEN), [PoolingChunk("a", 0, 2, 4, 6, RAW)])


def test_last_pooling_needs_only_the_final_chunk():
    states = torch.arange(6 * HIDDEN, dtype=torch.float32).reshape(6, HIDDEN)
    out = Pooler("LAST").pool(states[4:], [PoolingChunk("a", 0, 2, 4, 6, RAW)])  # a prefix-cache hit of 4 tokens
    assert out["a"] == states[5].tolist()


def test_truncation_then_normalization():
    v = torch.tensor([[3.0, 4.0, 12.0]])
    assert finish_embeddings(v, [PoolingParams(dimensions=2, normalize=True)])[0] == pytest.approx([0.6, 0.8])
    assert finish_embeddings(v, [PoolingParams(dimensions=3, normalize=False)]) == [[3.0, 4.0, 12.0]]
    assert finish_embeddings(v, [PoolingParams(dimensions=3, normalize=True)])[0] == pytest.approx([3 / 13, 4 / 13, 12 / 13])


def test_pooling_chunks_take_only_pooling_rows_in_batch_order():
    batch = InputBatch(4, 32, 4)
    batch.add_request("gen", [1, 2, 3], 3, SamplingParams(), [0], 0)
    batch.add_request("emb", [4, 5, 6, 7, 8], 5, SamplingParams(max_tokens=0), [1], 0, pooling_params=RAW)
    rows = np.array([batch.req_id_to_row["gen"], batch.req_id_to_row["emb"]])
    chunks = pooling_chunks(batch, ["gen", "emb"], rows, np.array([0, 2]), np.array([3, 3]), np.array([3, 6]))
    assert chunks == [PoolingChunk("emb", 3, 6, 2, 5, RAW)]
    assert chunks[0].finishes_prompt


@pytest.mark.parametrize("pooling_type", ["MEAN", "CLS"])
def test_state_kept_across_steps_survives_the_hidden_buffer_being_reused(pooling_type):
    states = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(2))
    pooler = Pooler(pooling_type)
    buffer = states[:3].clone()  # a static output buffer, as CUDA graphs replay into
    pooler.pool(buffer, [PoolingChunk("a", 0, 3, 0, 6, RAW)])
    buffer.copy_(states[3:])
    out = pooler.pool(buffer, [PoolingChunk("a", 0, 3, 3, 6, RAW)])
    torch.testing.assert_close(torch.tensor(out["a"]), reference(states, pooling_type), rtol=1e-6, atol=1e-6)
