"""The runner's persistent view of the requests in the batch, one row per request.

Rows live in preallocated numpy arrays (token ids, block table, sampling knobs) so that each
step's inputs are built by a few vectorized gathers instead of per-token Python loops, and a
step only sends what changed (new blocks, the token just sampled).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams


class InputBatch:
    """``block_tables[g]`` is KV cache group g's table (``block_table``: group 0's, a one-group
    cache's only one). A table only grows: entries a sliding window has left behind keep their old
    ids, which no backend reads."""

    def __init__(self, max_num_reqs: int, max_model_len: int, max_num_blocks_per_req: int, num_kv_cache_groups: int = 1) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_tables = [np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32) for _ in range(num_kv_cache_groups)]
        self.group_num_blocks = [np.zeros(max_num_reqs, dtype=np.int64) for _ in range(num_kv_cache_groups)]
        self.block_table = self.block_tables[0]
        self.num_blocks = self.group_num_blocks[0]
        self.temperature = np.ones(max_num_reqs, dtype=np.float32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.greedy = np.zeros(max_num_reqs, dtype=bool)
        self.presence_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition_penalty = np.ones(max_num_reqs, dtype=np.float32)
        self.params: list[Optional[SamplingParams]] = [None] * max_num_reqs
        self.pooling_params: list[Optional[PoolingParams]] = [None] * max_num_reqs  # set: a pooling row
        self.req_ids: list[Optional[str]] = [None] * max_num_reqs
        self.req_id_to_row: dict[str, int] = {}
        # Lowest rows first, so the arrays touched each step stay dense.
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.req_id_to_row)

    def add_request(
        self,
        req_id: str,
        token_ids: list[int],
        num_prompt_tokens: int,
        params: SamplingParams,
        block_ids: list[int],
        num_computed_tokens: int,
        extra_group_block_ids: tuple[list[int], ...] = (),
        pooling_params: Optional[PoolingParams] = None,
    ) -> int:
        if req_id in self.req_id_to_row:
            raise ValueError(f"request {req_id!r} is already in the batch")
        if not self._free_rows:
            raise RuntimeError("the input batch is full; the scheduler admitted more than max_num_seqs")
        row = self._free_rows.pop()
        n = len(token_ids)
        self.token_ids[row, :n] = token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = num_prompt_tokens
        self.num_computed_tokens[row] = num_computed_tokens
        if len(extra_group_block_ids) != len(self.block_tables) - 1:
            raise ValueError(f"block ids for {1 + len(extra_group_block_ids)} KV cache groups, the batch has {len(self.block_tables)}")
        for group_id, ids in enumerate((block_ids, *extra_group_block_ids)):
            self.group_num_blocks[group_id][row] = 0
            self.append_block_ids(row, ids, group_id)
        self.temperature[row] = params.temperature
        self.greedy[row] = params.is_greedy
        self.top_p[row] = params.top_p
        self.top_k[row] = params.top_k
        self.min_p[row] = params.min_p
        self.presence_penalty[row] = params.presence_penalty
        self.frequency_penalty[row] = params.frequency_penalty
        self.repetition_penalty[row] = params.repetition_penalty
        self.params[row] = params
        self.pooling_params[row] = pooling_params
        self.req_ids[row] = req_id
        self.req_id_to_row[req_id] = row
        return row

    def remove_request(self, req_id: str) -> None:
        row = self.req_id_to_row.pop(req_id, None)
        if row is None:
            return
        self.params[row] = None
        self.pooling_params[row] = None
        self.req_ids[row] = None
        self._free_rows.append(row)

    def append_block_ids(self, row: int, block_ids: list[int], group_id: int = 0) -> None:
        if block_ids:
            num_blocks = self.group_num_blocks[group_id]
            start = int(num_blocks[row])
            self.block_tables[group_id][row, start : start + len(block_ids)] = block_ids
            num_blocks[row] = start + len(block_ids)

    def append_token(self, row: int, token_id: int) -> None:
        n = int(self.num_tokens[row])
        self.token_ids[row, n] = token_id
        self.num_tokens[row] = n + 1

    def output_token_ids(self, row: int) -> list[int]:
        return self.token_ids[row, self.num_prompt_tokens[row] : self.num_tokens[row]].tolist()

    def num_output_tokens(self, row: int) -> int:
        return int(self.num_tokens[row] - self.num_prompt_tokens[row])
