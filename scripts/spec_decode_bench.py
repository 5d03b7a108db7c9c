"""Speculative decoding against plain decoding: each engine in its own process (two engines in
one process would each keep an OpenMP pool spinning on the same cores), runs interleaved
(plain, spec, plain, spec).

    .venv/bin/python scripts/spec_decode_bench.py --out docs/benchmarks/spec_decode/default.json
    .venv/bin/python scripts/spec_decode_bench.py --model M.gguf --speculative-config '{"model": D, ...}'

Three workloads, each timed on both engines:
  * grounded: one stream at a time, chat prompts that copy from a passage (pagellm.bench.grounded),
    greedy, up to --output-len tokens (the model may stop earlier; both engines give the same);
  * random: one stream at a time, random token prompts, temperature 1, exactly --output-len tokens;
  * batch: --batch-size random prompts at once, temperature 1, exactly --output-len tokens each.
Prints a table and writes the figures as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pagellm import LLM, SamplingParams
from pagellm.bench.datasets import random_dataset, tokenizer_token_ids
from pagellm.bench.grounded import grounded_dataset

TASK_NAMES = ("repeat", "correct", "summarise")  # pagellm.bench.grounded.TASKS, in order
DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def timed(llm: LLM, prompts: list[dict], params: SamplingParams) -> tuple[float, int]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--speculative-config", default=json.dumps(DEFAULT_SPEC))
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved runs of each engine")
    ap.add_argument("--skip-batch", action="store_true")
    ap.add_argument("--engine-args", default="{}", help="JSON of further LLM() keyword arguments, for both engines")
    ap.add_argument("--out", default=None)
    ap.add_argument("--role", choices=["plain", "spec"], default=None, help=argparse.SUPPRESS)
    return ap.parse_args()


def run_role(args: argparse.Namespace) -> dict:
    """One engine through every workload; the figures as a dict (printed as JSON by the child)."""
    extra = json.loads(args.engine_args)
    spec = json.loads(args.speculative_config) if args.role == "spec" else None
    llm = LLM(model=args.model, speculative_config=spec, **extra)
    tokenizer = llm.get_tokenizer()
    token_ids = tokenizer_token_ids(tokenizer)
    n, in_len, out_len = args.num_prompts, args.input_len, args.output_len
    grounded = [{"prompt_token_ids": s.prompt_token_ids} for s in grounded_dataset(n, in_len, out_len, tokenizer)]
    random_prompts = [{"prompt_token_ids": s.prompt_token_ids} for s in random_dataset(n, in_len, out_len, token_ids, seed=1)]
    batch = [{"prompt_token_ids": s.prompt_token_ids} for s in random_dataset(args.batch_size, in_len, out_len, token_ids, seed=2)]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.output_len)
    sampled = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(grounded[:1] + random_prompts[:1], SamplingParams(max_tokens=16), use_tqdm=False)  # warm-up
    workloads = {"grounded": ([[p] for p in grounded], greedy), "random": ([[p] for p in random_prompts], sampled)}
    if not args.skip_batch:
        workloads["batch"] = ([batch], sampled)
    scheduler = llm.llm_engine.core.scheduler
    out = {}
    for name, (groups, params) in workloads.items():
        before = scheduler.stats().spec_decoding
        seconds = tokens = 0
        for i, group in enumerate(groups):
            dt, n = timed(llm, group, params)
            seconds += dt
            tokens += n
            if name == "grounded":  # also per task: prompt i asks for TASKS[i % len(TASKS)]
                task = out.setdefault(f"grounded:{TASK_NAMES[i % len(TASK_NAMES)]}", {"seconds": 0.0, "tokens": 0, "spec_decoding": None})
                task["seconds"] += dt
                task["tokens"] += n
        after = scheduler.stats().spec_decoding
        out[name] = {"seconds": seconds, "tokens": tokens, "spec_decoding": after.since(before).to_dict() if after else None}
    return out


def main() -> int:
    args = parse_args()
    if args.role is not None:
        print("RESULT " + json.dumps(run_role(args)), flush=True)
        return 0
    totals: dict = {}
    for _ in range(args.rounds):
        for role in ("plain", "spec"):
            proc = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--role", role], capture_output=True, text=True, check=False)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                raise SystemExit(f"{role} run failed:\n{proc.stderr[-3000:]}")
            for name, r in json.loads(lines[-1][7:]).items():
                t = totals.setdefault(name, {}).setdefault(role, {"seconds": 0.0, "tokens": 0, "spec": []})
                t["seconds"] += r["seconds"]
                t["tokens"] += r["tokens"]
                if r["spec_decoding"]:
                    t["spec"].append(r["spec_decoding"])
    result = {"model": args.model or "SmolLM2-135M-Instruct (default)", "speculative_config": json.loads(args.speculative_config),
              "engine_args": json.loads(args.engine_args), "rounds": args.rounds, "workloads": {}}
    print(f"{'workload':10s} {'plain tok/s':>12s} {'spec tok/s':>11s} {'ratio':>7s} {'accepted':>9s} {'tokens/verif.':>14s} {'verifs':>7s}")
    for name, t in totals.items():
        tps = {role: t[role]["tokens"] / t[role]["seconds"] for role in ("plain", "spec")}
        runs = t["spec"]["spec"]  # per task: no acceptance of its own (the counters are per workload)
        drafts = sum(r["num_draft_tokens"] for r in runs)
        accepted = sum(r["num_accepted_tokens"] for r in runs)
        verifs = sum(r["num_drafts"] for r in runs)
        rate = accepted / drafts if drafts else 0.0
        per_verif = 1 + accepted / verifs if verifs else 1.0
        result["workloads"][name] = {"output_tokens_per_s": tps, "ratio": tps["spec"] / tps["plain"],
                                     "tokens": {r: t[r]["tokens"] for r in tps}, "acceptance_rate": rate,
                                     "tokens_per_verification": per_verif, "num_verifications": verifs}
        ratio = tps["spec"] / tps["plain"]
        if not runs:  # a grounded task: its acceptance is counted with the whole workload
            print(f"{name:10s} {tps['plain']:12.1f} {tps['spec']:11.1f} {ratio:6.2f}x")
            continue
        print(f"{name:10s} {tps['plain']:12.1f} {tps['spec']:11.1f} {ratio:6.2f}x {rate:8.1%} {per_verif:14.2f} {verifs:7d}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
