"""CUDA graphs for decode steps: capture the model's forward once per batch size, then replay it.

A decode step of a small model is mostly kernel-launch overhead on a GPU; replaying a captured
graph launches the whole forward at once. As in vLLM, graphs are captured for a ladder of batch
sizes (``capture_sizes``: 1, 2, 4, 8, 16, 24, ...), a decode-only batch is padded up to the next
captured size, and anything else (prefill chunks, mixed batches, sizes above the ladder) runs
eagerly. Padding rows get ``seq_len`` 0 and slot -1, which the Triton kernels skip.

The graph mechanics sit behind ``GraphDevice`` so that the bookkeeping (ladder, padding, static
buffers, which sizes are captured, the fallback) is tested on CPU with ``EagerGraphDevice``.

With several KV cache groups each group has its own static block table and slot mapping, and the
forward function gets one metadata per group (a list) instead of one for the whole model.
"""
from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Union

import torch

from pagellm.attention.backend import AttentionMetadata

logger = logging.getLogger(__name__)

# vLLM's default ceiling: bigger decode batches are compute-bound enough to run eagerly.
MAX_CAPTURE_SIZE = 512
PAD_SLOT_ID = -1

# One metadata, or with several KV cache groups a list of one per group.
GroupMetadata = Union[AttentionMetadata, list[AttentionMetadata]]
# forward(input_ids, positions, metadata) -> hidden [T, hidden_size]
ForwardFn = Callable[[torch.Tensor, torch.Tensor, GroupMetadata], torch.Tensor]


def capture_sizes(max_num_seqs: int, max_capture_size: int = MAX_CAPTURE_SIZE) -> list[int]:
    """1, 2, 4, then every multiple of 8, up to min(max_num_seqs, max_capture_size), which is included."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
    top = min(max_num_seqs, max_capture_size)
    sizes = [s for s in [1, 2, 4, *range(8, top + 1, 8)] if s <= top]
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


def padded_size(num_seqs: int, sizes: list[int]) -> Optional[int]:
    """The smallest captured size that holds ``num_seqs`` (sizes ascending), or None if none does."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


class GraphHandle(Protocol):
    def replay(self) -> None: ...


class GraphDevice(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[GraphHandle, torch.Tensor]:
        """Records ``fn`` once; returns something to replay it and the tensor each replay rewrites."""
        ...


class CudaGraphDevice:
    """torch.cuda graphs sharing one memory pool, captured after a warm-up run on a side stream."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[GraphHandle, torch.Tensor]:
        # Warm-up outside the graph: Triton compiles and autotuners settle before recording.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = fn()
        return graph, output


class _EagerGraph:
    def __init__(self, fn: Callable[[], torch.Tensor], output: torch.Tensor) -> None:
        self.fn, self.output = fn, output
        self.replays = 0

    def replay(self) -> None:
        self.output.copy_(self.fn())
        self.replays += 1


class EagerGraphDevice:
    """A stand-in that "replays" by running the function again into the same output tensor.

    Same contract as a CUDA graph: inputs are read from the static buffers at replay time, and
    the output tensor handed out at capture holds the result.
    """

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[GraphHandle, torch.Tensor]:
        output = fn()
        return _EagerGraph(fn, output), output


@dataclass
class _Captured:
    graph: GraphHandle
    output: torch.Tensor  # [size, hidden]


class DecodeGraphRunner:
    """Static input buffers, one graph per ladder size, and the padding that maps a step onto one."""

    def __init__(
        self,
        forward: ForwardFn,
        max_num_seqs: int,
        max_num_blocks_per_seq: int,
        max_model_len: int,
        device: torch.device,
        graph_device: GraphDevice,
        sizes: Optional[list[int]] = None,
        num_kv_cache_groups: int = 1,
    ) -> None:
        self.forward = forward
        self.sizes = sizes if sizes is not None else capture_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        self.graph_device = graph_device
        self.num_kv_cache_groups = num_kv_cache_groups
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = [
            torch.zeros(n, max_num_blocks_per_seq, dtype=torch.int32, device=device) for _ in range(num_kv_cache_groups)
        ]
        self.slot_mappings = [torch.full((n,), PAD_SLOT_ID, dtype=torch.int64, device=device) for _ in range(num_kv_cache_groups)]
        self.block_table, self.slot_mapping = self.block_tables[0], self.slot_mappings[0]
        self.graphs: dict[int, _Captured] = {}

    def _metadata(self, size: int) -> GroupMetadata:
        # Launch shapes must not change between capture and replay: the longest possible context
        # fixes the decode kernel's split count, and the host lists are only what validation reads.
        by_group = [
            AttentionMetadata(
                query_start_loc=self.query_start_loc[: size + 1],
                seq_lens=self.seq_lens[:size],
                block_table=block_table[:size],
                slot_mapping=slot_mapping[:size],
                max_query_len=1,
                max_seq_len=self.max_model_len,
                query_start_loc_cpu=list(range(size + 1)),
                seq_lens_cpu=[self.max_model_len] * size,
            )
            for block_table, slot_mapping in zip(self.block_tables, self.slot_mappings)
        ]
        return by_group if self.num_kv_cache_groups > 1 else by_group[0]

    def capture_all(self) -> None:
        """Captures every ladder size, largest first (smaller graphs then reuse its pool memory).

        The buffers hold padding during capture (seq_len 0, slot -1): the warm-up touches no cache.
        """
        self.seq_lens.zero_()
        for slot_mapping in self.slot_mappings:
            slot_mapping.fill_(PAD_SLOT_ID)
        for size in reversed(self.sizes):
            metadata = self._metadata(size)

            def run(size: int = size, metadata: GroupMetadata = metadata) -> torch.Tensor:
                return self.forward(self.input_ids[:size], self.positions[:size], metadata)

            graph, output = self.graph_device.capture(run)
            self.graphs[size] = _Captured(graph, output)

    def graph_size_for(self, metadata: AttentionMetadata) -> Optional[int]:
        """The captured size this step replays at, or None for an eager step."""
        if metadata.max_query_len != 1 or metadata.num_tokens != metadata.num_seqs:
            return None  # prefill chunks: shapes vary with every step
        if metadata.max_seq_len > self.max_model_len:
            return None
        size = padded_size(metadata.num_seqs, self.sizes)
        return size if size in self.graphs else None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: GroupMetadata, size: int) -> torch.Tensor:
        """Copies the step into the static buffers, pads to ``size``, replays; hidden [num_seqs, hidden].

        ``metadata``: one per KV cache group (a list) when the runner was built for several."""
        by_group = metadata if isinstance(metadata, list) else [metadata]
        if len(by_group) != self.num_kv_cache_groups:
            raise ValueError(f"metadata for {len(by_group)} KV cache groups, the graphs were captured for {self.num_kv_cache_groups}")
        first = by_group[0]
        n = first.num_seqs
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.seq_lens[:n].copy_(first.seq_lens)
        self.seq_lens[n:size].zero_()
        for group, block_table, slot_mapping in zip(by_group, self.block_tables, self.slot_mappings):
            slot_mapping[:n].copy_(group.slot_mapping)
            # Columns past a row's own blocks may keep stale ids: the kernels read only pos < seq_len.
            block_table[:n, : group.block_table.shape[1]].copy_(group.block_table)
            slot_mapping[n:size].fill_(PAD_SLOT_ID)
        captured = self.graphs[size]
        captured.graph.replay()
        return captured.output[:n]


def model_supports_cuda_graphs(model: torch.nn.Module) -> bool:
    """Whether every attention layer's backend is capturable (its launches read only device tensors)."""
    backends = [m.attn_backend for m in model.modules() if hasattr(m, "attn_backend")]
    return bool(backends) and all(getattr(b, "supports_cuda_graphs", False) for b in backends)
