"""CUDA-graph bookkeeping on CPU: the capture ladder, padding, static buffers and the eager fallback.

``EagerGraphDevice`` replays by re-running the captured function into the captured output, the
same contract as a CUDA graph, so what is checked here is what a GPU would replay.
"""
from __future__ import annotations

import pytest
import torch

from pagellm.attention.backend import AttentionMetadata
from pagellm.attention.synthetic import make_batch
from pagellm.worker.cuda_graphs import (
    PAD_SLOT_ID,
    DecodeGraphRunner,
    EagerGraphDevice,
    capture_sizes,
    model_supports_cuda_graphs,
    padded_size,
)


def test_capture_ladder_is_vllms() -> None:
    assert capture_sizes(256) == [1, 2, 4] + list(range(8, 257, 8))
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(1000)[-1] == 512
    with pytest.raises(ValueError):
        capture_sizes(0)


def test_padding_to_the_next_captured_size() -> None:
    sizes = capture_sizes(64)
    assert [padded_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 64)] == [1, 2, 4, 8, 8, 16, 24, 64]
    assert padded_size(65, sizes) is None


def echo_forward(input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
    """A stand-in model whose output shows every input it was given, row by row."""
    return torch.stack(
        [input_ids.float(), positions.float(), md.seq_lens.float(), md.slot_mapping.float(), md.block_table[:, 0].float()], 1
    )


def decode_metadata(seq_lens: list[int], max_blocks: int = 3) -> AttentionMetadata:
    n = len(seq_lens)
    return AttentionMetadata(
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=torch.arange(n * max_blocks, dtype=torch.int32).view(n, max_blocks) + 1,
        slot_mapping=torch.tensor([10 * s for s in seq_lens], dtype=torch.int64),
        max_query_len=1,
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=list(range(n + 1)),
        seq_lens_cpu=seq_lens,
    )


def make_runner(max_num_seqs: int = 8) -> DecodeGraphRunner:
    runner = DecodeGraphRunner(echo_forward, max_num_seqs, 4, 64, torch.device("cpu"), EagerGraphDevice())
    runner.capture_all()
    return runner


def test_every_ladder_size_is_captured_on_padding() -> None:
    runner = make_runner()
    assert sorted(runner.graphs) == [1, 2, 4, 8]
    for size, captured in runner.graphs.items():
        # Captured with padding rows only: no cache slot written, no context read.
        assert captured.output.shape == (size, 5)
        assert (captured.output[:, 2] == 0).all() and (captured.output[:, 3] == PAD_SLOT_ID).all()


def test_replay_pads_and_returns_only_real_rows() -> None:
    runner = make_runner()
    md = decode_metadata([5, 9, 33])
    size = runner.graph_size_for(md)
    assert size == 4
    ids, pos = torch.tensor([7, 8, 9]), torch.tensor([4, 8, 32])
    out = runner.run(ids, pos, md, size)
    torch.testing.assert_close(out, echo_forward(ids, pos, md))
    padded = runner.graphs[4].output
    assert padded[3, 2] == 0 and padded[3, 3] == PAD_SLOT_ID  # the padding row
    assert runner.graphs[4].graph.replays == 1
    # A smaller batch after a bigger one: the stale rows are re-padded.
    md2 = decode_metadata([6])
    out2 = runner.run(torch.tensor([3]), torch.tensor([5]), md2, runner.graph_size_for(md2))
    torch.testing.assert_close(out2, echo_forward(torch.tensor([3]), torch.tensor([5]), md2))


def test_prefill_mixed_and_oversized_batches_run_eagerly() -> None:
    runner = make_runner(max_num_seqs=4)
    prefill = make_batch([(5, 5), (1, 9)], 2, 1, 16, 16).metadata
    assert runner.graph_size_for(prefill) is None
    assert runner.graph_size_for(decode_metadata([3] * 5)) is None  # above the ladder
    assert runner.graph_size_for(decode_metadata([65])) is None  # longer than captured for
    runner.graphs.pop(4)
    assert runner.graph_size_for(decode_metadata([3] * 3)) is None  # not captured


def test_only_capturable_backends_get_graphs() -> None:
    from pagellm.attention.torch_sdpa import TorchSdpaBackend

    layer = torch.nn.Module()
    layer.attn_backend = TorchSdpaBackend()
    assert not model_supports_cuda_graphs(torch.nn.Sequential(layer))
    assert not model_supports_cuda_graphs(torch.nn.Linear(2, 2))
    layer.attn_backend.supports_cuda_graphs = True
    assert model_supports_cuda_graphs(torch.nn.Sequential(layer))


def test_cpu_runner_builds_no_graphs() -> None:
    from pagellm.worker.model_runner import ModelRunner

    runner = ModelRunner(torch.nn.Linear(2, 2), [torch.zeros(2, 4, 16, 1, 8)], 16, 4, 64, 10)
    assert runner.cuda_graphs is None
