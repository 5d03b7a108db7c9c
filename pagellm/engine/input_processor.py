"""Validates and tokenizes user prompts before they reach the engine core."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from pagellm.sampling_params import SamplingParams
from pagellm.structured_output import StructuredOutputManager

# A prompt is text, or pre-tokenized as vLLM's TokensPrompt: {"prompt_token_ids": [...]}.
PromptType = Union[str, dict[str, Any]]


@dataclass
class ProcessedPrompt:
    prompt: Optional[str]
    prompt_token_ids: list[int]
    max_tokens: int
    cache_salt: Optional[str] = None


def max_chars_per_token(tokenizer) -> Optional[int]:
    """The longest vocabulary entry, in characters: no token covers more characters of a text.

    Byte-level BPE entries spell one character per byte, SentencePiece entries one per character,
    and byte-fallback entries (``<0xAB>``) more than they cover, so this is an upper bound.
    """
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    try:
        return max((len(piece) for piece in get_vocab()), default=None)
    except Exception:  # noqa: BLE001 - a tokenizer without a usable vocabulary gets no cheap bound
        return None


class InputProcessor:
    def __init__(
        self,
        tokenizer,
        max_model_len: int,
        vocab_size: int,
        eos_token_ids: set[int],
        structured_output: Optional[StructuredOutputManager] = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.structured_output = structured_output  # compiles grammars, refusing bad ones before admission
        # Tokenizing runs on the engine thread: a prompt of megabytes takes long enough to stall every
        # stream, only to be refused as too long afterwards. Text that cannot fit the context
        # (twice over, for normalizers that merge characters) is refused before tokenizing.
        chars = max_chars_per_token(tokenizer)
        self.max_prompt_chars: Optional[int] = 2 * max_model_len * chars if chars else None

    def check_prompt_chars(self, num_chars: int) -> None:
        if self.max_prompt_chars is not None and num_chars > self.max_prompt_chars:
            raise ValueError(
                f"the prompt is {num_chars} characters long, more than a context of {self.max_model_len} tokens "
                f"can hold (at most {self.max_prompt_chars} characters are accepted)"
            )

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"a prompt must be a string or {{'prompt_token_ids': [...]}}, got {type(text).__name__}")
        self.check_prompt_chars(len(text))
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except Exception as e:  # noqa: BLE001 - tokenizer internals raise anything on odd input
            raise ValueError(f"could not tokenize the prompt: {e}") from None

    def process(self, prompt: PromptType, params: SamplingParams) -> ProcessedPrompt:
        text, token_ids, cache_salt = self._tokens(prompt)
        self.validate_params(params)
        max_tokens = self.resolve_max_tokens(len(token_ids), params)
        return ProcessedPrompt(text, token_ids, max_tokens, cache_salt)

    def process_for_pooling(self, prompt: PromptType) -> ProcessedPrompt:
        """A prompt to embed: it may fill the whole context, as nothing is generated after it."""
        text, token_ids, cache_salt = self._tokens(prompt)
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"the prompt is {len(token_ids)} tokens long, but the model's context length is {self.max_model_len} tokens"
            )
        return ProcessedPrompt(text, token_ids, 0, cache_salt)

    def _tokens(self, prompt: PromptType) -> tuple[Optional[str], list[int], Optional[str]]:
        """(text, checked token ids, cache salt) of a prompt."""
        cache_salt = None
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                token_ids = prompt["prompt_token_ids"]
                text = prompt.get("prompt")
            elif "prompt" in prompt:
                text = prompt["prompt"]
                token_ids = self.tokenize(text)
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
            cache_salt = prompt.get("cache_salt")
            if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
                raise ValueError("cache_salt must be a non-empty string")
        else:
            text = prompt
            token_ids = self.tokenize(prompt)
        self.validate_token_ids(token_ids)
        return text, list(token_ids), cache_salt

    def validate_token_ids(self, token_ids: Any) -> None:
        if not isinstance(token_ids, (list, tuple)):
            raise ValueError("prompt_token_ids must be a list of integers")
        if not token_ids:
            raise ValueError("the prompt is empty; it needs at least one token")
        for t in token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise ValueError(f"token id {t!r} is out of range for a vocabulary of {self.vocab_size}")

    def validate_params(self, params: SamplingParams) -> None:
        """Checks the token ids in ``params`` against the vocabulary, which SamplingParams cannot know.

        An id outside it would fail in the sampler's tensors mid-batch, after the request was accepted.
        """
        for token_id in params.logit_bias or {}:
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(f"logit_bias token id {token_id} is outside the vocabulary [0, {self.vocab_size})")
        for token_id in params.stop_token_ids or []:
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(f"stop_token_ids token id {token_id} is outside the vocabulary [0, {self.vocab_size})")
        if params.structured_outputs is not None:
            if self.structured_output is None:
                raise ValueError("structured output is not available on this engine")
            self.structured_output.validate(params.structured_outputs)
        if params.thinking_token_budget is not None and (self.structured_output is None or self.structured_output.reasoning is None):
            raise ValueError("thinking_token_budget needs a reasoning parser: start the engine with --reasoning-parser")

    def resolve_max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        if num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"the prompt is {num_prompt_tokens} tokens long, but the model's context length is "
                f"{self.max_model_len} tokens and at least one must be left to generate"
            )
        room = self.max_model_len - num_prompt_tokens
        if params.max_tokens is None:
            return room
        if params.max_tokens > room:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens, but {num_prompt_tokens} "
                f"prompt tokens plus max_tokens={params.max_tokens} make {num_prompt_tokens + params.max_tokens}; "
                "shorten the prompt or lower max_tokens"
            )
        return params.max_tokens
