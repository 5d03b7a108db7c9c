"""``--speculative-config``: vLLM's JSON keys, for n-gram prompt lookup and a draft model."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional, Union

from pagellm.json_config import dataclass_from_json

METHODS = ("ngram", "draft_model")


@dataclass
class SpeculativeConfig:
    """Where drafts come from and how many a step verifies.

    ``method`` "ngram" looks the request's last ``prompt_lookup_min..max`` tokens up in its own
    earlier tokens and proposes what followed; "draft_model" runs ``model`` (any checkpoint
    pagellm loads that shares the target's vocabulary) ahead of the target. Speculation stops
    for the step when more than ``disable_by_batch_size`` requests run. With ``adaptive`` (the
    default), each request drafts as many tokens, up to ``num_speculative_tokens``, as maximise
    the batch's expected tokens per second (pagellm.core.spec_policy): its acceptance so far
    against what the engine's steps have cost by width.
    """

    method: Optional[str] = None  # None: "draft_model" when model is given, else an error
    num_speculative_tokens: Optional[int] = None
    prompt_lookup_min: Optional[int] = None
    prompt_lookup_max: Optional[int] = None
    model: Optional[str] = None
    disable_by_batch_size: Optional[int] = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method == "[ngram]":
            self.method = "ngram"
        if self.method is None:
            if self.model is None:
                raise ValueError("speculative_config needs a method ('ngram') or a draft model ('model')")
            self.method = "draft_model"
        if self.method not in METHODS:
            raise ValueError(f"unsupported speculative method {self.method!r}; choose one of {list(METHODS)}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative method 'draft_model' needs 'model': the draft checkpoint")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"num_speculative_tokens must be a positive integer, got {k!r}")
        if self.method == "ngram":
            # vLLM's defaults: either bound stands for the other, 5 when neither is given.
            if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
                self.prompt_lookup_min = self.prompt_lookup_max = 5
            elif self.prompt_lookup_min is None:
                self.prompt_lookup_min = self.prompt_lookup_max
            elif self.prompt_lookup_max is None:
                self.prompt_lookup_max = self.prompt_lookup_min
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                value = getattr(self, name)
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ValueError(f"{name} must be a positive integer, got {value!r}")
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise ValueError(
                    f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed prompt_lookup_max ({self.prompt_lookup_max})"
                )
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be positive, got {self.disable_by_batch_size}")

    @classmethod
    def parse(cls, value: Union[None, str, dict, "SpeculativeConfig"]) -> Optional["SpeculativeConfig"]:
        """From the CLI's JSON string, a dict (``LLM(speculative_config=...)``) or a config."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        return dataclass_from_json(cls, value, "speculative_config")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
