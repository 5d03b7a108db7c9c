"""What pagellm measures about the CPU at start-up, as one immutable :class:`CpuTuning`.

Some kernel choices depend on the core more than on its instruction set, so a fixed table per
instruction set would be wrong on some machine (docs/kernels.md has the measurements):

* whether decode attention prefetches the next keys and values into L2 only or into L1 too;
* up to how many rows the packed matmul's float32 panels beat BLAS (row limits are keyed by the
  weight's ggml type and packed layout, :class:`TuningKey`; float32 panels are the one layout
  measured today).

:func:`measure_cpu_tuning` times each on the model's own weights;
the engine calls it once and hands the result to the attention backend and the model. The decode
prefetch level depends on the machine and on the model's attention (its heads and the cache's
element size: the best level differs between few and many kv heads), so its answer
is kept per :class:`DecodeShape` beside the kernel library built for this CPU
(``decode_prefetch.json``) and read at later starts: its probe allocates ~100 MiB whose first
touch is slow in a VM that backs memory lazily.
``PAGELLM_RETUNE=1`` measures it again. The row limits depend on the model's shapes and are
measured at every start. ``python -m pagellm.kernels.tuning`` prints what this machine measures,
as JSON.

Between BLAS and the panels the choice changes only the order of float32 sums.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from typing import Callable, NamedTuple, Optional, Protocol, Sequence

import torch
from torch.nn import functional as F

from pagellm import envs
from pagellm.kernels import build, ops

logger = logging.getLogger(__name__)

# Decode at up to 32 sequences of 256-4,096 keys (a cache of 16-64 MiB), over copies of it that
# together exceed a last-level cache, so the timed passes read from memory as a model step does.
DECODE_PROBE_SEQS, DECODE_PROBE_BLOCK = 32, 16
DECODE_PROBE_MIN_CONTEXT, DECODE_PROBE_MAX_CONTEXT = 256, 4096
DECODE_PROBE_CACHE_BYTES, DECODE_PROBE_MAX_CACHE_BYTES, DECODE_PROBE_TOTAL_BYTES = 16 << 20, 64 << 20, 96 << 20
DECODE_PROBE_REPEATS = 3
# L2 prefetches must win by this much to replace the default (L1).
DECODE_MIN_GAIN = 1.03
# Where the decode prefetch level measured for a kernel build is kept, in that build's folder.
DECODE_PREFETCH_FILE = "decode_prefetch.json"

# Row counts probed for the panels against BLAS. The limit is the last probe the panels win
# before they first lose, so one noisy loss only makes the limit more conservative.
BLAS_PROBE_ROWS = (64, 256, 1024)
# Output rows kept from each probed weight, and weights probed in all: about one layer of a
# small model, so that a 1,024-row product stays short.
PROBE_MAX_OUT_FEATURES = 4096
PROBE_MAX_WEIGHTS = 3_500_000
# A path must be this much faster to take over from the default: ties go to the safer choice.
MIN_GAIN = 1.02
REPEATS = 2
# Read between timed calls to push the probe out of the caches (twice a large last-level cache).
FLUSH_BYTES = 64 * 2**20
UNLIMITED_ROWS = 1 << 30


class TuningKey(NamedTuple):
    """Which weights a :class:`RowLimits` is for: their ggml type name as the kernel multiplies
    them (``"F32"``) and their packed layout (``"panels"``). A plain tuple compares equal."""

    ggml_type: str
    layout: str


# The float32 panels of ops.pack_weight / ops.pack_weight_gate_up, against BLAS.
F32_PANELS = TuningKey("F32", "panels")


@dataclass(frozen=True)
class RowLimits:
    """Up to ``packed_max_rows`` rows the packed kernel is used, BLAS beyond."""

    packed_max_rows: int


@dataclass(frozen=True)
class DecodeShape:
    """A model's decode attention as one rank runs it, for the prefetch probe: query and kv
    heads, head size and the cache's element type."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    cache_dtype: torch.dtype

    @property
    def probe_dtype(self) -> torch.dtype:
        """float32 for a float32 cache, else bfloat16: the kernel converts every element of a
        16- or 8-bit cache alike and waits on that rather than on memory."""
        return torch.float32 if self.cache_dtype == torch.float32 else torch.bfloat16

    @property
    def key(self) -> str:
        dtype = str(self.probe_dtype).removeprefix("torch.")
        return f"{self.num_heads}q/{self.num_kv_heads}kv/{self.head_dim}d/{dtype}"


# SmolLM2-135M's heads under its default (bfloat16) cache: the command line's probe.
SMOLLM2_DECODE_SHAPE = DecodeShape(9, 3, 64, torch.bfloat16)


@dataclass(frozen=True)
class CpuTuning:
    """The start-up measurements the kernels' callers act on.

    ``row_limits`` holds ``(key, limits)`` pairs (:class:`TuningKey`) for what was measured; a
    key without an entry keeps the caller's built-in default.
    """

    decode_prefetch_to_l2: bool = False
    row_limits: tuple[tuple[TuningKey, RowLimits], ...] = ()

    @classmethod
    def untuned(cls) -> CpuTuning:
        """Nothing measured: the kernels' defaults (other devices, tests, no kernels)."""
        return cls()

    def limits_for(self, key: tuple[str, str]) -> Optional[RowLimits]:
        """The measured limits for ``key`` (``(ggml type, layout)``, e.g. :data:`F32_PANELS`), or
        None if it was not measured."""
        return dict(self.row_limits).get(TuningKey(*key))

    def to_json(self) -> str:
        return json.dumps(
            {
                "decode_prefetch_to_l2": self.decode_prefetch_to_l2,
                "row_limits": {f"{key.ggml_type}/{key.layout}": asdict(limits) for key, limits in self.row_limits},
            }
        )


class PackedForms(Protocol):
    """A weight's packed form as :mod:`pagellm.layers.linear` keeps it."""

    panels: torch.Tensor  # float32 panels, from ops.pack_weight or ops.pack_weight_gate_up


@dataclass(frozen=True)
class Probe:
    weight: torch.Tensor  # [n, k] as loaded, for BLAS
    panels: torch.Tensor


def make_probe(weight: torch.Tensor, packed: PackedForms) -> Probe:
    """The first output rows of ``weight`` and its panels, as their own smaller weight."""
    cols_per_panel = packed.panels.shape[2]
    n = min(weight.shape[0], PROBE_MAX_OUT_FEATURES)
    panels = n // cols_per_panel if n < weight.shape[0] else packed.panels.shape[0]
    n = min(n, panels * cols_per_panel)
    return Probe(weight[:n], packed.panels[:panels])


def _time(fn: Callable[[], None], flush: torch.Tensor) -> float:
    """Best of a few calls of ``fn``, each with the probe's weights evicted from the caches first:
    in a model step every layer's weights come from memory, and a probe that stayed in the
    last-level cache would time something else."""
    fn()  # warm: first touch of buffers, thread pool wake-up
    best = float("inf")
    for _ in range(REPEATS):
        flush.sum()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def time_path(probes: Sequence[Probe], rows: int, path: str, flush: torch.Tensor) -> float:
    """Seconds for ``rows`` rows through every probe by ``path``: "blas" or "panels"."""
    inputs = [torch.randn(rows, p.weight.shape[1]) for p in probes]
    outs = [torch.empty(rows, p.weight.shape[0]) for p in probes]

    def run() -> None:
        for p, x, out in zip(probes, inputs, outs):
            if path == "blas":
                F.linear(x, p.weight)
            else:
                ops.linear_packed(out, x, p.panels, None)

    return _time(run, flush)


def _last_win(probe_rows: Sequence[int], wins: Callable[[int], bool]) -> int:
    """The last of ``probe_rows`` before the first where ``wins`` fails (0 if it fails first)."""
    limit = 0
    for rows in probe_rows:
        if not wins(rows):
            break
        limit = rows
    return limit


def measure_row_limits(probes: Sequence[Probe]) -> RowLimits:
    """Times the panels against BLAS on ``probes`` and returns where the panels stop winning."""
    flush = torch.ones(FLUSH_BYTES // 4)

    def faster(rows: int, path: str, than: str) -> bool:
        t_path = time_path(probes, rows, path, flush)
        t_than = time_path(probes, rows, than, flush)
        return t_path * MIN_GAIN < t_than

    packed_max_rows = _last_win(BLAS_PROBE_ROWS, lambda rows: faster(rows, "panels", "blas"))
    if packed_max_rows == BLAS_PROBE_ROWS[-1]:
        # Still ahead at the largest probe, where the kernel already runs at the arithmetic
        # peak (BLAS can only catch up, not overtake), so no upper limit.
        packed_max_rows = UNLIMITED_ROWS
    elif packed_max_rows == 0:
        # Behind BLAS even at the first probe: the packed kernel keeps the rows below it, where
        # BLAS was never timed and the kernel was ahead on every machine measured.
        packed_max_rows = BLAS_PROBE_ROWS[0]
    return RowLimits(packed_max_rows)


def collect_probes(weights: Sequence[tuple[torch.Tensor, PackedForms]]) -> list[Probe]:
    """Probes from the first ``(weight, packed)`` pairs in model order, up to
    :data:`PROBE_MAX_WEIGHTS` weights in all."""
    probes: list[Probe] = []
    num_weights = 0
    for weight, packed in weights:
        if num_weights >= PROBE_MAX_WEIGHTS:
            break
        probe = make_probe(weight, packed)
        probes.append(probe)
        num_weights += probe.weight.numel()
    return probes


def tune_row_limits(weights: Sequence[tuple[torch.Tensor, PackedForms]]) -> tuple[tuple[TuningKey, RowLimits], ...]:
    """Measures the float32 panels' row limit on ``(weight, packed)`` pairs; nothing without any."""
    probes = collect_probes(weights)
    if not probes:
        return ()
    start = time.perf_counter()
    measured = measure_row_limits(probes)
    rows = measured.packed_max_rows
    logger.info(
        "packed matmul, float32 panels: %s (measured in %.2f s)",
        "every batch size" if rows >= UNLIMITED_ROWS else f"up to {rows} rows, BLAS beyond",
        time.perf_counter() - start,
    )
    return ((F32_PANELS, measured),)


def _decode_probe(shape: DecodeShape) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """(query, cache copies, block table, seq_lens, query_start_loc) for a decode step of
    ``shape`` whose sequences own shuffled, scattered blocks, as in a running server's cache."""
    gen = torch.Generator().manual_seed(0)
    token_bytes = 2 * shape.num_kv_heads * shape.head_dim * shape.probe_dtype.itemsize
    context = DECODE_PROBE_CACHE_BYTES // (DECODE_PROBE_SEQS * token_bytes)
    context = min(max(context, DECODE_PROBE_MIN_CONTEXT), DECODE_PROBE_MAX_CONTEXT)
    seqs = max(1, min(DECODE_PROBE_SEQS, DECODE_PROBE_MAX_CACHE_BYTES // (context * token_bytes)))
    blocks_per_seq = -(-context // DECODE_PROBE_BLOCK)
    num_blocks = seqs * blocks_per_seq
    block_ids = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    block_table = block_ids.view(seqs, blocks_per_seq).contiguous()
    cache_shape = (2, num_blocks, DECODE_PROBE_BLOCK, shape.num_kv_heads, shape.head_dim)
    cache = torch.randn(cache_shape, generator=gen).to(shape.probe_dtype)
    copies = max(2, -(-DECODE_PROBE_TOTAL_BYTES // (cache.numel() * cache.element_size())))
    caches = [cache] + [cache.clone() for _ in range(copies - 1)]
    query = torch.randn(seqs, shape.num_heads, shape.head_dim, generator=gen)
    seq_lens = torch.full((seqs,), context, dtype=torch.int32)
    query_start_loc = torch.arange(seqs + 1, dtype=torch.int32)
    return query, caches, block_table, seq_lens, query_start_loc


def measure_decode_prefetch(shape: DecodeShape = SMOLLM2_DECODE_SHAPE) -> bool:
    """Whether decode attention of ``shape`` from memory runs faster prefetching into L2 only."""
    start = time.perf_counter()
    query, caches, block_table, seq_lens, query_start_loc = _decode_probe(shape)
    out = torch.empty_like(query)
    scale = shape.head_dim**-0.5

    def seconds(to_l2: bool) -> float:
        begin = time.perf_counter()
        for cache in caches:
            ops.paged_attention(out, query, cache, block_table, seq_lens, query_start_loc, scale, to_l2)
        return time.perf_counter() - begin

    best = {False: float("inf"), True: float("inf")}
    seconds(False)  # warm-up
    for _ in range(DECODE_PROBE_REPEATS):
        for to_l2 in (False, True):
            best[to_l2] = min(best[to_l2], seconds(to_l2))
    to_l2 = best[True] * DECODE_MIN_GAIN < best[False]
    logger.info(
        "decode attention (%s) prefetches into %s (from memory: L1 %.1f ms, L2 %.1f ms; measured in %.2f s)",
        shape.key,
        "L2" if to_l2 else "L1",
        best[False] * 1e3,
        best[True] * 1e3,
        time.perf_counter() - start,
    )
    return to_l2


def decode_prefetch_to_l2(shape: DecodeShape = SMOLLM2_DECODE_SHAPE) -> bool:
    """:func:`measure_decode_prefetch`'s answer for this machine and ``shape``: as an earlier start
    measured it for the loaded kernel build, else measured now and kept for the next start. A shape
    the C++ kernel does not run (its head size) has nothing to choose: False, unmeasured."""
    if shape.head_dim not in ops.paged_attention_head_dims() or shape.num_heads % shape.num_kv_heads:
        return False
    folder = build.loaded_build_dir()
    path = None if folder is None else folder / DECODE_PREFETCH_FILE
    kept: dict[str, bool] = {}
    if path is not None:
        try:
            read = json.loads(path.read_text())
            kept = {k: v for k, v in read.items() if isinstance(v, bool)} if isinstance(read, dict) else {}
        except (OSError, ValueError):
            kept = {}
    to_l2 = kept.get(shape.key)
    if to_l2 is not None and not envs.retune():
        level = "L2" if to_l2 else "L1"
        logger.info("decode attention (%s) prefetches into %s (as measured at an earlier start: %s)", shape.key, level, path)
        return to_l2
    to_l2 = measure_decode_prefetch(shape)
    if path is not None:
        try:  # written whole and renamed: a concurrent start reads the old file or the new one
            partial = path.with_suffix(f".{os.getpid()}.tmp")
            partial.write_text(json.dumps({**kept, shape.key: to_l2}))
            os.replace(partial, path)
        except OSError as exc:
            logger.debug("could not keep the decode prefetch level: %s", exc)
    return to_l2


def measure_cpu_tuning(
    device: torch.device | str,
    packed_weights: Sequence[tuple[torch.Tensor, PackedForms]] = (),
    decode_shape: Optional[DecodeShape] = None,
) -> CpuTuning:
    """Measures this machine for a model on ``device``: the decode prefetch level for its
    attention (``decode_shape``; None for a backend other than the C++ one) and the float32
    panels' row limit on ``packed_weights`` (``(weight, packed)`` pairs in model order,
    ``packed.panels`` float32 panels).
    Off the CPU, or without the kernels, nothing is measured: :meth:`CpuTuning.untuned`."""
    if torch.device(device).type != "cpu" or not ops.available():
        return CpuTuning.untuned()
    return CpuTuning(
        decode_prefetch_to_l2=decode_prefetch_to_l2(decode_shape) if decode_shape is not None else False,
        row_limits=tune_row_limits(packed_weights),
    )


@dataclass(frozen=True)
class _Packed:
    panels: torch.Tensor


# (in, out) of SmolLM2-135M's fused projections, and the rows of its vocabulary head that a probe
# keeps: the default model's shapes, for the command line below.
SMOLLM2_LAYER_SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))
SMOLLM2_HEAD_SHAPE = (576, PROBE_MAX_OUT_FEATURES)


def smollm2_like_weights(num_layers: int = 2) -> list[tuple[torch.Tensor, _Packed]]:
    """Random float32 weights of SmolLM2-135M's shapes (head, then layers), in model order, with
    their panels."""
    gen = torch.Generator().manual_seed(0)
    shapes = [SMOLLM2_HEAD_SHAPE] + [shape for _ in range(num_layers) for shape in SMOLLM2_LAYER_SHAPES]
    weights = [torch.randn(n, k, generator=gen) * k**-0.5 for k, n in shapes]
    return [(w, _Packed(ops.pack_weight(w))) for w in weights]


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description="Print, as JSON, the CpuTuning this machine measures for weights of SmolLM2-135M's shapes."
    )
    parser.parse_args(argv)
    if not ops.available():
        print(f"the C++ kernels are unavailable: {ops.load_error()}")
        return 1
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    weights = smollm2_like_weights()
    print(CpuTuning(decode_prefetch_to_l2=measure_decode_prefetch(), row_limits=tune_row_limits(weights)).to_json())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
