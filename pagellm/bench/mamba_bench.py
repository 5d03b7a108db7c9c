"""Micro-benchmark of the Mamba-2 selective state scan (pagellm.kernels.mamba) at Granite 4.0-H and Nemotron-H shapes.

    python -m pagellm.bench.mamba_bench [--shapes granite-4.0-h-micro,nemotron-h-8b] [--cases decode_16,prefill_2048]
                                        [--reps 10] [--state-dtype float32|bfloat16] [--layers 1] [--save-result out.json]

Each case runs one layer's scan on the same batch with the C++ kernel (the dispatch of
``mamba.selective_state_scan``) and with the torch reference (chunked SSD form, 256-token chunks);
the table shows the median time per call, tokens per second and the reference's time over the
kernel's. Decodes start from a state, the prefill from none. Float32 inputs; ``--state-dtype`` is the
state slots' type (``--mamba-ssm-cache-dtype``), and with ``--layers N`` the calls take N layers'
states in turn, as a decode step does (see recurrent_bench).
"""
from __future__ import annotations

import argparse

import torch

from pagellm.bench.common import add_result_args, save_result
from pagellm.bench.recurrent_bench import _median_time, add_state_args, cpu_model, layer_states
from pagellm.kernels import mamba, ops

# (heads, head dim, state size, groups) of the Mamba-2 layers.
SHAPES: dict[str, tuple[int, int, int, int]] = {
    "granite-4.0-h-micro": (64, 64, 128, 1),
    "nemotron-h-8b": (128, 64, 128, 8),
}
CASES: dict[str, list[int]] = {"decode_16": [1] * 16, "prefill_2048": [2048]}


def make_inputs(shape: tuple[int, int, int, int], lengths: list[int], seed: int = 0, state_dtype: torch.dtype = torch.float32) -> dict:
    H, P, N, G = shape
    gen = torch.Generator().manual_seed(seed)
    T, num_seqs = sum(lengths), len(lengths)
    decode = all(n == 1 for n in lengths)
    return dict(
        x=torch.randn(T, H, P, generator=gen),
        dt=torch.randn(T, H, generator=gen) - 2.0,
        A=-torch.exp(torch.rand(H, generator=gen) * 2.0),
        B=torch.randn(T, G, N, generator=gen),
        C=torch.randn(T, G, N, generator=gen),
        D=torch.randn(H, generator=gen),
        dt_bias=torch.randn(H, generator=gen) * 0.5,
        state=(torch.randn(num_seqs, H, P, N, generator=gen) * 0.1).to(state_dtype),
        query_start_loc=torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32),
        slot_ids=torch.arange(num_seqs, dtype=torch.int64),
        has_initial_state=torch.full((num_seqs,), decode),
        checkpoints=None,
    )


def run_case(shape_name: str, name: str, reps: int, state_dtype: torch.dtype = torch.float32, layers: int = 1) -> dict:
    lengths = CASES[name]
    inputs = make_inputs(SHAPES[shape_name], lengths, state_dtype=state_dtype)
    tokens = sum(lengths)
    kernel_reps = reps if tokens < 1000 else max(3, reps // 3)
    states = layer_states(inputs["state"], layers)
    t_kernel = _median_time(lambda: mamba.selective_state_scan(**{**inputs, "state": next(states)}), kernel_reps)
    t_ref = _median_time(lambda: mamba.selective_state_scan_reference(**{**inputs, "state": next(states)}), kernel_reps)
    return dict(shape=shape_name, case=name, tokens=tokens, cpp_ms=t_kernel * 1e3, torch_ms=t_ref * 1e3,
                cpp_tok_s=tokens / t_kernel, torch_tok_s=tokens / t_ref, speedup=t_ref / t_kernel)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--reps", type=int, default=10)
    add_state_args(parser)
    add_result_args(parser)
    args = parser.parse_args(argv)
    if args.layers < 1:
        parser.error("--layers must be at least 1")
    if not ops.selective_state_scan_supports(torch.zeros(1, 1, 1), torch.zeros(1, 1, 1, 1)):
        print(f"the C++ Mamba-2 kernel is unavailable ({ops.load_error()}); both columns would be the torch reference")
        return 1
    print(f"CPU: {cpu_model()}, {torch.get_num_threads()} threads; torch {torch.__version__}; float32 inputs, "
          f"{args.state_dtype} state, {args.layers} layer(s)")
    print(f"{'shape':<21}{'case':<14}{'C++ ms':>10}{'torch ms':>10}{'C++ tok/s':>12}{'torch tok/s':>13}{'ratio':>8}")
    results = []
    for shape_name in args.shapes.split(","):
        for name in args.cases.split(","):
            row = run_case(shape_name, name, args.reps, getattr(torch, args.state_dtype), args.layers)
            results.append(row)
            print(f"{row['shape']:<21}{row['case']:<14}{row['cpp_ms']:>10.3f}{row['torch_ms']:>10.3f}"
                  f"{row['cpp_tok_s']:>12.0f}{row['torch_tok_s']:>13.0f}{row['speedup']:>7.1f}x")
    info = {"cpu": cpu_model(), "threads": torch.get_num_threads(), "state_dtype": args.state_dtype, "layers": args.layers}
    save_result({**info, "shapes": SHAPES, "rows": results}, args, "mamba_bench")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
