"""Sampling parameters for text generation, named and validated as vLLM's."""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional, Union

_SAMPLING_EPS = 1e-5
# Hard caps that keep one request from exhausting the server; vLLM applies similar ones.
MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_LEN = 1024
# Knobs the runner stores in fixed-width arrays: larger values would overflow there and take the
# whole batch down, not just the request. A top_k this large already means "no limit".
MAX_TOP_K = 2**31 - 1
MAX_SEED = 2**63 - 1


@dataclass
class StructuredOutputsParams:
    """What the output must match, as vLLM's: exactly one of the fields below.

    ``json`` is a JSON schema (dict or text), ``json_object`` any JSON object, ``regex`` a regular
    expression, ``choice`` one of some strings, ``grammar`` an EBNF (GBNF) grammar and
    ``structural_tag`` xgrammar's structural tag (JSON text).
    """

    json: Optional[Union[str, dict[str, Any]]] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    structural_tag: Optional[str] = None

    def __post_init__(self) -> None:
        set_fields = [k for k in ("json", "regex", "choice", "grammar", "json_object", "structural_tag") if getattr(self, k)]
        if len(set_fields) != 1:
            raise ValueError(
                "structured output needs exactly one of json, regex, choice, grammar, json_object, structural_tag; "
                f"got {set_fields or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"a JSON schema must be an object or its JSON text, got {type(self.json).__name__}")
        if isinstance(self.json, dict) or isinstance(self.json, str):
            try:
                json.dumps(self.json) if isinstance(self.json, dict) else json.loads(self.json)
            except (TypeError, ValueError) as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if self.choice is not None and (
            not isinstance(self.choice, list) or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("choice must be a non-empty list of non-empty strings")
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a string, got {type(value).__name__}")

    def cache_key(self) -> tuple[str, str]:
        """(kind, spec text): equal specs share one compiled grammar."""
        if self.json is not None:
            text = self.json if isinstance(self.json, str) else json.dumps(self.json, sort_keys=True)
            return "json", text
        if self.json_object:
            return "json_object", ""
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        if self.grammar is not None:
            return "grammar", self.grammar
        return "structural_tag", str(self.structural_tag)


class SamplingType(Enum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 means all tokens
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: Optional[dict[int, float]] = None
    structured_outputs: Optional[StructuredOutputsParams] = None
    # Tokens the reasoning may take before its end is forced (needs a reasoning parser); None: no limit.
    thinking_token_budget: Optional[int] = None
    # Filled in by the engine from the model's generation config, not by users.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.top_k is None or self.top_k == -1:
            self.top_k = 0
        if self.logit_bias:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError) as e:
                raise ValueError(f"logit_bias must map token ids to numbers: {e}") from None
        self._verify()
        if self.temperature < _SAMPLING_EPS:
            # Greedy: the other knobs cannot change the argmax, so neutralize them.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        self.all_stop_token_ids = set(self.stop_token_ids)

    def _verify(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(msg)

        def is_num(x: object) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and abs(x) != float("inf")

        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p"):
            if not is_num(getattr(self, name)):
                bad(f"{name} must be a finite number, got {getattr(self, name)!r}.")
        for name in ("n", "top_k", "min_tokens"):
            if not isinstance(getattr(self, name), int) or isinstance(getattr(self, name), bool):
                bad(f"{name} must be an integer, got {getattr(self, name)!r}.")
        if not 1 <= self.n <= MAX_N:
            bad(f"n must be between 1 and {MAX_N}, got {self.n}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not 0.0 < self.repetition_penalty <= 2.0:
            bad(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}.")
        if not 0.0 <= self.temperature <= 100.0:
            bad(f"temperature must be in [0, 100], got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            bad(f"top_k must be 0 or -1 (disable) or at least 1, got {self.top_k}.")
        if self.top_k > MAX_TOP_K:
            bad(f"top_k must be at most {MAX_TOP_K}, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None:
            # 0 means scoring only: the prompt runs (for prompt_logprobs) and nothing is generated.
            if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 0:
                bad(f"max_tokens must be at least 0, got {self.max_tokens!r}.")
        budget = self.thinking_token_budget
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 0):
            bad(f"thinking_token_budget must be an integer of at least 0, got {self.thinking_token_budget!r}.")
        if self.min_tokens < 0:
            bad(f"min_tokens must be at least 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens must be at most max_tokens={self.max_tokens}, got {self.min_tokens}.")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            bad(f"seed must be an integer, got {self.seed!r}.")
        if self.seed is not None and not -MAX_SEED - 1 <= self.seed <= MAX_SEED:
            bad(f"seed must fit in 64 bits (between {-MAX_SEED - 1} and {MAX_SEED}), got {self.seed}.")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_LOGPROBS):
                bad(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}.")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}.")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                bad(f"stop strings must be non-empty strings, got {s!r}.")
            if len(s) > MAX_STOP_STRING_LEN:
                bad(f"stop strings must be at most {MAX_STOP_STRING_LEN} characters long.")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                bad(f"stop_token_ids must be non-negative integers, got {t!r}.")
        if self.logit_bias:
            for v in self.logit_bias.values():
                if not -100.0 <= v <= 100.0:
                    bad(f"logit_bias values must be in [-100, 100], got {v}.")

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def is_greedy(self) -> bool:
        return self.sampling_type == SamplingType.GREEDY

    def update_from_generation_config(self, eos_token_ids: set[int]) -> None:
        """Stop at the model's end-of-sequence tokens unless the user asked not to."""
        if not self.ignore_eos:
            self.all_stop_token_ids |= set(eos_token_ids)

    def clone(self) -> "SamplingParams":
        return copy.deepcopy(self)
