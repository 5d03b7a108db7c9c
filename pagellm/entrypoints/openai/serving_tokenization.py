"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's extensions), run on the engine thread."""
from __future__ import annotations

from pagellm.entrypoints.errors import APIError
from pagellm.entrypoints.openai.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from pagellm.entrypoints.openai.serving_base import OpenAIServing, messages_to_dicts, to_api_error
from pagellm.entrypoints.openai.serving_chat import make_chat_prompt


class OpenAIServingTokenization(OpenAIServing):
    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise APIError("give exactly one of prompt or messages", param="prompt")
        self.check_chat_template(request.chat_template, request.chat_template_kwargs)
        messages = messages_to_dicts(request.messages) if request.messages is not None else None

        def tokenize(engine) -> tuple[list[int], list[str]]:
            tokenizer = engine.tokenizer
            if messages is not None:
                add_special = bool(request.add_special_tokens)
                ids = make_chat_prompt(tokenizer, messages, request, add_special, None, engine.input_processor)["prompt_token_ids"]
            else:
                add_special = True if request.add_special_tokens is None else request.add_special_tokens
                ids = engine.input_processor.tokenize(request.prompt, add_special_tokens=add_special)
            strs = tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else []
            return ids, strs

        try:
            ids, strs = await self.async_llm.run_in_engine(tokenize)
        except Exception as e:  # mapped to 400/503/500 by type
            raise to_api_error(e) from e
        return TokenizeResponse(
            count=len(ids),
            max_model_len=self.async_llm.max_model_len,
            tokens=ids,
            token_strs=strs if request.return_token_strs else None,
        )

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(request.model)

        def detokenize(engine) -> str:
            if request.tokens:  # an empty list decodes to "", which is fine here
                engine.input_processor.validate_token_ids(request.tokens)
            return engine.tokenizer.decode(request.tokens)

        try:
            text = await self.async_llm.run_in_engine(detokenize)
        except Exception as e:  # mapped to 400/503/500 by type
            raise to_api_error(e) from e
        return DetokenizeResponse(prompt=text)
