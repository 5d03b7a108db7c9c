"""The asyncio end of a request, and the streaming both front ends (``AsyncLLM``, ``DPAsyncLLM``) offer on it."""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Optional, Union

from pagellm.outputs import RequestOutput
from pagellm.sampling_params import SamplingParams


class RequestStream:
    """The asyncio end of one request: outputs (or an exception) arrive on ``queue``."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue[Union[RequestOutput, BaseException]] = asyncio.Queue()
        self.finished = False
        # Set by the engine thread only; used for inter-token latency.
        self.last_token_time: Optional[float] = None

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item


class StreamingFrontEnd:
    """``generate`` and ``iterate`` over the subclass's ``add_request`` and ``abort``."""

    async def generate(
        self, prompt: Any, params: SamplingParams, request_id: str, arrival_time: Optional[float] = None
    ) -> AsyncIterator[RequestOutput]:
        """Streams the request's DELTA outputs; aborts it if the caller stops early."""
        stream = await self.add_request(request_id, prompt, params, arrival_time)
        async for output in self.iterate(stream):
            yield output

    async def iterate(self, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        """Yields a stream's outputs; if the consumer stops early (disconnect, cancel) the request is aborted."""
        try:
            async for output in stream:
                yield output
        finally:
            if not stream.finished:
                self.abort(stream.request_id)
