"""The pooling runner's knobs, named as vLLM's: ``--pooler-config`` (engine) and ``PoolingParams`` (request)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from pagellm.json_config import dataclass_from_json

POOLING_TYPES = ("LAST", "MEAN", "CLS")
RUNNERS = ("generate", "pooling")
# Older vLLM's --task names that mean the pooling runner.
POOLING_TASKS = ("embed", "embedding", "encode")


@dataclass
class PoolerConfig:
    """How a pooling engine turns a prompt's last hidden states (after the final norm) into one vector.

    ``LAST`` takes the last prompt token's state (a decoder LLM as an embedder: vLLM's default),
    ``MEAN`` the average over every prompt position, ``CLS`` the first position's. ``normalize``
    is the default of requests that do not say.
    """

    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.pooling_type, str) or self.pooling_type.upper() not in POOLING_TYPES:
            raise ValueError(f"unsupported pooling_type {self.pooling_type!r}; choose one of {list(POOLING_TYPES)}")
        self.pooling_type = self.pooling_type.upper()
        if not isinstance(self.normalize, bool):
            raise ValueError(f"pooler_config normalize must be true or false, got {self.normalize!r}")

    @property
    def supports_prefix_caching(self) -> bool:
        """Only LAST is correct over cached blocks: the last prompt token always runs, while MEAN
        and CLS need positions a cache hit would skip (vLLM's pooling runner decides the same)."""
        return self.pooling_type == "LAST"

    @classmethod
    def parse(cls, value: Union[None, str, dict[str, Any], "PoolerConfig"]) -> "PoolerConfig":
        """``--pooler-config``'s JSON, a dict of the same keys, a config, or None (the defaults)."""
        if value is None:
            return cls()
        if isinstance(value, PoolerConfig):
            return value
        return dataclass_from_json(cls, value, "pooler_config")


def resolve_runner(runner: Optional[str], task: Optional[str]) -> str:
    """vLLM's ``--runner``, with older vLLM's ``--task embed`` accepted for the pooling runner."""
    if task is not None:
        if task in POOLING_TASKS:
            task_runner = "pooling"
        elif task == "generate":
            task_runner = "generate"
        else:
            raise ValueError(f"unsupported task {task!r}; choose generate or embed (or use runner='pooling')")
        if runner is not None and runner != task_runner:
            raise ValueError(f"task={task!r} asks for runner {task_runner!r}, but runner={runner!r} was given")
        return task_runner
    runner = runner or "generate"
    if runner not in RUNNERS:
        raise ValueError(f"unsupported runner {runner!r}; choose one of {list(RUNNERS)}")
    return runner


@dataclass
class PoolingParams:
    """Per request, as vLLM's: ``dimensions`` keeps the first N values (Matryoshka truncation),
    ``normalize`` L2-normalizes after truncating (None: the engine's pooler_config default)."""

    dimensions: Optional[int] = None
    normalize: Optional[bool] = None

    def __post_init__(self) -> None:
        d = self.dimensions
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise ValueError(f"dimensions must be a positive integer, got {d!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")

    def resolved(self, config: PoolerConfig, hidden_size: int) -> "PoolingParams":
        """A copy with every field decided: checked against the model's width, defaults filled in."""
        if self.dimensions is not None and self.dimensions > hidden_size:
            raise ValueError(f"dimensions must be between 1 and the model's embedding size {hidden_size}, got {self.dimensions}")
        normalize = config.normalize if self.normalize is None else self.normalize
        return PoolingParams(dimensions=self.dimensions or hidden_size, normalize=normalize)
