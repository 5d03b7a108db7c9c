"""``pagellm bench profile``: where a decode step's time goes.

    pagellm bench profile --batch-size 32 --input-len 256 --num-steps 20

Fills a batch with prompts, lets the prefills finish, then times decode steps: the engine's own
phase clocks (scheduling, input preparation, forward pass, logits + sampling, bookkeeping) and,
under torch.profiler, the split of the forward pass between matrix multiplies, attention and
everything else (norms, RoPE, activations, Python); and the KV cache bytes decode attention
reads per step (every context's keys and values in every layer, in the cache's format).
"""
from __future__ import annotations

import argparse
import random
import time

_MATMUL_OPS = {
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "pagellm_gemm::linear_packed",
    "pagellm_gemm::linear_packed_gated",  # the gate/up projection with its activation
    "pagellm_gemm_bf16::linear_bf16",
    "pagellm_gemm_int8::linear_int8",
}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    from pagellm.cli import add_engine_args

    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--num-steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=0, help="also print the N operators with the most self time")
    add_engine_args(parser)


def main(args: argparse.Namespace) -> int:
    from torch.profiler import ProfilerActivity, profile

    from pagellm import LLM, SamplingParams
    from pagellm.cli import engine_kwargs
    from pagellm.engine.output_processor import RequestOutputKind

    llm = LLM(**engine_kwargs(args))
    engine = llm.llm_engine
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.num_steps * 3 + 8, ignore_eos=True)
    for i in range(args.batch_size):
        prompt = [rng.randrange(100, engine.shape.vocab_size - 100) for _ in range(args.input_len)]
        engine.add_request(f"p{i}", {"prompt_token_ids": prompt}, params, RequestOutputKind.DELTA)
    worker = llm._step_thread  # the thread that built the engine steps it, as in the front ends

    def step():
        return worker.submit(engine.step).result()

    def last_step():
        return engine.stats().last_step

    while (s := last_step()) is None or s.num_prefill_tokens > 0 or s.num_reqs < args.batch_size:
        step()
    for _ in range(3):  # warm-up of the pure decode shape
        step()
    phases = {"schedule": 0.0, "prepare": 0.0, "forward": 0.0, "sample": 0.0, "update": 0.0, "step": 0.0}
    _, scheduler = engine.kv_cache_view()
    context_tokens_before = sum(r.num_computed_tokens for r in scheduler.running)
    t0 = time.perf_counter()
    for _ in range(args.num_steps):
        step()
        s = last_step()
        for key in ("schedule", "prepare", "forward", "sample", "update"):
            phases[key] += getattr(s, f"{key}_s")
        phases["step"] += s.duration_s
    wall = time.perf_counter() - t0
    context_tokens_after = sum(r.num_computed_tokens for r in scheduler.running)
    def profiled_steps():
        # The profiler records the thread it is entered on, so it runs on the engine's thread.
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(max(3, args.num_steps // 4)):
                engine.step()
        return prof

    # Kineto initialises itself on first use and complains ("External init callback must run in
    # same thread as registerClient") when that first use is on another thread than the main one.
    with profile(activities=[ProfilerActivity.CPU]):
        pass
    prof = worker.submit(profiled_steps).result()
    matmul = attention = total = 0.0
    for evt in prof.key_averages():
        total += evt.self_cpu_time_total
        if evt.key in _MATMUL_OPS:
            matmul += evt.self_cpu_time_total
        elif evt.key.startswith("pagellm_attn::") or "attention" in evt.key:
            attention += evt.self_cpu_time_total
    n = args.num_steps
    step_ms = phases["step"] / n * 1000
    forward_ms = phases["forward"] / n * 1000

    def share(ms: float) -> float:
        return 100 * ms / step_ms

    mm_fwd = forward_ms * matmul / total if total else 0.0
    attn_fwd = forward_ms * attention / total if total else 0.0
    rows = [
        ("matrix multiplies (forward)", mm_fwd),
        ("attention", attn_fwd),
        ("other forward ops (norms, RoPE)", forward_ms - mm_fwd - attn_fwd),
        ("logits (lm_head) + sampling", phases["sample"] / n * 1000),
        ("input preparation", phases["prepare"] / n * 1000),
        ("scheduling + bookkeeping", (phases["schedule"] + phases["update"]) / n * 1000),
    ]
    print(f"decode step at batch {args.batch_size}, context ~{args.input_len}: {step_ms:.1f} ms "
          f"({args.batch_size * n / wall:.1f} tok/s incl. output processing)")
    for name, ms in rows:
        print(f"  {name:<40}{ms:8.1f} ms {share(ms):6.1f}%")
    core = engine.core
    layout = core.kv_cache_layout
    # K and V of one layer for one token; a sliding layer reads at most its window per sequence.
    layer_token_bytes = core.kv_block_bytes / (layout.group_size * core.block_size)
    bytes_per_token = layer_token_bytes * engine.shape.num_layers
    context = (context_tokens_before + context_tokens_after) / 2 / args.batch_size
    read_tokens = sum(min(context, w) if w else context for w in engine.shape.layer_sliding_windows)
    kv_read = read_tokens * args.batch_size * layer_token_bytes
    rate = f", {kv_read / (attn_fwd / 1000) / 1e9:.1f} GB/s in attention" if attn_fwd > 0 else ""
    print(f"  KV cache read by attention per step: {kv_read / 2**20:.1f} MiB "
          f"({engine.memory_plan.kv_cache_dtype}, {bytes_per_token:,.0f} bytes a token){rate}")
    if args.top:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    return 0
