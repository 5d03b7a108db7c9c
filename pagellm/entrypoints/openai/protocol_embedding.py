"""``/v1/embeddings``'s request and response bodies, shaped as OpenAI's (and vLLM's extras)."""
from __future__ import annotations

import time
from typing import Literal, Optional, Union

from pydantic import Field

from pagellm.entrypoints.openai.protocol import OpenAIBaseModel, random_id


class EmbeddingRequest(OpenAIBaseModel):
    """OpenAI's ``input``: a string, strings, token ids or lists of token ids; ``dimensions`` keeps
    the first N values (Matryoshka), ``user`` is accepted and ignored. vLLM's extras:
    ``normalize`` (None: the server's ``--pooler-config``) and ``add_special_tokens``."""

    input: Union[str, list[str], list[int], list[list[int]]]
    model: Optional[str] = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None
    normalize: Optional[bool] = None
    add_special_tokens: bool = True


class EmbeddingResponseData(OpenAIBaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    # base64: the float32 values' little-endian bytes, as OpenAI sends them.
    embedding: Union[list[float], str]


class EmbeddingUsage(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("embd"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingResponseData]
    usage: EmbeddingUsage
