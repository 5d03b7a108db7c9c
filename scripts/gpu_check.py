"""The CUDA path, checked and measured on one GPU with no network: correctness, throughput, graphs.

For each of two Llama shapes (SmolLM2-135M's config, and a 1B shape: hidden 2048, 16 layers,
32/8 heads, intermediate 8192), random weights are saved as a Hugging Face safetensors directory
with the tokenizer files given (see scripts/export_tokenizer.py), then:

1. greedy outputs of pagellm equal transformers' generate in float32 (8 prompts x 32 tokens), and
   the first step's max |logit difference|;
2. offline throughput in bfloat16, 1,024 prompts of 256 random tokens in, 128 out (ignore_eos),
   against transformers' generate in static batches of 64 (``--hf-batches`` of them; a rate);
3. one decode step at batch 256, eager against CUDA-graph replay, with the memory bandwidth it
   reaches (weights + KV read per step) and the throughput run's MFU, against 790 TFLOP/s and
   4.3 TB/s (H200 figures).

The figures go to a JSON file. ``--smoke`` runs the same code on CPU with tiny shapes and counts
(float32 throughout, graph timing skipped), so the script is known to work up to the GPU parts.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pagellm import LLM, SamplingParams
from pagellm.attention.backend import AttentionMetadata

PEAK_FLOPS = 790e12  # bf16 dense, as given for the H200 in this check
PEAK_BYTES_PER_S = 4.3e12

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
    "Water boils at",
    "In 1969, the first humans",
    "A haiku about the sea:",
    "The quick brown fox",
]


@dataclass
class Shape:
    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int


SHAPES = [Shape("smollm2-135m", 576, 30, 9, 3, 1536), Shape("llama-1b", 2048, 16, 32, 8, 8192)]
SMOKE_SHAPES = [Shape("smollm2-tiny", 576, 2, 9, 3, 256), Shape("llama-tiny", 256, 2, 4, 1, 512)]


@dataclass
class Plan:
    device: str
    shapes: list[Shape]
    check_prompts: int = 8
    check_tokens: int = 32
    num_prompts: int = 1024
    input_len: int = 256
    output_len: int = 128
    hf_batch: int = 64
    hf_batches: int = 4
    decode_batch: int = 256
    throughput_dtype: str = "bfloat16"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192

    @classmethod
    def smoke(cls) -> "Plan":
        return cls(
            "cpu", SMOKE_SHAPES, check_prompts=2, check_tokens=4, num_prompts=8, input_len=16, output_len=8,
            hf_batch=4, hf_batches=1, decode_batch=8, throughput_dtype="float32", max_num_seqs=8, max_num_batched_tokens=256,
        )


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(device: str, fn: Callable[[], Any]) -> tuple[Any, float]:
    sync(device)
    t0 = time.perf_counter()
    result = fn()
    sync(device)
    return result, time.perf_counter() - t0


def build_model_dir(shape: Shape, tokenizer_dir: str, out_dir: str, vocab_size: int, seed: int = 0) -> str:
    """A random-weight Llama of ``shape`` saved as safetensors (bf16, as SmolLM2's) plus the tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    path = os.path.join(out_dir, shape.name)
    model.save_pretrained(path, safe_serialization=True)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), path)
    return path


def load_hf(path: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).to(device).eval()
    # Generation here never stops early: as pagellm's ignore_eos.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def free(*objects: Any) -> None:
    for obj in objects:
        thread = getattr(obj, "_step_thread", None)
        if thread is not None:
            thread.shutdown(wait=True)
    del objects
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def pagellm_logits(llm: LLM, prompt_ids: list[int]) -> torch.Tensor:
    """The model's next-token logits after one prefill, on a scratch paged cache of its own."""
    engine = llm.llm_engine
    model, device = engine.model, engine.config.device
    n, block_size = len(prompt_ids), 16
    num_blocks = -(-n // block_size)
    shape = engine.shape
    cache_dtype = engine.resolved.precision.kv_cache_dtype
    caches = [
        torch.zeros(2, num_blocks, block_size, shape.num_kv_heads, shape.head_dim, dtype=cache_dtype, device=device)
        for _ in range(shape.num_layers)
    ]
    md = AttentionMetadata(
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        block_table=torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
        slot_mapping=torch.arange(n, dtype=torch.int64, device=device),
        max_query_len=n,
        max_seq_len=n,
        query_start_loc_cpu=[0, n],
        seq_lens_cpu=[n],
    )
    with torch.inference_mode():
        ids = torch.tensor(prompt_ids, device=device)
        hidden = model(ids, torch.arange(n, device=device), caches, md)
        return model.compute_logits(hidden[-1:])[0].float().cpu()


def check_greedy(path: str, plan: Plan) -> dict[str, Any]:
    """pagellm's greedy tokens against transformers', both float32."""
    llm = LLM(model=path, dtype="float32", device=plan.device, max_num_seqs=16, enforce_eager=False, kv_cache_memory_bytes="1GiB")
    tokenizer = llm.get_tokenizer()
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS[: plan.check_prompts]]
    params = SamplingParams(max_tokens=plan.check_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    ours = [list(o.outputs[0].token_ids) for o in outs]
    first_logits = [pagellm_logits(llm, ids) for ids in prompt_ids]
    free(llm)
    hf = load_hf(path, torch.float32, plan.device)
    theirs, diffs = [], []
    with torch.inference_mode():
        for ids, ours_logits in zip(prompt_ids, first_logits):
            x = torch.tensor([ids], device=plan.device)
            diffs.append((hf(x).logits[0, -1].float().cpu() - ours_logits).abs().max().item())
            gen = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=plan.check_tokens, do_sample=False)
            theirs.append(gen[0, len(ids) :].tolist())
    free(hf)
    matches = sum(a == b for a, b in zip(ours, theirs))
    return {
        "prompts": len(prompt_ids),
        "tokens": plan.check_tokens,
        "sequences_equal": matches,
        "all_equal": matches == len(prompt_ids),
        "first_step_max_abs_logit_diff": max(diffs),
    }


def check_eight_bit_kv(path: str, plan: Plan) -> dict[str, Any]:
    """Greedy tokens with 8-bit KV caches (Triton's fp8 / int8 kernels, CUDA graphs replaying the
    measured fp8 scales) against a bfloat16 cache: how many sequences stay equal, and where the
    others first differ."""
    results: dict[str, Any] = {}
    reference: list[list[int]] = []
    prompt_ids: list[list[int]] = []
    params = SamplingParams(max_tokens=plan.check_tokens, temperature=0.0, ignore_eos=True)
    for kv_cache_dtype, extra in (("bfloat16", {}), ("fp8", {"calculate_kv_scales": True}), ("int8", {})):
        llm = LLM(model=path, dtype="float32", device=plan.device, max_num_seqs=16, kv_cache_memory_bytes="1GiB",
                  kv_cache_dtype=kv_cache_dtype, **extra)
        if not prompt_ids:
            tokenizer = llm.get_tokenizer()
            prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS[: plan.check_prompts]]
        outs = [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": i} for i in prompt_ids], params, use_tqdm=False)]
        graphs = llm.llm_engine.core.runner.cuda_graphs is not None
        free(llm)
        if not reference:
            reference = outs
            results[kv_cache_dtype] = {"cuda_graphs": graphs}
            continue
        first_diffs = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), None) for o, r in zip(outs, reference)]
        results[kv_cache_dtype] = {
            "sequences_equal_to_bfloat16": sum(d is None for d in first_diffs),
            "first_differences": [d for d in first_diffs if d is not None],
            "cuda_graphs": graphs,
        }
    return results


def param_count(hf_like: dict[str, int]) -> int:
    h, i, layers, vocab = hf_like["hidden"], hf_like["intermediate"], hf_like["layers"], hf_like["vocab"]
    q, kv = hf_like["q_size"], hf_like["kv_size"]
    return layers * (h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h) + vocab * h + h


def throughput(path: str, plan: Plan, vocab_size: int, dims: dict[str, int]) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, vocab_size, (plan.num_prompts, plan.input_len), generator=gen).tolist()
    params = SamplingParams(max_tokens=plan.output_len, temperature=0.0, ignore_eos=True)
    dtype = getattr(torch, plan.throughput_dtype)
    result: dict[str, Any] = {"dtype": plan.throughput_dtype, "prompts": plan.num_prompts, "input_len": plan.input_len,
                              "output_len": plan.output_len}
    llm = LLM(
        model=path, dtype=plan.throughput_dtype, device=plan.device, max_num_seqs=plan.max_num_seqs,
        max_num_batched_tokens=plan.max_num_batched_tokens, max_model_len=plan.input_len + plan.output_len + 16,
    )
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    _, elapsed = timed(plan.device, lambda: llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
    tokens = plan.num_prompts * (plan.input_len + plan.output_len)
    flops = 2 * param_count(dims) * tokens + attention_flops(dims, plan)
    result["pagellm"] = {
        "seconds": elapsed,
        "output_tokens_per_s": plan.num_prompts * plan.output_len / elapsed,
        "total_tokens_per_s": tokens / elapsed,
        "mfu": flops / elapsed / PEAK_FLOPS,
        "cuda_graphs": llm.llm_engine.core.runner.cuda_graphs is not None,
    }
    result["decode_step"] = decode_step(llm, plan, dims, dtype)
    free(llm)
    hf = load_hf(path, dtype, plan.device)
    n = plan.hf_batch * plan.hf_batches
    with torch.inference_mode():
        hf.generate(torch.tensor(prompts[:2], device=plan.device), max_new_tokens=2, do_sample=False)  # warm-up

        def run_hf() -> None:
            for b in range(plan.hf_batches):
                x = torch.tensor(prompts[b * plan.hf_batch : (b + 1) * plan.hf_batch], device=plan.device)
                n_out = plan.output_len
                hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n_out, min_new_tokens=n_out, do_sample=False)

        _, hf_elapsed = timed(plan.device, run_hf)
    free(hf)
    result["transformers"] = {
        "prompts_run": n,
        "batch": plan.hf_batch,
        "seconds": hf_elapsed,
        "output_tokens_per_s": n * plan.output_len / hf_elapsed,
        "total_tokens_per_s": n * (plan.input_len + plan.output_len) / hf_elapsed,
    }
    result["speedup_output_tokens"] = result["pagellm"]["output_tokens_per_s"] / result["transformers"]["output_tokens_per_s"]
    return result


def attention_flops(dims: dict[str, int], plan: Plan) -> int:
    # QK^T and PV: 4 * q_size flops per (query, visible key) pair per layer, causal.
    total_len = plan.input_len + plan.output_len
    pairs = total_len * (total_len + 1) // 2
    return 4 * dims["q_size"] * dims["layers"] * pairs * plan.num_prompts


def decode_step(llm: LLM, plan: Plan, dims: dict[str, int], dtype: torch.dtype) -> dict[str, Any]:
    """One decode step at ``plan.decode_batch`` sequences, each with input_len + output_len/2 of context."""
    runner = llm.llm_engine.core.runner
    device, block_size = plan.device, runner.block_size
    batch, context = plan.decode_batch, plan.input_len + plan.output_len // 2
    blocks_per_seq = -(-context // block_size)
    num_blocks = runner.kv_caches[0].shape[1]
    if batch * blocks_per_seq > num_blocks:
        return {"skipped": f"the KV cache holds {num_blocks} blocks, fewer than {batch * blocks_per_seq}"}
    table = torch.arange(batch * blocks_per_seq, dtype=torch.int32, device=device).view(batch, blocks_per_seq)
    positions = torch.full((batch,), context - 1, dtype=torch.int64, device=device)
    slots = table[:, -1].long() * block_size + (context - 1) % block_size
    md = AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        block_table=table,
        slot_mapping=slots,
        max_query_len=1,
        max_seq_len=context,
        query_start_loc_cpu=list(range(batch + 1)),
        seq_lens_cpu=[context] * batch,
    )
    ids = torch.randint(100, 1000, (batch,), device=device)

    def time_it(fn: Callable[[], Any], iters: int = 20) -> float:
        for _ in range(3):
            fn()
        _, elapsed = timed(device, lambda: [fn() for _ in range(iters)])
        return elapsed / iters

    with torch.inference_mode():
        eager_s = time_it(lambda: runner.model(ids, positions, runner.kv_caches, md))
        graphs = runner.cuda_graphs
        size = graphs.graph_size_for(md) if graphs is not None else None
        graph_s = time_it(lambda: graphs.run(ids, positions, md, size)) if size is not None else None
    elem = torch.empty((), dtype=runner.kv_caches[0].dtype).element_size()
    kv_bytes = batch * context * dims["layers"] * 2 * dims["kv_size"] * elem
    weight_bytes = param_count(dims) * torch.empty((), dtype=dtype).element_size()
    best = graph_s or eager_s
    return {
        "batch": batch,
        "context": context,
        "eager_ms": eager_s * 1e3,
        "graph_ms": graph_s * 1e3 if graph_s is not None else None,
        "graph_speedup": eager_s / graph_s if graph_s else None,
        "bytes_per_step": weight_bytes + kv_bytes,
        "bandwidth_fraction": (weight_bytes + kv_bytes) / best / PEAK_BYTES_PER_S,
        "mfu": 2 * param_count(dims) * batch / best / PEAK_FLOPS,
    }


def run(plan: Plan, tokenizer_dir: str, work_dir: str) -> dict[str, Any]:
    from transformers import AutoTokenizer

    vocab_size = len(AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True))
    report: dict[str, Any] = {"device": plan.device, "torch": torch.__version__, "plan": asdict(plan), "shapes": {}}
    if plan.device.startswith("cuda"):
        report["gpu"] = torch.cuda.get_device_name()
    for shape in plan.shapes:
        t0 = time.perf_counter()
        path = build_model_dir(shape, tokenizer_dir, work_dir, vocab_size)
        head_dim = shape.hidden_size // shape.num_attention_heads
        dims = {
            "hidden": shape.hidden_size, "intermediate": shape.intermediate_size, "layers": shape.num_hidden_layers,
            "vocab": vocab_size, "q_size": shape.num_attention_heads * head_dim, "kv_size": shape.num_key_value_heads * head_dim,
        }
        entry: dict[str, Any] = {"shape": asdict(shape), "params": param_count(dims)}
        entry["greedy_float32"] = check_greedy(path, plan)
        entry["eight_bit_kv"] = check_eight_bit_kv(path, plan)
        entry["throughput"] = throughput(path, plan, vocab_size, dims)
        entry["seconds"] = time.perf_counter() - t0
        report["shapes"][shape.name] = entry
        print(json.dumps({shape.name: entry}, indent=1), flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True, help="folder of tokenizer files (scripts/export_tokenizer.py)")
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and counts on CPU")
    parser.add_argument("--device", default=None)
    parser.add_argument("--hf-batches", type=int, default=None, help="transformers batches of 64 to time (default 4)")
    parser.add_argument("--shapes", default=None, help="comma-separated shape names to run (default: all)")
    args = parser.parse_args(argv)
    plan = Plan.smoke() if args.smoke else Plan("cuda", SHAPES)
    if args.device:
        plan.device = args.device
    if args.hf_batches:
        plan.hf_batches = args.hf_batches
    if args.shapes:
        wanted = set(args.shapes.split(","))
        plan.shapes = [s for s in plan.shapes if s.name in wanted]
        if not plan.shapes:
            raise ValueError(f"no shape named in {args.shapes!r}")
    if plan.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: no CUDA device; use --smoke for the CPU run", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pagellm-gpu-check-") as work_dir:
        report = run(plan, args.tokenizer, work_dir)
    report["seconds"] = time.perf_counter() - t0
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out} in {report['seconds']:.0f} s")
    ok = all(entry["greedy_float32"]["all_equal"] for entry in report["shapes"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
