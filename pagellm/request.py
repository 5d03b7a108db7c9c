"""A request as the engine core sees it: token ids, progress and status, no text."""
from __future__ import annotations

import enum
import time
from typing import Callable, Optional

from pagellm.lora.request import LoRARequest
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this point is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: "RequestStatus") -> Optional[str]:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """Token-level state of one sequence.

    ``num_computed_tokens`` counts tokens whose KV is in the cache (or is being written by the
    step now scheduled); everything from there to ``num_tokens`` still has to be run through the
    model. After preemption it drops to zero and prompt plus outputs are recomputed together.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        max_tokens: int,
        arrival_time: Optional[float] = None,
        cache_salt: Optional[str] = None,
        block_hasher: Optional[Callable[["Request"], list[bytes]]] = None,
        pooling_params: Optional[PoolingParams] = None,
        lora_request: Optional[LoRARequest] = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        # A pooling request (max_tokens 0): finishes when its prompt is computed, with an embedding.
        self.pooling_params = pooling_params
        self.max_tokens = max_tokens
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.cache_salt = cache_salt
        self.lora_request = lora_request
        self.status = RequestStatus.WAITING
        self.stop_reason: Optional[int | str] = None
        self.num_computed_tokens = 0
        # Prefix-cache hit at first scheduling, reported back to the client as cached tokens.
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # Prompt logprobs already reported: a preempted request recomputes its prompt, and those
        # positions must not be reported twice.
        self.num_prompt_logprobs_sent = 0
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        # Hashes of this request's full blocks, extended as tokens arrive.
        self.block_hashes: list[bytes] = []
        self._block_hasher = block_hasher
        self.scheduled_time: Optional[float] = None  # first time admitted to the running set
        # Speculative decoding: drafts for the next step, never part of all_token_ids until the
        # target accepts them.
        self.spec_token_ids: list[int] = []
        if block_hasher is not None:
            self.block_hashes.extend(block_hasher(self))

    @property
    def lora_int_id(self) -> int:
        """The adapter's id, 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def prefix_cache_key(self) -> Optional[str]:
        """What is mixed into the first block's hash: the tenant's salt and the adapter, which both change the KV."""
        if self.lora_request is None:
            return self.cache_salt
        return self.lora_request.cache_key if self.cache_salt is None else f"{self.cache_salt}\x00{self.lora_request.cache_key}"

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)
