"""Configs given as JSON on the command line (vLLM's ``--speculative-config``, ``--pooler-config``)
or as a dict of the same keys from Python: one parser for every such dataclass."""
from __future__ import annotations

import json
from dataclasses import fields
from typing import Any, TypeVar, Union

T = TypeVar("T")


def dataclass_from_json(cls: type[T], value: Union[str, dict[str, Any]], name: str) -> T:
    """``cls(**keys)`` from a JSON object or a dict; ValueError naming ``name`` for bad JSON, a
    non-object, or keys ``cls`` does not have."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"unsupported {name} keys {unknown}; pagellm takes {sorted(known)}")
    return cls(**value)
