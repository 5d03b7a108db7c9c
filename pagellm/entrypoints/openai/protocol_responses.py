"""Bodies of the Responses API (``/v1/responses``), shaped as the ``openai`` package's ``Response`` parses them.

The request keeps ``input``, ``tools`` and ``tool_choice`` loose (dicts) so that what pagellm cannot
serve (built-in tools, images, item references) is refused with a message naming it rather than a
pydantic union error; ``input_items.py`` reads them.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import Field

from pagellm.entrypoints.openai.protocol import JsonSchemaFormat, OpenAIBaseModel, ResponseFormat


def response_item_id(prefix: str) -> str:
    """OpenAI's ids here use an underscore: ``resp_...``, ``msg_...``, ``fc_...``."""
    return f"{prefix}_{uuid.uuid4().hex}"


class TextFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: Optional[str] = None
    description: Optional[str] = None
    # "schema" would shadow BaseModel.schema(); the JSON key stays "schema".
    json_schema: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None

    def to_response_format(self) -> Optional[ResponseFormat]:
        """The chat path's ``response_format`` for this format (None for plain text)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return ResponseFormat(type="json_object")
        if self.json_schema is None:
            raise ValueError("text.format of type json_schema needs a schema")
        schema = JsonSchemaFormat(name=self.name, description=self.description, schema=self.json_schema, strict=self.strict)
        return ResponseFormat(type="json_schema", json_schema=schema)

    def echo(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


class TextConfig(OpenAIBaseModel):
    format: TextFormat = Field(default_factory=TextFormat)
    verbosity: Optional[Literal["low", "medium", "high"]] = None


class ReasoningConfig(OpenAIBaseModel):
    effort: Optional[str] = None
    summary: Optional[str] = None
    generate_summary: Optional[str] = None


class FunctionTool(OpenAIBaseModel):
    type: Literal["function"] = "function"
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ResponsesRequest(OpenAIBaseModel):
    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stream: Optional[bool] = False
    text: Optional[TextConfig] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = True
    previous_response_id: Optional[str] = None
    store: Optional[bool] = True
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None  # accepted and echoed, as OpenAI's abuse-tracking tag
    # Accepted so that they can be refused by name when set (see serving_responses.unsupported).
    background: Optional[bool] = None
    reasoning: Optional[ReasoningConfig] = None
    thinking_token_budget: Optional[int] = Field(default=None, ge=0)
    # vLLM's extras, as on the chat path: a sampling seed and an output constraint (not with text.format).
    seed: Optional[int] = None
    structured_outputs: Optional[dict[str, Any]] = None  # vLLM's extra, as on /v1/chat/completions
    include: Optional[list[str]] = None
    conversation: Optional[Union[str, dict[str, Any]]] = None
    prompt: Optional[dict[str, Any]] = None
    top_logprobs: Optional[int] = None
    truncation: Optional[Literal["auto", "disabled"]] = None
    max_tool_calls: Optional[int] = None


class OutputText(OpenAIBaseModel):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[dict[str, Any]] = Field(default_factory=list)
    logprobs: list[dict[str, Any]] = Field(default_factory=list)


class OutputMessage(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: response_item_id("msg"))
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallItem(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: response_item_id("fc"))
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str = ""
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"


class ReasoningText(OpenAIBaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str = ""


class ReasoningItem(OpenAIBaseModel):
    """The model's thinking (with --reasoning-parser), as OpenAI's reasoning item with its text."""

    id: str = Field(default_factory=lambda: response_item_id("rs"))
    type: Literal["reasoning"] = "reasoning"
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"


OutputItem = Union[ReasoningItem, OutputMessage, FunctionCallItem]


class InputTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIBaseModel):
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = 0


class IncompleteDetails(OpenAIBaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseObject(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: response_item_id("resp"))
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete", "failed"] = "in_progress"
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: Optional[ResponseUsage] = None
    incomplete_details: Optional[IncompleteDetails] = None
    error: Optional[dict[str, Any]] = None
    # The request's settings, echoed.
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Union[str, dict[str, Any]] = "auto"
    parallel_tool_calls: bool = True
    previous_response_id: Optional[str] = None
    store: bool = True
    metadata: dict[str, str] = Field(default_factory=dict)
    user: Optional[str] = None
    background: bool = False
    reasoning: Optional[dict[str, Any]] = None
    truncation: Literal["disabled"] = "disabled"


class ResponseDeleted(OpenAIBaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True
