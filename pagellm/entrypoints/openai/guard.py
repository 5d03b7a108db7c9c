"""The server's first layer, ahead of routing and body parsing: while draining it answers 503, a
request without the API key 401 (one check, ``server_state.authorize``), a body past the limit 413;
it also counts the requests in flight, which the graceful shutdown waits for."""
from __future__ import annotations

from typing import Optional

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagellm.entrypoints.errors import error_response
from pagellm.entrypoints.server_state import ServerState, authorize

# Paths that must keep answering while draining or overloaded (probes and scrapers).
_UNGUARDED_PATHS = ("/metrics",)


class GuardMiddleware:
    """Drain, API key and body-size checks, before any parsing; counts requests in flight."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        state = self.state
        if path in _UNGUARDED_PATHS:
            await self.app(scope, receive, send)
            return
        if state.draining:
            await _send_error(send, "the server is shutting down", 503, {"Retry-After": "5", "Connection": "close"})
            return
        if state.api_key is not None and (path == "/v1" or path.startswith("/v1/")) and not self._authorized(scope):
            await _send_error(send, "Unauthorized: a valid API key is required (Authorization: Bearer <key>)", 401)
            return
        if scope["method"] in ("POST", "PUT", "PATCH"):
            receive = await self._read_body(scope, receive, send)
            if receive is None:
                return
        state.num_in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            state.num_in_flight -= 1

    def _authorized(self, scope: Scope) -> bool:
        header = next((value for name, value in scope["headers"] if name == b"authorization"), None)
        return authorize(self.state, header)

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> Optional[Receive]:
        """Reads the whole body under the cap; returns a receive that replays it, or None if answered."""
        limit = self.state.max_request_body_bytes
        too_large = f"the request body exceeds the limit of {limit} bytes"
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await _send_error(send, "invalid Content-Length header", 400)
                    return None
                if declared > limit:
                    await _send_error(send, too_large, 413, {"Connection": "close"})
                    return None
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body = message.get("body", b"")
            size += len(body)
            if size > limit:
                await _send_error(send, too_large, 413, {"Connection": "close"})
                return None
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replay: Optional[Message] = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay_receive() -> Message:
            nonlocal replay
            if replay is not None:
                message, replay = replay, None
                return message
            return await receive()  # afterwards: http.disconnect, for disconnect detection

        return replay_receive


async def _send_error(send: Send, message: str, status: int, headers: Optional[dict[str, str]] = None) -> None:
    response = error_response(message, status, headers=headers)
    await send({"type": "http.response.start", "status": status, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body, "more_body": False})
