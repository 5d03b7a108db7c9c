"""Output throughput of one batch where every request has its own LoRA adapter, against the same
batch on the base model, in one engine and one run (docs/lora.md).

    .venv/bin/python scripts/lora_bench.py [--num-loras 32] [--rank 16] [--targets q_proj,v_proj] [--output-len 64]
        [--aten-min-rows N] [--engine-args JSON]

Adapters are random (rank ``--rank``, all seven targets unless ``--targets`` names some, e.g. PEFT's
default for Llama, q_proj,v_proj), written to a temporary directory. The
runs alternate base / LoRA ``--repeats`` times after a warm-up that puts every adapter in a slot;
decode steps' median time for each is reported, and their difference is the LoRA part's cost.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

from pagellm import LLM, LoRARequest, SamplingParams
from pagellm.bench.lora_adapters import SUPPORTED_TARGETS, write_random_adapter
from pagellm.kernels import ops


def timed_run(llm: LLM, prompts: list[dict], params: SamplingParams, loras) -> tuple[float, int, list[float]]:
    """(seconds, output tokens, decode steps' seconds) of one batch."""
    engine = llm.llm_engine
    for prompt, lora in zip(prompts, loras):
        engine.add_request(engine.next_request_id(), prompt, params, lora_request=lora)
    decode_steps: list[float] = []
    num_tokens = 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                num_tokens += len(out.outputs[0].token_ids)
        last = engine.stats().last_step
        if last is not None and last.num_prefill_tokens == 0 and last.num_reqs == len(prompts):
            decode_steps.append(last.duration_s)
    return time.perf_counter() - t0, num_tokens, decode_steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-loras", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", default=",".join(SUPPORTED_TARGETS), help="comma-separated target modules (default: all seven)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--aten-min-rows", type=int, default=None, help="rows of one adapter from which a run goes to ATen's matmul")
    ap.add_argument("--engine-args", default="{}", help='extra LLM keyword arguments as JSON, e.g. \'{"dtype": "float32"}\'')
    args = ap.parse_args()
    if args.aten_min_rows is not None:
        ops.LORA_ATEN_MIN_ROWS = args.aten_min_rows
    n = args.num_loras
    targets = tuple(t.strip() for t in args.targets.split(",") if t.strip())
    if not targets or any(t not in SUPPORTED_TARGETS for t in targets):
        raise SystemExit(f"--targets must name some of {', '.join(SUPPORTED_TARGETS)}")
    llm = LLM(enable_lora=True, max_loras=n, max_lora_rank=args.rank, max_num_seqs=max(n, 1), **json.loads(args.engine_args))
    hf_config = llm.llm_engine.hf_config
    with tempfile.TemporaryDirectory() as root:
        loras = [
            LoRARequest(f"bench{i}", i + 1, write_random_adapter(f"{root}/{i}", hf_config, args.rank, targets, seed=i)) for i in range(n)
        ]
        prompts = [{"prompt_token_ids": [1000 + 7 * i + j for j in range(args.prompt_len)]} for i in range(n)]
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False, lora_request=loras)  # every adapter in a slot
        results: dict[str, list[tuple[float, int, list[float]]]] = {"base": [], "lora": []}
        for _ in range(args.repeats):
            llm.llm_engine.reset_prefix_cache()
            results["base"].append(timed_run(llm, prompts, params, [None] * n))
            llm.llm_engine.reset_prefix_cache()
            results["lora"].append(timed_run(llm, prompts, params, loras))
    summary = {}
    for name, runs in results.items():
        summary[name] = {
            "output_tok_s": max(tokens / seconds for seconds, tokens, _ in runs),
            "decode_step_ms": 1000 * statistics.median(s for _, _, steps in runs for s in steps),
        }
    report = {
        "num_loras": n,
        "rank": args.rank,
        "aten_min_rows": ops.LORA_ATEN_MIN_ROWS,
        "targets": list(targets),
        "linear_layers": llm.llm_engine.config.linear_precision.describe(),
        **summary,
        "throughput_ratio": summary["lora"]["output_tok_s"] / summary["base"]["output_tok_s"],
        "lora_ms_per_decode_step": summary["lora"]["decode_step_ms"] - summary["base"]["decode_step_ms"],
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
