"""What every front end's routes share: the server's state and the one API-key check."""
from __future__ import annotations

import hmac
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Optional

DEFAULT_MAX_REQUEST_BODY_BYTES = 8 << 20
# Responses kept for previous_response_id and GET /v1/responses/ID (the response store).
DEFAULT_MAX_STORED_RESPONSES = 1000


@dataclass
class ServerState:
    api_key: Optional[str] = None
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    draining: bool = False
    num_in_flight: int = 0  # HTTP requests inside the app (a stream counts until its last byte)


def authorize(state: ServerState, authorization: Optional[str | bytes], keys: Iterable[Optional[str]] = ()) -> bool:
    """Whether a request may in: no key is set, or its ``Authorization`` header is ``Bearer KEY``,
    or one of ``keys`` (a cookie, a query parameter) is the key. Compared in constant time."""
    if state.api_key is None:
        return True
    expected = state.api_key.encode()
    if authorization is not None:
        value = authorization.encode() if isinstance(authorization, str) else authorization
        if hmac.compare_digest(value, b"Bearer " + expected):
            return True
    return any(key is not None and hmac.compare_digest(key.encode(), expected) for key in keys)
