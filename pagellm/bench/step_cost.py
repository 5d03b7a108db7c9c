"""What a step costs by its number of tokens, against a one-token decode step (median seconds).

    python -m pagellm.bench.step_cost [--model M] [--engine-args JSON] [--widths 1,2,3,5,9,17,33] [--verify]

Width 1: decode steps of one request (they sample); wider: prefill chunks of that many tokens at
a context of 300+ (they do not sample until the last). This is the curve speculative decoding's
verification rides on (docs/speculative_decoding.md). With ``--verify`` a wider step is a real
verification instead: one request decoding with n - 1 n-gram drafts a step (forced: the last token
repeated, whatever the lookup finds), sampled by the rejection sampler, and on a hybrid model with
its n - 1 draft states saved (docs/hybrid_models.md).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from collections.abc import Iterator
from typing import Optional

from pagellm import SamplingParams
from pagellm.config import EngineConfig
from pagellm.engine.llm_engine import LLMEngine
from pagellm.spec_decode.ngram_proposer import NgramProposer


@contextlib.contextmanager
def forced_drafts() -> Iterator[None]:
    """n-gram proposals that never miss: the last token, as many times as asked (a step's cost
    does not depend on whether its drafts are right)."""
    propose = NgramProposer.propose
    NgramProposer.propose = lambda self, token_ids, num_draft_tokens: [int(token_ids[-1])] * num_draft_tokens
    try:
        yield
    finally:
        NgramProposer.propose = propose


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--engine-args", default="{}")
    ap.add_argument("--widths", default="1,2,3,5,9,17,33")
    ap.add_argument("--verify", action="store_true", help="wider steps verify n - 1 drafts instead of prefilling")
    args = ap.parse_args(argv)
    extra = json.loads(args.engine_args)
    base = None
    for n in (int(w) for w in args.widths.split(",")):
        verify = args.verify and n > 1
        spec = {"method": "ngram", "num_speculative_tokens": n - 1, "prompt_lookup_min": 1, "adaptive": False} if verify else None
        config = EngineConfig(
            model=args.model, max_num_batched_tokens=max(n, 64 if verify else 2), enable_prefix_caching=False,
            speculative_config=spec, **extra,
        )
        with forced_drafts() if verify else contextlib.nullcontext():
            engine = LLMEngine(config)
            if n == 1 or verify:
                engine.add_request("a", {"prompt_token_ids": list(range(1000, 1300))}, SamplingParams(max_tokens=60, ignore_eos=True))
            else:
                engine.add_request("a", {"prompt_token_ids": list(range(1000, 1300 + 20 * n))}, SamplingParams(max_tokens=1))
            times, step = [], 0
            while engine.has_unfinished_requests():
                engine.step()
                last = engine.core.stats().last_step
                step += 1
                if step > (5 if verify else 20) and last is not None and last.num_scheduled_tokens == n:
                    times.append((last.duration_s, last.forward_s, last.sample_s))
            engine.shutdown()
        median, forward, sample = (statistics.median(t[i] for t in times) for i in range(3))
        base = base or median
        kind = "verifying" if verify else "tokens"
        print(
            f"{n:4d} {kind}: {median * 1000:7.2f} ms  {median / base:5.2f}x  (forward {forward * 1000:.2f} ms, "
            f"sampling {sample * 1000:.2f} ms; {len(times)} steps)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
