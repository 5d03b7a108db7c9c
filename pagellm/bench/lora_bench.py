"""Batched multi-LoRA: the grouped low-rank update ``ops.lora_shrink_expand`` alone, or a whole engine.

    python -m pagellm.bench.lora_bench [--ranks 8,16,32,64] [--shapes 576x960,2048x16384] [--threads N] [--save-result out.json]
    python -m pagellm.bench.lora_bench --engine [--num-loras 32] [--rank 16] [--targets q_proj,v_proj] [--output-len 64]
        [--aten-min-rows N] [--engine-args JSON] [--save-result out.json]

The kernel (the default):

Decode: 32 rows, each its own adapter (32 segments of one row), for each (in, out) shape, rank and
pool dtype (float32, bfloat16). As in a model's layers, the weights stream from memory: the pass
runs over enough distinct adapter pools (one per "layer") to read ``--stream-mib`` of weights.
Reported per call: the kernel's time, the GB/s of adapter weights it reads (every used slot's A and
B once), the GB/s of a ``torch.sum`` over the same bytes read as float32 (what reading them costs
at best), the
torch reference loop's time (``ops.lora_shrink_expand_reference``: two matmuls per segment) and
the kernel's speed-up over it, all in one run.

Prefill: ``--prefill-segments`` segments of each length in ``--prefill-rows``, each its own adapter,
through the kernel's own loops and through ATen's matmul per run (the two sides of
``ops.LORA_ATEN_MIN_ROWS``), against the reference loop.

The engine (``--engine``, docs/lora.md): output throughput of one batch of ``--num-loras`` requests
(``--prompt-len`` tokens in, ``--output-len`` out, greedy, ``ignore_eos``), every request on its own
random adapter (rank ``--rank``, all seven targets unless ``--targets`` names some, e.g. PEFT's
default for Llama, q_proj,v_proj, written to a temporary directory), against the same batch on the
base model, in one engine. The runs alternate base / LoRA ``--repeats`` times after a warm-up that
puts every adapter in a slot; the best throughput of each and the median time of their decode steps
are reported, and the decode steps' difference is the LoRA part's cost.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

from pagellm.bench.common import best_of, positive_int_list
from pagellm.kernels import ops

DECODE_ROWS = 32
# Always the kernel's own loops, or ATen from the first row.
NATIVE_ONLY = 1 << 62
ATEN_ALWAYS = 1


@dataclass
class LoraPools:
    """Distinct adapter pools of one shape, with the tensors of one call's batch."""

    lora_a: list[torch.Tensor]
    lora_b: list[torch.Tensor]
    x: torch.Tensor
    y: torch.Tensor
    seg_starts: torch.Tensor
    seg_slots: torch.Tensor

    def run(self, aten_min_rows: int = ops.LORA_ATEN_MIN_ROWS) -> None:
        for a, b in zip(self.lora_a, self.lora_b):
            ops.lora_shrink_expand(self.y, self.x, a, b, self.seg_starts, self.seg_slots, aten_min_rows=aten_min_rows)

    def run_reference(self) -> None:
        for a, b in zip(self.lora_a, self.lora_b):
            ops.lora_shrink_expand_reference(self.y, self.x, a, b, self.seg_starts, self.seg_slots)

    def read_weights(self) -> None:
        # as float32, whatever the pool's dtype: a sum of bfloat16 runs slower than memory on some CPUs
        for a, b in zip(self.lora_a, self.lora_b):
            a.reshape(-1).view(torch.float32).sum()
            b.reshape(-1).view(torch.float32).sum()

    def bytes_per_call(self) -> int:
        """Bytes of every used slot's A and B, in one pool."""
        used = len(set(self.seg_slots.tolist()) - {-1})
        a, b = self.lora_a[0], self.lora_b[0]
        return used * (a[0].numel() + b[0].numel()) * a.element_size()


def make_pools(
    in_features: int, out_features: int, rank: int, dtype: torch.dtype, segment_rows: list[int], stream_bytes: int, seed: int = 0
) -> LoraPools:
    """One slot per segment; as many pools as it takes to hold ``stream_bytes`` (at least 2)."""
    num_slots = len(segment_rows)
    pool_bytes = num_slots * rank * (in_features + out_features) * torch.finfo(dtype).bits // 8
    num_pools = max(2, -(-stream_bytes // pool_bytes))
    gen = torch.Generator().manual_seed(seed)
    lora_a = [(torch.randn(num_slots, rank, in_features, generator=gen) * 0.02).to(dtype) for _ in range(num_pools)]
    lora_b = [(torch.randn(num_slots, out_features, rank, generator=gen) * 0.02).to(dtype) for _ in range(num_pools)]
    num_tokens = sum(segment_rows)
    starts = torch.tensor([0, *segment_rows], dtype=torch.int64).cumsum(0)
    return LoraPools(lora_a, lora_b, torch.randn(num_tokens, in_features, generator=gen), torch.zeros(num_tokens, out_features),
                     starts, torch.arange(num_slots, dtype=torch.int64))


@dataclass
class DecodeRow:
    in_features: int
    out_features: int
    rank: int
    dtype: str
    num_pools: int
    kernel_ms: float  # per call
    kernel_gb_s: float  # adapter weight bytes read per second
    sum_gb_s: float  # torch.sum over the same bytes
    reference_ms: float
    speedup: float  # reference / kernel


@dataclass
class PrefillRow:
    in_features: int
    out_features: int
    rank: int
    dtype: str
    segment_rows: int
    num_segments: int
    loops_ms: float  # the kernel's own loops, per call
    aten_ms: float  # ATen's matmul per run
    reference_ms: float
    loops_vs_aten: float  # aten / loops: above 1, the loops are faster


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def decode_case(in_features: int, out_features: int, rank: int, dtype: torch.dtype, reps: int, stream_bytes: int) -> DecodeRow:
    pools = make_pools(in_features, out_features, rank, dtype, [1] * DECODE_ROWS, stream_bytes)
    kernel_s = reference_s = sum_s = float("inf")
    for _ in range(2):  # alternate, so drift on a shared machine hits all of them
        kernel_s = min(kernel_s, best_of(pools.run, reps))
        sum_s = min(sum_s, best_of(pools.read_weights, reps))
        reference_s = min(reference_s, best_of(pools.run_reference, reps))
    num_pools = len(pools.lora_a)
    total_bytes = pools.bytes_per_call() * num_pools
    return DecodeRow(in_features, out_features, rank, _dtype_name(dtype), num_pools, kernel_s / num_pools * 1e3,
                     total_bytes / kernel_s / 1e9, total_bytes / sum_s / 1e9, reference_s / num_pools * 1e3,
                     reference_s / kernel_s)


def prefill_case(
    in_features: int, out_features: int, rank: int, dtype: torch.dtype, segment_rows: int, num_segments: int, reps: int
) -> PrefillRow:
    pools = make_pools(in_features, out_features, rank, dtype, [segment_rows] * num_segments, 0)
    loops_s = aten_s = reference_s = float("inf")
    for _ in range(2):
        loops_s = min(loops_s, best_of(lambda: pools.run(NATIVE_ONLY), reps))
        aten_s = min(aten_s, best_of(lambda: pools.run(ATEN_ALWAYS), reps))
        reference_s = min(reference_s, best_of(pools.run_reference, reps))
    num_pools = len(pools.lora_a)
    return PrefillRow(in_features, out_features, rank, _dtype_name(dtype), segment_rows, num_segments, loops_s / num_pools * 1e3,
                      aten_s / num_pools * 1e3, reference_s / num_pools * 1e3, aten_s / loops_s)


def _shape_list(text: str) -> list[tuple[int, int]]:
    shapes = []
    for part in text.split(","):
        fields = part.lower().split("x")
        if len(fields) != 2 or not all(f.isdigit() and int(f) > 0 for f in fields):
            raise ValueError(f"expected shapes as IN x OUT, e.g. 576x960, got {part!r}")
        shapes.append((int(fields[0]), int(fields[1])))
    return shapes


def timed_run(llm, prompts: list[dict], params, loras: list) -> tuple[float, int, list[float]]:
    """(seconds, output tokens, decode steps' seconds) of one batch through ``llm``'s engine."""
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


def run_engine(args: argparse.Namespace) -> dict:
    """The ``--engine`` benchmark: one batch on ``--num-loras`` adapters against the base model."""
    from pagellm import LLM, LoRARequest, SamplingParams
    from pagellm.bench.lora_adapters import SUPPORTED_TARGETS, write_random_adapter

    targets = tuple(t.strip() for t in args.targets.split(",") if t.strip()) if args.targets else SUPPORTED_TARGETS
    if not targets or any(t not in SUPPORTED_TARGETS for t in targets):
        raise SystemExit(f"--targets must name some of {', '.join(SUPPORTED_TARGETS)}")
    if args.aten_min_rows is not None:
        ops.LORA_ATEN_MIN_ROWS = args.aten_min_rows
    n = args.num_loras
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
    return {
        "num_loras": n,
        "rank": args.rank,
        "aten_min_rows": ops.LORA_ATEN_MIN_ROWS,
        "targets": list(targets),
        "linear_layers": llm.llm_engine.resolved.precision.linear.describe(),
        **summary,
        "throughput_ratio": summary["lora"]["output_tok_s"] / summary["base"]["output_tok_s"],
        "lora_ms_per_decode_step": summary["lora"]["decode_step_ms"] - summary["base"]["decode_step_ms"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", action="store_true", help="the whole engine on many adapters instead of the kernel alone")
    parser.add_argument("--threads", type=int, default=None, help="torch's threads (default: as torch starts)")
    parser.add_argument("--save-result", default=None, help="write the result as JSON here")
    kernel = parser.add_argument_group("the kernel alone (default)")
    kernel.add_argument("--shapes", type=_shape_list, default=_shape_list("576x960,2048x16384"), help="IN x OUT, comma-separated")
    kernel.add_argument("--ranks", type=positive_int_list, default=[8, 16, 32, 64])
    kernel.add_argument("--dtypes", default="float32,bfloat16")
    kernel.add_argument("--reps", type=int, default=3)
    kernel.add_argument("--stream-mib", type=int, default=256, help="distinct adapter weights per decode pass")
    kernel.add_argument("--prefill-rows", type=positive_int_list, default=[8, 32, 256], help="rows per prefill segment")
    kernel.add_argument("--prefill-segments", type=int, default=4)
    kernel.add_argument("--prefill-ranks", type=positive_int_list, default=[16, 64])
    kernel.add_argument("--no-decode", action="store_true")
    kernel.add_argument("--no-prefill", action="store_true")
    engine = parser.add_argument_group("the engine (--engine)")
    engine.add_argument("--num-loras", type=int, default=32, help="requests in the batch, each on its own adapter")
    engine.add_argument("--rank", type=int, default=16)
    engine.add_argument("--targets", default=None, help="comma-separated target modules (default: all seven)")
    engine.add_argument("--prompt-len", type=int, default=64)
    engine.add_argument("--output-len", type=int, default=64)
    engine.add_argument("--repeats", type=int, default=3)
    engine.add_argument("--aten-min-rows", type=int, default=None, help="rows of one adapter from which a run goes to ATen's matmul")
    engine.add_argument("--engine-args", default="{}", help='extra LLM keyword arguments as JSON, e.g. \'{"dtype": "float32"}\'')
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.engine:
        report = run_engine(args)
        print(json.dumps(report, indent=2))
        if args.save_result:
            with open(args.save_result, "w", encoding="utf-8") as f:
                json.dump(report, f, indent=2)
        return 0
    if not ops.available():
        print(f"the C++ kernels are unavailable ({ops.load_error()}); nothing to compare")
        return 1
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    print(f"{torch.get_num_threads()} threads\ndecode: {DECODE_ROWS} rows, each its own adapter; ms per call")
    print(f"{'in -> out':<14}{'rank':>5}{'pool':>10}{'pools':>6}{'kernel ms':>11}{'GB/s':>7}{'sum GB/s':>9}{'ref ms':>9}{'speed-up':>9}")
    decode_rows = []
    for in_features, out_features in [] if args.no_decode else args.shapes:
        for rank in args.ranks:
            for dtype in dtypes:
                row = decode_case(in_features, out_features, rank, dtype, args.reps, args.stream_mib << 20)
                decode_rows.append(row)
                print(f"{f'{in_features} -> {out_features}':<14}{rank:>5}{row.dtype:>10}{row.num_pools:>6}{row.kernel_ms:>11.3f}"
                      f"{row.kernel_gb_s:>7.1f}{row.sum_gb_s:>9.1f}{row.reference_ms:>9.3f}{row.speedup:>8.2f}x")
    prefill_rows = []
    if not args.no_prefill:
        print(f"\nprefill: {args.prefill_segments} segments of each length, each its own adapter; ms per call")
        print(f"{'in -> out':<14}{'rank':>5}{'pool':>10}{'rows':>6}{'loops ms':>10}{'ATen ms':>9}{'ref ms':>9}{'ATen/loops':>11}")
        for in_features, out_features in args.shapes:
            for rank in args.prefill_ranks:
                for dtype in dtypes:
                    for rows in args.prefill_rows:
                        row = prefill_case(in_features, out_features, rank, dtype, rows, args.prefill_segments, args.reps)
                        prefill_rows.append(row)
                        print(f"{f'{in_features} -> {out_features}':<14}{rank:>5}{row.dtype:>10}{rows:>6}{row.loops_ms:>10.3f}"
                              f"{row.aten_ms:>9.3f}{row.reference_ms:>9.3f}{row.loops_vs_aten:>10.2f}x")
    if args.save_result:
        with open(args.save_result, "w", encoding="utf-8") as f:
            json.dump({"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                       "decode": [asdict(r) for r in decode_rows], "prefill": [asdict(r) for r in prefill_rows]}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
