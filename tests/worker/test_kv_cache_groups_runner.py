"""The worker's side of KV cache groups, without a real model: tensors shared by group position,
one block table and slot mapping per group, per-layer metadata only when there are several groups,
and CUDA-graph static buffers per group (on CPU, with the eager stand-in)."""
from __future__ import annotations

import torch

from pagellm.attention.backend import AttentionMetadata
from pagellm.core.kv_cache_groups import group_layers
from pagellm.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagellm.sampling_params import SamplingParams
from pagellm.worker.cuda_graphs import PAD_SLOT_ID, DecodeGraphRunner, EagerGraphDevice
from pagellm.worker.kv_cache import KVCachePrefaulter, allocate_grouped_kv_caches, allocate_kv_caches
from pagellm.worker.model_runner import ModelRunner

VOCAB = 16
BLOCK = 4


class RecordingModel(torch.nn.Module):
    """Returns zeros, predicts token 3, and keeps what each forward was given."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[list[torch.Tensor], object]] = []

    def forward(self, input_ids, positions, kv_caches, attn_metadata):
        self.calls.append((kv_caches, attn_metadata))
        return torch.zeros(len(input_ids), 2)

    def compute_logits(self, hidden):
        logits = torch.zeros(len(hidden), VOCAB)
        logits[:, 3] = 1.0
        return logits


def step_output(new=(), cached=(), scheduled=None) -> SchedulerOutput:
    scheduled = scheduled or {}
    return SchedulerOutput(list(new), list(cached), scheduled, sum(scheduled.values()), set(), set())


def new_request(req_id: str, tokens: list[int], block_ids: tuple[list[int], ...]) -> NewRequestData:
    return NewRequestData(
        req_id, tokens, len(tokens), SamplingParams(temperature=0.0, max_tokens=4), block_ids[0], 0, 0, block_ids[1:]
    )


def test_grouped_caches_share_one_tensor_per_group_position():
    layout = group_layers([None, 8, 8, 8, 8, 8])  # Gemma 3's pattern: six groups of one layer
    caches = allocate_grouped_kv_caches(layout, 10, BLOCK, 2, 8, torch.float32, torch.device("cpu"))
    assert len(caches) == 6 and len({id(c) for c in caches}) == 1 and caches[0].shape == (2, 10, BLOCK, 2, 8)
    gpt_oss = group_layers([8, None, 8, None])  # two groups of two: layers 0 and 1 share tensor 0
    caches = allocate_grouped_kv_caches(gpt_oss, 10, BLOCK, 2, 8, torch.float32, torch.device("cpu"))
    assert caches[0] is caches[1] and caches[2] is caches[3] and caches[0] is not caches[2]
    assert KVCachePrefaulter(caches).total_bytes == KVCachePrefaulter([caches[0], caches[2]]).total_bytes  # each once
    full = allocate_grouped_kv_caches(group_layers([None] * 3), 10, BLOCK, 2, 8, torch.float32, torch.device("cpu"))
    assert len({id(c) for c in full}) == 3 and all(c.shape == (2, 10, BLOCK, 2, 8) for c in full)


def test_one_group_model_gets_one_metadata_as_before():
    model = RecordingModel()
    caches = allocate_kv_caches(2, 8, BLOCK, 1, 8, torch.float32, torch.device("cpu"))
    runner = ModelRunner(model, caches, BLOCK, 4, 32, VOCAB, kv_cache_layout=group_layers([None, None]))
    out = runner.execute_model(step_output([new_request("a", [1, 2, 3, 4, 5], ([2, 5],))], scheduled={"a": 5}))
    assert out.sampled_token_ids == {"a": [3]}
    kv_caches, md = model.calls[-1]
    assert kv_caches is caches and isinstance(md, AttentionMetadata)
    assert md.block_table.tolist() == [[2, 5]] and md.slot_mapping.tolist() == [8, 9, 10, 11, 20]


def test_several_groups_give_each_layer_its_groups_metadata():
    layout = group_layers([8, None, 8, None])  # group 0: full layers 1 and 3; group 1: sliding 0 and 2
    model = RecordingModel()
    caches = allocate_grouped_kv_caches(layout, 16, BLOCK, 1, 8, torch.float32, torch.device("cpu"))
    runner = ModelRunner(model, caches, BLOCK, 4, 32, VOCAB, kv_cache_layout=layout)
    runner.execute_model(step_output([new_request("a", [1, 2, 3, 4, 5, 6], ([1, 2], [3, 4]))], scheduled={"a": 6}))
    _, per_layer = model.calls[-1]
    assert isinstance(per_layer, list) and len(per_layer) == 4
    assert per_layer[0] is per_layer[2] and per_layer[1] is per_layer[3] and per_layer[0] is not per_layer[1]
    assert per_layer[1].slot_mapping.tolist() == [4, 5, 6, 7, 8, 9]  # full group: blocks 1, 2
    assert per_layer[0].slot_mapping.tolist() == [12, 13, 14, 15, 16, 17]  # sliding group: blocks 3, 4
    # The decode at 6 fits both groups' second blocks.
    runner.execute_model(step_output(cached=[CachedRequestData("a", [], 6, [3], ([],))], scheduled={"a": 1}))
    _, per_layer = model.calls[-1]
    assert per_layer[1].block_table.tolist() == [[1, 2]] and per_layer[1].slot_mapping.tolist() == [10]
    assert per_layer[0].block_table.tolist() == [[3, 4]] and per_layer[0].slot_mapping.tolist() == [18]
    assert per_layer[0].seq_lens.tolist() == [7] and per_layer[0].query_start_loc is per_layer[1].query_start_loc
    # Position 8 opens a block in each group. The manager has nulled the sliding group's first
    # entry by now; the runner's table keeps the old id there, which no backend reads.
    runner.execute_model(step_output(cached=[CachedRequestData("a", [], 7, [3], ([],))], scheduled={"a": 1}))
    runner.execute_model(step_output(cached=[CachedRequestData("a", [5], 8, [3], ([7],))], scheduled={"a": 1}))
    _, per_layer = model.calls[-1]
    assert per_layer[1].block_table.tolist() == [[1, 2, 5]] and per_layer[1].slot_mapping.tolist() == [20]
    assert per_layer[0].block_table.tolist() == [[3, 4, 7]] and per_layer[0].slot_mapping.tolist() == [28]


def echo_groups(input_ids, positions, md):
    """Shows every group's slot and first block-table column, row by row."""
    cols = [input_ids.float(), md[0].seq_lens.float()]
    for group in md:
        cols += [group.slot_mapping.float(), group.block_table[:, 0].float()]
    return torch.stack(cols, 1)


def decode_metadata(seq_lens: list[int], offset: int) -> AttentionMetadata:
    n = len(seq_lens)
    return AttentionMetadata(
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=torch.arange(n * 2, dtype=torch.int32).view(n, 2) + offset,
        slot_mapping=torch.tensor([offset + s for s in seq_lens], dtype=torch.int64),
        max_query_len=1,
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=list(range(n + 1)),
        seq_lens_cpu=seq_lens,
    )


def test_cuda_graphs_keep_static_buffers_per_group():
    graphs = DecodeGraphRunner(echo_groups, 4, 3, 32, torch.device("cpu"), EagerGraphDevice(), num_kv_cache_groups=2)
    graphs.capture_all()
    captured = graphs.graphs[4].output
    assert (captured[:, 2] == PAD_SLOT_ID).all() and (captured[:, 4] == PAD_SLOT_ID).all()
    md = [decode_metadata([5, 9, 12], 100), decode_metadata([5, 9, 12], 200)]
    size = graphs.graph_size_for(md[0])
    assert size == 4
    ids = torch.tensor([7, 8, 9])
    got = graphs.run(ids, torch.tensor([4, 8, 11]), md, size)
    torch.testing.assert_close(got, echo_groups(ids, None, md))
    padded = graphs.graphs[4].output
    assert padded[3, 2] == PAD_SLOT_ID and padded[3, 4] == PAD_SLOT_ID  # the padding row, in both groups


def test_layers_without_blocks_get_no_tensor_or_their_sources():
    # Layer 1 holds no cache (an MLP-only block); layer 3 reads layer 0's KV.
    layout = group_layers([None, None, None, None], no_cache_layer_ids=(1,), kv_shared_layers=((3, 0),))
    caches = allocate_grouped_kv_caches(layout, 10, BLOCK, 2, 8, torch.float32, torch.device("cpu"))
    assert caches[1] is None and caches[3] is caches[0] and caches[2] is not caches[0]
    assert caches[0].shape == (2, 10, BLOCK, 2, 8)
    model = RecordingModel()
    runner = ModelRunner(model, caches, BLOCK, 4, 32, VOCAB, kv_cache_layout=layout)
    runner.execute_model(step_output([new_request("a", [1, 2, 3, 4, 5], ([2, 5],))], scheduled={"a": 5}))
    _, per_layer = model.calls[-1]
    assert per_layer[1] is None and per_layer[3] is per_layer[0] and per_layer[2] is per_layer[0]
    assert per_layer[3].slot_mapping.tolist() == [8, 9, 10, 11, 20]
