"""Speculative decoding against plain decoding: each engine in its own process (two engines in
one process would each keep an OpenMP pool spinning on the same cores), both loaded at once and
run group by group in turn (plain, spec; then spec, plain; ...).

    .venv/bin/python scripts/spec_decode_bench.py --out docs/benchmarks/spec_decode/default.json
    .venv/bin/python scripts/spec_decode_bench.py --model M.gguf --speculative-config '{"model": D, ...}'

Four workloads, each timed on both engines:
  * grounded: one stream at a time, chat prompts that copy from a passage (pagellm.bench.grounded),
    greedy, up to --output-len tokens (the model may stop earlier; both engines give the same);
  * echo: one stream at a time, greedy; each prompt is a random stem, the engine's own greedy
    continuation of it and the stem again, so drafts come true as far as the model repeats itself
    (what a random-weight checkpoint, which copies nothing from a passage, can be drafted for);
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
    ap.add_argument("--workloads", default="grounded,random,batch", help="comma-separated: which workloads to run")
    ap.add_argument("--engine-args", default="{}", help="JSON of further LLM() keyword arguments, for both engines")
    ap.add_argument("--out", default=None)
    ap.add_argument("--role", choices=["plain", "spec"], default=None, help=argparse.SUPPRESS)
    return ap.parse_args()


def serve_role(args: argparse.Namespace) -> None:
    """One engine, loaded once, running the groups the parent names on stdin, one at a time."""
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
    wanted = set(args.workloads.split(",")) - ({"batch"} if args.skip_batch else set())
    workloads = {"grounded": ([[p] for p in grounded], greedy), "random": ([[p] for p in random_prompts], sampled)}
    workloads["batch"] = ([batch], sampled)
    workloads["echo"] = ([[p] for p in echo_prompts(llm, random_prompts, args.output_len)] if "echo" in wanted else [], greedy)
    if wanted - workloads.keys():
        raise SystemExit(f"unknown workloads {sorted(wanted - workloads.keys())}; choose from {sorted(workloads)}")
    workloads = {name: w for name, w in workloads.items() if name in wanted}
    scheduler = llm.llm_engine.core.scheduler
    print("READY " + json.dumps({name: len(groups) for name, (groups, _) in workloads.items()}), flush=True)
    for line in sys.stdin:
        name, index = line.split()
        groups, params = workloads[name]
        before = scheduler.stats().spec_decoding
        seconds, tokens = timed(llm, groups[int(index)], params)
        after = scheduler.stats().spec_decoding
        stats = after.since(before).to_dict() if after else None
        print("RESULT " + json.dumps({"seconds": seconds, "tokens": tokens, "spec_decoding": stats}), flush=True)


def echo_prompts(llm: LLM, stems: list[dict], output_len: int) -> list[dict]:
    """Each stem (its first half), the engine's greedy continuation of it, and the stem again: both
    engines make the same prompts, as greedy speculative output is the plain output."""
    halves = [{"prompt_token_ids": s["prompt_token_ids"][: len(s["prompt_token_ids"]) // 2]} for s in stems]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    outs = llm.generate(halves, params, use_tqdm=False)
    return [
        {"prompt_token_ids": h["prompt_token_ids"] + list(o.outputs[0].token_ids) + h["prompt_token_ids"]}
        for h, o in zip(halves, outs)
    ]


class Engine:
    """A child process serving one role."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.proc = subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--role", role], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.groups = json.loads(self._reply("READY "))

    def _reply(self, prefix: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix):]
        raise SystemExit(f"{self.role} engine exited (code {self.proc.wait()})")

    def run(self, name: str, index: int) -> dict:
        self.proc.stdin.write(f"{name} {index}\n")
        self.proc.stdin.flush()
        return json.loads(self._reply("RESULT "))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2


def main() -> int:
    args = parse_args()
    if args.role is not None:
        serve_role(args)
        return 0
    # Both engines stay loaded (the idle one blocks on its pipe, its threads asleep) and run each
    # group in turn, the first of each pair alternating: the two timings of a pair are seconds
    # apart, so the machine's drift cancels in their ratio.
    engines = {role: Engine(role) for role in ("plain", "spec")}
    totals: dict = {}
    pairs: dict[str, list[float]] = {}
    turn = 0
    for _ in range(args.rounds):
        for name, num_groups in engines["plain"].groups.items():
            for i in range(num_groups):
                order = ("plain", "spec") if turn % 2 == 0 else ("spec", "plain")
                turn += 1
                got = {role: engines[role].run(name, i) for role in order}
                keys = [name] + ([f"grounded:{TASK_NAMES[i % len(TASK_NAMES)]}"] if name == "grounded" else [])
                for key in keys:
                    for role, r in got.items():
                        t = totals.setdefault(key, {}).setdefault(role, {"seconds": 0.0, "tokens": 0, "spec": []})
                        t["seconds"] += r["seconds"]
                        t["tokens"] += r["tokens"]
                        if r["spec_decoding"] and key == name:
                            t["spec"].append(r["spec_decoding"])
                    tps = {role: r["tokens"] / r["seconds"] for role, r in got.items()}
                    pairs.setdefault(key, []).append(tps["spec"] / tps["plain"])
    for engine in engines.values():
        engine.close()
    result = {"model": args.model or "SmolLM2-135M-Instruct (default)", "speculative_config": json.loads(args.speculative_config),
              "engine_args": json.loads(args.engine_args), "rounds": args.rounds, "workloads": {}}
    print(f"{'workload':18s} {'plain tok/s':>11s} {'spec tok/s':>10s} {'ratio':>6s} {'median pair':>11s} {'pairs':>5s}"
          f" {'accepted':>8s} {'tokens/verif.':>13s} {'verifs':>6s}")
    for name, t in totals.items():
        tps = {role: t[role]["tokens"] / t[role]["seconds"] for role in ("plain", "spec")}
        runs = t["spec"]["spec"]  # per task: no acceptance of its own (the counters are per workload)
        drafts = sum(r["num_draft_tokens"] for r in runs)
        accepted = sum(r["num_accepted_tokens"] for r in runs)
        verifs = sum(r["num_drafts"] for r in runs)
        rate = accepted / drafts if drafts else 0.0
        per_verif = 1 + accepted / verifs if verifs else 1.0
        ratio = tps["spec"] / tps["plain"]
        result["workloads"][name] = {"output_tokens_per_s": tps, "ratio": ratio, "median_pair_ratio": median(pairs[name]),
                                     "pair_ratios": pairs[name], "tokens": {r: t[r]["tokens"] for r in tps}}
        line = f"{name:18s} {tps['plain']:11.1f} {tps['spec']:10.1f} {ratio:5.2f}x {median(pairs[name]):10.2f}x {len(pairs[name]):5d}"
        if runs:  # a grounded task's acceptance is counted with the whole workload
            result["workloads"][name].update(acceptance_rate=rate, tokens_per_verification=per_verif, num_verifications=verifs)
            line += f" {rate:8.1%} {per_verif:13.2f} {verifs:6d}"
        print(line)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
