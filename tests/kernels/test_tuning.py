"""The start-up measurements (CpuTuning): where block panels, float32 panels and BLAS take over,
and which prefetch level decode attention uses."""
from __future__ import annotations

import json

import pytest
import torch

from pagellm.kernels import ops, tuning
from pagellm.kernels.tuning import (
    UNLIMITED_ROWS,
    CpuTuning,
    RowLimits,
    block_quantized,
    make_probe,
    measure_cpu_tuning,
    measure_row_limits,
    tune_row_limits,
)
from pagellm.models.layers import PACKED_MAX_ROWS, linear, pack_weight

pytestmark = pytest.mark.skipif(not ops.available(), reason="C++ kernels unavailable")


def fake_costs(monkeypatch, cost) -> list[tuple[int, str]]:
    """Replaces the timing with ``cost(rows, path)``; returns the log of what was timed."""
    timed: list[tuple[int, str]] = []

    def time_path(probes, rows: int, path: str, flush) -> float:
        timed.append((rows, path))
        return cost(rows, path)

    monkeypatch.setattr(tuning, "time_path", time_path)
    monkeypatch.setattr(tuning, "FLUSH_BYTES", 4096)
    return timed


def q4_probe() -> tuning.Probe:
    weight = block_quantized(64, 64, 4, torch.Generator().manual_seed(0))
    return make_probe(weight, pack_weight(weight))


def test_limits_are_the_last_probe_won_before_the_first_loss(monkeypatch) -> None:
    # Blocks cost 2 + rows, panels 10 + rows / 2: blocks ahead up to 15 rows. BLAS 40 + rows / 3,
    # panels ahead of it below 180 rows.
    costs = {"blocks": lambda r: 2 + r, "panels": lambda r: 10 + r / 2, "blas": lambda r: 40 + r / 3}
    timed = fake_costs(monkeypatch, lambda rows, path: costs[path](rows))
    limits = measure_row_limits([q4_probe()])
    assert limits == RowLimits(blocks_max_rows=8, packed_max_rows=64)
    # Stops probing at the first loss: 16 rows for the blocks, 256 for the panels.
    assert (24, "blocks") not in timed and (16, "blocks") in timed
    assert (1024, "panels") not in timed and (256, "panels") in timed


def test_panels_ahead_at_every_probe_means_no_limit(monkeypatch) -> None:
    fake_costs(monkeypatch, lambda rows, path: {"blocks": 1.0, "panels": 2.0, "blas": 3.0}[path] * rows)
    limits = measure_row_limits([q4_probe()])
    assert limits == RowLimits(blocks_max_rows=tuning.BLOCK_PROBE_ROWS[-1], packed_max_rows=UNLIMITED_ROWS)


def test_losing_at_the_first_probe(monkeypatch) -> None:
    # Blocks never pay; BLAS is ahead from the first probe: the packed kernel keeps the smaller
    # rows, where BLAS was never timed.
    fake_costs(monkeypatch, lambda rows, path: {"blocks": 3.0, "panels": 2.0, "blas": 1.0}[path] * rows)
    assert measure_row_limits([q4_probe()]) == RowLimits(0, tuning.BLAS_PROBE_ROWS[0])


def test_a_tie_keeps_the_default_path(monkeypatch) -> None:
    fake_costs(monkeypatch, lambda rows, path: 1.0)  # within MIN_GAIN
    assert measure_row_limits([q4_probe()]) == RowLimits(0, tuning.BLAS_PROBE_ROWS[0])


def test_probe_is_the_first_output_rows_of_the_weight(monkeypatch) -> None:
    monkeypatch.setattr(tuning, "PROBE_MAX_OUT_FEATURES", 100)
    weight = block_quantized(160, 64, 8, torch.Generator().manual_seed(1))
    packed = pack_weight(weight)
    probe = make_probe(weight, packed)
    cols = packed.panels.shape[2]
    n = probe.weight.shape[0]
    assert n == 100 // cols * cols and probe.panels.shape[0] == n // cols and probe.blocks.shape[0] == n // cols
    x = torch.randn(3, 64)
    for panels in (probe.panels, probe.blocks):
        out = torch.empty(3, n)
        ops.linear_packed(out, x, panels, None)
        torch.testing.assert_close(out, x @ weight[:n].T, rtol=1e-5, atol=1e-5)


def test_tune_sets_the_measured_limits_per_format_and_linear_follows_them(monkeypatch) -> None:
    q4 = block_quantized(96, 64, 4, torch.Generator().manual_seed(2))
    q8 = block_quantized(96, 64, 8, torch.Generator().manual_seed(3))
    plain = torch.randn(96, 64)
    pairs = [(w, pack_weight(w)) for w in (q4, q8, plain)]
    limits_by_probe_width = {}

    def measure(probes):
        fmt = "plain" if probes[0].blocks is None else probes[0].blocks.shape[2]
        limits_by_probe_width[fmt] = RowLimits(0 if fmt == "plain" else 4, 16 if fmt == "plain" else 64)
        return limits_by_probe_width[fmt]

    monkeypatch.setattr(tuning, "measure_row_limits", measure)
    cpu_tuning = measure_cpu_tuning("cpu", pairs, attention=False)
    assert len(cpu_tuning.row_limits) == 3 and len(limits_by_probe_width) == 3
    assert cpu_tuning.limits_for("float32") == RowLimits(0, 16)
    for _, packed in pairs:
        packed.use_cpu_tuning(cpu_tuning)
    assert [(p.blocks_max_rows, p.packed_max_rows) for _, p in pairs] == [(4, 64), (4, 64), (0, 16)]
    used = []
    real = ops.linear_packed
    monkeypatch.setattr(ops, "linear_packed", lambda *a: (used.append((a[1].shape[0], a[2].dtype)), real(*a)))
    for rows in (4, 5, 64, 65):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(linear(x, q4, None, pairs[0][1]), x @ q4.T, rtol=1e-5, atol=1e-5)
    assert used == [(4, torch.uint8), (5, torch.float32), (64, torch.float32)]  # 65 rows: BLAS


def test_real_measurement_gives_consistent_limits() -> None:
    # On the machine itself: whatever it measures, blocks never extend past the packed kernel.
    weight = block_quantized(256, 128, 4, torch.Generator().manual_seed(4))
    ((fmt, limits),) = tune_row_limits([(weight, pack_weight(weight))])
    assert fmt == tuning.weight_format(pack_weight(weight).blocks)
    assert 0 <= limits.blocks_max_rows <= limits.packed_max_rows
    assert limits.packed_max_rows in (*tuning.BLAS_PROBE_ROWS, UNLIMITED_ROWS)


def test_untuned_keeps_the_kernel_defaults() -> None:
    weight = block_quantized(96, 64, 4, torch.Generator().manual_seed(5))
    packed = pack_weight(weight)
    packed.use_cpu_tuning(CpuTuning.untuned())
    assert (packed.blocks_max_rows, packed.packed_max_rows) == (ops.blocks_max_rows(packed.blocks), PACKED_MAX_ROWS)
    assert measure_cpu_tuning("meta", [(weight, packed)]) == CpuTuning.untuned()  # nothing measured off the CPU


def test_measure_cpu_tuning_measures_both_and_prints_as_json(monkeypatch) -> None:
    monkeypatch.setattr(tuning, "measure_decode_prefetch", lambda: True)
    monkeypatch.setattr(tuning, "measure_row_limits", lambda probes: RowLimits(8, 256))
    weight = block_quantized(96, 64, 8, torch.Generator().manual_seed(6))
    cpu_tuning = measure_cpu_tuning("cpu", [(weight, pack_weight(weight))])
    fmt = tuning.weight_format(pack_weight(weight).blocks)
    assert cpu_tuning == CpuTuning(decode_prefetch_to_l2=True, row_limits=((fmt, RowLimits(8, 256)),))
    assert json.loads(cpu_tuning.to_json()) == {
        "decode_prefetch_to_l2": True,
        "row_limits": {fmt: {"blocks_max_rows": 8, "packed_max_rows": 256}},
    }
    assert not measure_cpu_tuning("cpu", [], attention=False).decode_prefetch_to_l2


def test_decode_prefetch_probe_runs() -> None:
    assert isinstance(tuning.measure_decode_prefetch(), bool)
