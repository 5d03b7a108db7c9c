"""Where the packed small-batch matmul stops paying, measured on the machine at load time.

A linear layer on the CPU has three ways to run (pagellm.models.layers): BLAS on the weight as
loaded, the packed float32 panels, and, for a GGUF model's projections, the 4- or 8-bit block
panels that the kernel expands on the fly. Which is fastest at a given number of rows depends on
the core more than on the instruction set: with AVX-512 on an Intel Xeon the blocks win up to 32
rows and BLAS from 256 rows, while on an AMD Zen 4, whose AVX-512 runs on 256-bit units, the
float32 panels beat the blocks from 8 rows and beat BLAS even at 1,024 rows (1.12x; `python -m
pagellm.bench.gemm_bench` on each). A fixed table per instruction set would be wrong on one of
them, so the crossovers are measured once per process and weight format on slices of the model's
own weights: a few hundred milliseconds, well inside the start-up budget.

The choice never changes results between blocks and panels (bit-identical by construction);
between BLAS and the panels it changes only the order of float32 sums.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch.nn import functional as F

from pagellm.models.layers import PackedWeight

logger = logging.getLogger(__name__)

# Row counts probed for blocks against float32 panels, and for the panels against BLAS. A limit
# is the last probe the faster path wins before it first loses, so one noisy loss only makes the
# limit more conservative.
BLOCK_PROBE_ROWS = (1, 4, 8, 16, 24, 32, 48, 64)
BLAS_PROBE_ROWS = (64, 256, 1024)
# Output rows kept from each probed weight, and weights probed per format: about 3.5M weights,
# one layer of a small model, so a 1,024-row product takes tens of milliseconds.
PROBE_MAX_OUT_FEATURES = 4096
PROBE_MAX_WEIGHTS = 3_500_000
# A path must be this much faster to take over from the default: ties go to the safer choice.
MIN_GAIN = 1.02
REPEATS = 2
# Read between timed calls to push the probe out of the caches (twice the 32 MiB last-level
# cache of the machines measured).
FLUSH_BYTES = 64 * 2**20
UNLIMITED_ROWS = 1 << 30


@dataclass(frozen=True)
class RowLimits:
    """Up to ``blocks_max_rows`` rows the block panels are used, up to ``packed_max_rows`` the
    packed kernel (blocks or float32 panels), and BLAS beyond."""

    blocks_max_rows: int
    packed_max_rows: int


@dataclass(frozen=True)
class Probe:
    weight: torch.Tensor  # [n, k] as loaded, for BLAS
    panels: torch.Tensor
    blocks: Optional[torch.Tensor]


def weight_format(packed: PackedWeight) -> str:
    """A name for the packed form: ``"float32"`` for panels only, else the block size in bytes
    (4- and 8-bit blocks differ in size)."""
    if packed.blocks is None:
        return "float32"
    return f"{packed.blocks.shape[2]}-byte block"


def make_probe(weight: torch.Tensor, packed: PackedWeight) -> Probe:
    """The first output rows of ``weight`` and its packed forms, as their own smaller weight."""
    cols_per_panel = packed.panels.shape[2]
    n = min(weight.shape[0], PROBE_MAX_OUT_FEATURES)
    panels = n // cols_per_panel if n < weight.shape[0] else packed.panels.shape[0]
    n = min(n, panels * cols_per_panel)
    blocks = packed.blocks[:panels] if packed.blocks is not None else None
    return Probe(weight[:n], packed.panels[:panels], blocks)


def _time(fn: Callable[[], None], flush: torch.Tensor) -> float:
    """Best of a few calls of ``fn``, each with the probe's weights evicted from the caches first:
    in a model step every layer's weights come from memory, which is where the blocks' 4x smaller
    size pays; a probe that stayed in the last-level cache would hide that."""
    fn()  # warm: first touch of buffers, thread pool wake-up
    best = float("inf")
    for _ in range(REPEATS):
        flush.sum()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def time_path(probes: Sequence[Probe], rows: int, path: str, flush: torch.Tensor) -> float:
    """Seconds for ``rows`` rows through every probe by ``path``: "blas", "panels" or "blocks"."""
    inputs = [torch.randn(rows, p.weight.shape[1]) for p in probes]
    outs = [torch.empty(rows, p.weight.shape[0]) for p in probes]

    def run() -> None:
        for p, x, out in zip(probes, inputs, outs):
            if path == "blas":
                F.linear(x, p.weight)
            else:
                torch.ops.pagellm_gemm.linear_packed(out, x, p.blocks if path == "blocks" else p.panels, None)

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
    """Times the three paths on ``probes`` (one weight format) and returns where each stops winning."""

    flush = torch.ones(FLUSH_BYTES // 4)

    def faster(rows: int, path: str, than: str) -> bool:
        t_path = time_path(probes, rows, path, flush)
        t_than = time_path(probes, rows, than, flush)
        return t_path * MIN_GAIN < t_than

    blocks_max_rows = 0
    if probes[0].blocks is not None:
        blocks_max_rows = _last_win(BLOCK_PROBE_ROWS, lambda rows: faster(rows, "blocks", "panels"))
    packed_max_rows = _last_win(BLAS_PROBE_ROWS, lambda rows: faster(rows, "panels", "blas"))
    if packed_max_rows == BLAS_PROBE_ROWS[-1]:
        # Still ahead at the largest probe, where the kernel already runs at the arithmetic
        # peak (BLAS can only catch up, not overtake), so no upper limit.
        packed_max_rows = UNLIMITED_ROWS
    elif packed_max_rows == 0:
        # Behind BLAS even at the first probe: the packed kernel keeps the rows below it, where
        # BLAS was never timed and gemm_bench found the kernel ahead on every machine measured.
        packed_max_rows = BLAS_PROBE_ROWS[0]
    return RowLimits(min(blocks_max_rows, packed_max_rows), packed_max_rows)


_measured: dict[tuple, RowLimits] = {}


def tune_row_limits(weights: Sequence[tuple[torch.Tensor, PackedWeight]]) -> dict[str, RowLimits]:
    """Measures the row limits for each weight format among ``weights`` (``(weight, packed)``
    pairs, in model order) and sets them on every packed weight. Measured once per process per
    format and probe shapes; returns the limits by format."""
    by_format: dict[str, list[tuple[torch.Tensor, PackedWeight]]] = {}
    for weight, packed in weights:
        by_format.setdefault(weight_format(packed), []).append((weight, packed))
    limits: dict[str, RowLimits] = {}
    for fmt, members in by_format.items():
        probes: list[Probe] = []
        num_weights = 0
        for weight, packed in members:
            if num_weights >= PROBE_MAX_WEIGHTS:
                break
            probe = make_probe(weight, packed)
            probes.append(probe)
            num_weights += probe.weight.numel()
        key = (torch.get_num_threads(), fmt, tuple(tuple(p.weight.shape) for p in probes))
        if key not in _measured:
            start = time.perf_counter()
            _measured[key] = measure_row_limits(probes)
            logger.info(
                "packed matmul, %s weights: block panels up to %d rows, packed kernel up to %s rows (measured in %.2f s)",
                fmt,
                _measured[key].blocks_max_rows,
                "any number of" if _measured[key].packed_max_rows >= UNLIMITED_ROWS else _measured[key].packed_max_rows,
                time.perf_counter() - start,
            )
        limits[fmt] = _measured[key]
        for _, packed in members:
            packed.blocks_max_rows = limits[fmt].blocks_max_rows
            packed.packed_max_rows = limits[fmt].packed_max_rows
    return limits
