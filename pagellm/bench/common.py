"""Pieces every ``pagellm bench`` subcommand shares: result files, prompt sampling setup and timing a call."""
from __future__ import annotations

import argparse
import json
import os
import time
from datetime import datetime
from typing import Any, Callable, Optional

import numpy as np


def add_result_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("results")
    g.add_argument("--save-result", action="store_true", help="write the result as JSON")
    g.add_argument("--result-dir", default=None, help="directory for the JSON result (default: current)")
    g.add_argument("--result-filename", default=None, help="file name of the JSON result (default: derived from the run)")


def result_path(args: argparse.Namespace, default_stem: str) -> Optional[str]:
    """Where the JSON result goes, or None when it is not to be saved."""
    if not getattr(args, "save_result", False):
        return None
    name = args.result_filename or f"{default_stem}-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        name = os.path.join(args.result_dir, name)
    return name


def _to_jsonable(value: Any) -> Any:
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"cannot serialize {type(value).__name__}")


def save_result(result: dict[str, Any], args: argparse.Namespace, default_stem: str) -> Optional[str]:
    path = result_path(args, default_stem)
    if path is None:
        return None
    with open(path, "w") as f:
        json.dump(result, f, indent=2, default=_to_jsonable)
    print(f"Saved result to {path}")
    return path


def positive_int_list(text: str) -> list[int]:
    """'8,16,32' -> [8, 16, 32]."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"expected positive integers, got {text!r}")
    return values


def best_of(fn: Callable[[], None], reps: int) -> float:
    """The fastest of ``reps`` timed calls of ``fn`` in seconds, after one untimed warm-up call."""
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best
