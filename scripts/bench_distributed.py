"""TP=1 vs TP=2 vs DP=2 on the same offline workload, through the async engine (as the server runs it).

    PYTHONPATH=. .venv/bin/python scripts/bench_distributed.py --num-prompts 32 --input-len 128 --output-len 64

Every request is submitted at once; prints requests/s and output tokens/s per setting and, for
TP, the share of step time rank 0 spent in collectives (all-reduce, all-gather, broadcast).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

from pagellm.config import EngineConfig
from pagellm.engine.async_llm import AsyncLLM
from pagellm.engine.data_parallel import DPAsyncLLM
from pagellm.sampling_params import SamplingParams


async def _drive(llm, prompts, params) -> int:
    async def one(i: int) -> int:
        stream = await llm.add_request(str(i), {"prompt_token_ids": prompts[i]}, params)
        n = 0
        async for out in stream:
            n += len(out.outputs[0].token_ids)
        return n

    return sum(await asyncio.gather(*(one(i) for i in range(len(prompts)))))


def run(name: str, make, prompts, params) -> dict:
    llm = make()
    try:
        asyncio.run(_drive(llm, prompts[:2], SamplingParams(temperature=0.0, max_tokens=2)))  # warm-up
        t0 = time.perf_counter()
        tokens = asyncio.run(_drive(llm, prompts, params))
        elapsed = time.perf_counter() - t0
        engines = [r.engine for r in llm.replicas] if isinstance(llm, DPAsyncLLM) else [llm.engine]
        steps = [e.stats().steps for e in engines]
        comm = sum(s.comm_s for s in steps) / max(1e-9, sum(s.steps_s for s in steps))
    finally:
        llm.shutdown()
    result = {
        "setting": name,
        "elapsed_s": round(elapsed, 2),
        "requests_per_s": round(len(prompts) / elapsed, 3),
        "output_tokens_per_s": round(tokens / elapsed, 1),
        "comm_share_of_step_time": round(comm, 3),
    }
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--settings", default="tp1,tp2,dp2")
    parser.add_argument("--num-kv-blocks", type=int, default=1024)
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)

    def config(**kw) -> EngineConfig:
        return EngineConfig(num_kv_blocks=args.num_kv_blocks, max_model_len=args.input_len + args.output_len + 16, device="cpu", **kw)

    makers = {
        "tp1": lambda: AsyncLLM.from_config(config()),
        # One engine on one thread: what each TP rank and DP replica gets on a 2-core machine.
        "tp1-1t": lambda: AsyncLLM.from_config(config(num_threads=1)),
        "tp2": lambda: AsyncLLM.from_config(config(tensor_parallel_size=2)),
        "dp2": lambda: DPAsyncLLM.from_config(config(), 2),
    }
    for name in args.settings.split(","):
        run(name, makers[name], prompts, params)


if __name__ == "__main__":
    main()
