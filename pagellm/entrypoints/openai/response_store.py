"""Stored responses for ``previous_response_id``, retrieve and delete: an in-memory LRU of bounded size."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

from pagellm.entrypoints.errors import APIError
from pagellm.entrypoints.openai.protocol_responses import ResponseObject
from pagellm.entrypoints.server_state import DEFAULT_MAX_STORED_RESPONSES


@dataclass
class StoredResponse:
    response: ResponseObject
    # The whole conversation this response answered (its chain's items, then its own input), not its instructions.
    input_items: list[dict[str, Any]]

    def conversation(self) -> list[dict[str, Any]]:
        """What a follow-up turn starts from: these inputs, then this response's output items."""
        return self.input_items + [item.model_dump() for item in self.response.output]


class ResponseStore:
    """The newest ``max_size`` responses by last use; 0 keeps none. Lives and dies with the server process."""

    def __init__(self, max_size: int = DEFAULT_MAX_STORED_RESPONSES) -> None:
        if max_size < 0:
            raise ValueError(f"max_stored_responses must be non-negative, got {max_size}")
        self.max_size = max_size
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: ResponseObject, input_items: list[dict[str, Any]]) -> None:
        if self.max_size == 0:
            return
        self._entries[response.id] = StoredResponse(response, input_items)
        self._entries.move_to_end(response.id)
        while len(self._entries) > self.max_size:
            self._entries.popitem(last=False)

    def get(self, response_id: str, param: Optional[str] = None) -> StoredResponse:
        """The stored response, made the newest; 404 when it was never stored, was evicted or deleted."""
        entry = self._entries.get(response_id)
        if entry is None:
            raise APIError(f"Response with id {response_id!r} not found.", 404, param=param)
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> None:
        if self._entries.pop(response_id, None) is None:
            raise APIError(f"Response with id {response_id!r} not found.", 404)
