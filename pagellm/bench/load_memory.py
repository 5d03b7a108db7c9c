"""Load a model with ``LLM()`` and print the engine's memory plan, the process's resident memory
after ready and after one short greedy generation, and its peak (docs/benchmarks.md, docs/kernels.md).

usage: python -m pagellm.bench.load_memory MODEL [KV_CACHE_MIB]
"""
from __future__ import annotations

import resource
import sys
import time

from pagellm import LLM, SamplingParams


def rss_gib() -> float:
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) / 2**20


def main() -> None:
    kv = int(sys.argv[2]) << 20 if len(sys.argv) > 2 else None
    start = time.perf_counter()
    llm = LLM(model=sys.argv[1], max_model_len=2048, kv_cache_memory_bytes=kv)
    print(f"ready in {time.perf_counter() - start:.1f} s; {llm.llm_engine.memory_plan.describe()}")
    print(f"resident after ready: {rss_gib():.2f} GiB")
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": list(range(100, 164))}], params, use_tqdm=False)
    print(f"64 in, 16 out, one stream: {time.perf_counter() - start:.1f} s")
    print(f"resident at the end: {rss_gib():.2f} GiB, peak {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


if __name__ == "__main__":
    main()
