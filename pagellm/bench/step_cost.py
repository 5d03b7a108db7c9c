"""What a step costs by its number of tokens, against a one-token decode step (median seconds).

    python -m pagellm.bench.step_cost [--model M] [--engine-args JSON] [--widths 1,2,3,5,9,17,33]

Width 1: decode steps of one request (they sample); wider: prefill chunks of that many tokens at
a context of 300+ (they do not sample until the last). This is the curve speculative decoding's
verification rides on (docs/speculative_decoding.md).
"""
from __future__ import annotations

import argparse
import json
import statistics

from pagellm import SamplingParams
from pagellm.config import EngineConfig
from pagellm.engine.llm_engine import LLMEngine


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--engine-args", default="{}")
    ap.add_argument("--widths", default="1,2,3,5,9,17,33")
    args = ap.parse_args()
    extra = json.loads(args.engine_args)
    base = None
    for n in (int(w) for w in args.widths.split(",")):
        engine = LLMEngine(EngineConfig(model=args.model, max_num_batched_tokens=max(n, 2), enable_prefix_caching=False, **extra))
        if n == 1:
            engine.add_request("a", {"prompt_token_ids": list(range(1000, 1300))}, SamplingParams(max_tokens=40, ignore_eos=True))
        else:
            engine.add_request("a", {"prompt_token_ids": list(range(1000, 1300 + 20 * n))}, SamplingParams(max_tokens=1))
        times, step = [], 0
        while engine.has_unfinished_requests():
            engine.step()
            last = engine.core.stats().last_step
            step += 1
            if step > 20 and last is not None and last.num_scheduled_tokens == n:
                times.append(last.duration_s)
        median = statistics.median(times)
        base = base or median
        print(f"{n:4d} tokens: {median * 1000:7.2f} ms  {median / base:5.2f}x  ({len(times)} steps)", flush=True)
        engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
