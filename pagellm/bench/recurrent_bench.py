"""Micro-benchmark of the recurrent layers' kernels (causal conv1d, gated delta rule) on Qwen3.5-2B shapes.

    python -m pagellm.bench.recurrent_bench [--cases decode_1,decode_16,prefill_4096] [--reps 10]
                                            [--state-dtype float32|bfloat16] [--layers 1] [--save-result out.json]

Each case runs one layer's call on the same batch with the C++ kernels (pagellm.kernels.recurrent's
dispatch) and with the torch reference; the table shows the median time per call, tokens per second
and the reference's time over the kernel's. Decodes start from a state, the prefill from none.
``--state-dtype`` is the delta rule's state slots' type (``--mamba-ssm-cache-dtype``); with
``--layers N`` the calls take N layers' states in turn, as a decode step does, so that a decode's
states are read from memory rather than from a cache that held them since the last call.
"""
from __future__ import annotations

import argparse
import itertools
import platform
import statistics
import time
from typing import Callable, Iterator

import torch

from pagellm.bench.common import add_result_args, save_result
from pagellm.kernels import ops, recurrent

# Qwen3.5-2B's linear-attention layers.
NUM_K_HEADS, NUM_V_HEADS, HEAD_K_DIM, HEAD_V_DIM, CONV_KERNEL = 16, 16, 128, 128, 4
CONV_CHANNELS = 2 * NUM_K_HEADS * HEAD_K_DIM + NUM_V_HEADS * HEAD_V_DIM  # q, k and v: 6144

CASES: dict[str, list[int]] = {"decode_1": [1], "decode_16": [1] * 16, "prefill_4096": [4096]}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _median_time(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def layer_states(state: torch.Tensor, layers: int) -> Iterator[torch.Tensor]:
    """``state`` and ``layers - 1`` copies of it, in turn forever: each call the next layer's."""
    return itertools.cycle([state] + [state.clone() for _ in range(layers - 1)])


def add_state_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--state-dtype", default="float32", choices=["float32", "bfloat16"], help="the state slots' type")
    parser.add_argument("--layers", type=int, default=1, help="layers' states the calls take in turn")


def make_inputs(lengths: list[int], seed: int = 0, state_dtype: torch.dtype = torch.float32) -> dict:
    gen = torch.Generator().manual_seed(seed)
    T, N = sum(lengths), len(lengths)
    decode = all(n == 1 for n in lengths)
    meta = dict(
        query_start_loc=torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32),
        slot_ids=torch.arange(N, dtype=torch.int64),
        has_initial_state=torch.full((N,), decode),
        checkpoints=None,
    )
    conv = dict(
        x=torch.randn(T, CONV_CHANNELS, generator=gen),
        weight=torch.randn(CONV_CHANNELS, CONV_KERNEL, generator=gen) * 0.5,
        bias=None,
        conv_state=torch.randn(N, CONV_KERNEL - 1, CONV_CHANNELS, generator=gen),
    )
    gdr = dict(
        q=torch.randn(T, NUM_K_HEADS, HEAD_K_DIM, generator=gen),
        k=torch.randn(T, NUM_K_HEADS, HEAD_K_DIM, generator=gen),
        v=torch.randn(T, NUM_V_HEADS, HEAD_V_DIM, generator=gen),
        g=-torch.nn.functional.softplus(torch.randn(T, NUM_V_HEADS, generator=gen)),
        beta=torch.sigmoid(torch.randn(T, NUM_V_HEADS, generator=gen)),
        state=(torch.randn(N, NUM_V_HEADS, HEAD_K_DIM, HEAD_V_DIM, generator=gen) * 0.1).to(state_dtype),
    )
    return {"meta": meta, "conv": conv, "gdr": gdr}


def run_case(name: str, lengths: list[int], reps: int, state_dtype: torch.dtype = torch.float32, layers: int = 1) -> list[dict]:
    inputs = make_inputs(lengths, state_dtype=state_dtype)
    meta, conv, gdr = inputs["meta"], inputs["conv"], inputs["gdr"]
    tokens = sum(lengths)
    scale = HEAD_K_DIM**-0.5
    conv_states, gdr_states = layer_states(conv["conv_state"], layers), layer_states(gdr["state"], layers)
    impls = {
        "causal_conv1d": (
            lambda: recurrent.causal_conv1d(**{**conv, "conv_state": next(conv_states)}, **meta),
            lambda: recurrent.causal_conv1d_reference(**{**conv, "conv_state": next(conv_states)}, **meta),
        ),
        "gated_delta_rule": (
            lambda: recurrent.gated_delta_rule(**{**gdr, "state": next(gdr_states)}, **meta, scale=scale),
            lambda: recurrent.gated_delta_rule_reference(**{**gdr, "state": next(gdr_states)}, **meta, scale=scale),
        ),
    }
    rows = []
    for op_name, (kernel, reference) in impls.items():
        kernel_reps = reps if tokens < 1000 else max(3, reps // 3)
        t_kernel = _median_time(kernel, kernel_reps)
        t_ref = _median_time(reference, max(2, kernel_reps // 2) if tokens >= 1000 else kernel_reps)
        rows.append(dict(case=name, op=op_name, tokens=tokens, cpp_ms=t_kernel * 1e3, torch_ms=t_ref * 1e3,
                         cpp_tok_s=tokens / t_kernel, torch_tok_s=tokens / t_ref, speedup=t_ref / t_kernel))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--reps", type=int, default=10)
    add_state_args(parser)
    add_result_args(parser)
    args = parser.parse_args(argv)
    if args.layers < 1:
        parser.error("--layers must be at least 1")
    state_dtype = getattr(torch, args.state_dtype)
    if not ops.available() or not ops.gated_delta_rule_supports(*(torch.zeros(1, 1, 1),) * 3, torch.zeros(1, 1, 1, 1)):
        print(f"the C++ recurrent kernels are unavailable ({ops.load_error()}); both columns would be the torch reference")
        return 1
    print(f"CPU: {cpu_model()}, {torch.get_num_threads()} threads; torch {torch.__version__}")
    print(f"Qwen3.5-2B shapes: Hk=Hv={NUM_K_HEADS}, Dk=Dv={HEAD_K_DIM}, conv C={CONV_CHANNELS}, K={CONV_KERNEL}; float32 inputs, "
          f"{args.state_dtype} state, {args.layers} layer(s)")
    header = f"{'case':<14}{'op':<18}{'C++ ms':>10}{'torch ms':>10}{'C++ tok/s':>12}{'torch tok/s':>13}{'ratio':>8}"
    print(header)
    results = []
    for name in args.cases.split(","):
        for row in run_case(name, CASES[name], args.reps, state_dtype, args.layers):
            results.append(row)
            print(f"{row['case']:<14}{row['op']:<18}{row['cpp_ms']:>10.3f}{row['torch_ms']:>10.3f}"
                  f"{row['cpp_tok_s']:>12.0f}{row['torch_tok_s']:>13.0f}{row['speedup']:>7.1f}x")
    info = {"cpu": cpu_model(), "threads": torch.get_num_threads(), "state_dtype": args.state_dtype, "layers": args.layers}
    save_result({**info, "rows": results}, args, "recurrent_bench")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
