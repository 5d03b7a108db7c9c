"""``POST /v1/embeddings``: prompts (text or token ids, one or many) in, one vector each out.

Served by the pooling runner (``--runner pooling``): each prompt is one engine request that is
prefilled, batched with the others under the token budget, and finishes with its pooled hidden
state; nothing is sampled.
"""
from __future__ import annotations

import base64
import time

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagellm.engine.async_llm import RequestStream
from pagellm.entrypoints.errors import APIError
from pagellm.entrypoints.openai.protocol import random_id
from pagellm.entrypoints.openai.protocol_embedding import EmbeddingRequest, EmbeddingResponse, EmbeddingResponseData, EmbeddingUsage
from pagellm.entrypoints.openai.serving_base import OpenAIServing, lazy_prompts, prompt_items, run_until_disconnected
from pagellm.entrypoints.openai.serving_completion import MAX_SEQUENCES_PER_REQUEST
from pagellm.outputs import EmbeddingRequestOutput
from pagellm.pooling_params import PoolingParams


def encode_embedding(embedding: list[float], encoding_format: str) -> list[float] | str:
    """``float``: the values; ``base64``: their float32 little-endian bytes, as OpenAI encodes them."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")
    return embedding


class OpenAIServingEmbedding(OpenAIServing):
    async def create_embedding(self, request: EmbeddingRequest, raw_request: Request) -> Response:
        self.check_model(request.model)
        self.check_runner("Embeddings", pooling=True)
        params = self._pooling_params(request)
        items = prompt_items(request.input)
        if not items:
            raise APIError("input must not be empty", param="input")
        if len(items) > MAX_SEQUENCES_PER_REQUEST:
            raise APIError(f"a request may embed at most {MAX_SEQUENCES_PER_REQUEST} inputs, got {len(items)}", param="input")
        prompts = lazy_prompts(items, self.async_llm.engine.input_processor, request.add_special_tokens)
        request_id = random_id("embd")
        streams = await self.add_requests(request_id, prompts, params, time.monotonic())
        response = await run_until_disconnected(raw_request, lambda: self._collect(request, request_id, streams))
        if response is None:
            return Response(status_code=499)
        return JSONResponse(response.model_dump())

    def _pooling_params(self, request: EmbeddingRequest) -> PoolingParams:
        engine = self.async_llm.engine
        try:
            params = PoolingParams(dimensions=request.dimensions, normalize=request.normalize)
            params.resolved(engine.config.pooler_config, engine.hf_config.hidden_size)  # refuses dimensions past the model's width
        except ValueError as e:
            raise APIError(str(e), param="dimensions") from None
        return params

    async def _collect(self, request: EmbeddingRequest, request_id: str, streams: list[RequestStream]) -> EmbeddingResponse:
        finals: dict[int, EmbeddingRequestOutput] = {}
        async for i, output in self.iterate_streams(streams):
            if not isinstance(output, EmbeddingRequestOutput):
                raise APIError("the request was aborted before its embedding was computed", 503)
            if output.error is not None:
                raise APIError(f"embedding failed: {output.error}", 500)
            finals[i] = output
        data = [
            EmbeddingResponseData(index=i, embedding=encode_embedding(finals[i].outputs.embedding, request.encoding_format))
            for i in range(len(streams))
        ]
        num_prompt_tokens = sum(len(out.prompt_token_ids) for out in finals.values())
        return EmbeddingResponse(
            id=request_id,
            model=self.served_model_name,
            data=data,
            usage=EmbeddingUsage(prompt_tokens=num_prompt_tokens, total_tokens=num_prompt_tokens),
        )
