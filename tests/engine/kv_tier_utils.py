"""What the disk tier's end-to-end tests (test_kv_tier_e2e, test_kv_tier_tp, test_kv_tier_hybrid) share:
the engine arguments of a native tier in a directory, a run of documents one at a time, the tier's
counters."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from pagellm import LLM, SamplingParams


def random_docs(num_docs: int, doc_len: int, low: int, high: int) -> list[list[int]]:
    """``num_docs`` prompts of ``doc_len`` token ids in ``[low, high)``, the same on every call."""
    rng = random.Random(0)
    return [[rng.randrange(low, high) for _ in range(doc_len)] for _ in range(num_docs)]


def tier_args(tier_dir: Path | None, size_gib: float) -> dict[str, Any]:
    """LLM arguments of a native tier of ``size_gib`` in ``tier_dir``; none for no tier."""
    if tier_dir is None:
        return {}
    return {"kv_offloading_backend": "native", "kv_offloading_size": size_gib, "kv_offloading_dir": str(tier_dir)}


def run_each(llm: LLM, docs: list[list[int]], params: SamplingParams) -> list[tuple[list[int], int]]:
    """Each document alone (a cold run's batch shape): its output and its prefix-hit tokens."""
    out = []
    for doc in docs:
        (res,) = llm.generate([{"prompt_token_ids": doc}], params, use_tqdm=False)
        out.append((list(res.outputs[0].token_ids), res.num_cached_tokens))
    return out


def tier_stats(llm: LLM):
    """(the scheduler's tier counters, the workers' tier counters)."""
    stats = llm.llm_engine.core.scheduler.stats()
    return stats.kv_tier, stats.kv_tier_worker
