"""The start-up measurements (CpuTuning): where the float32 panels and BLAS take over, and which
prefetch level decode attention uses."""
from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

from pagellm.kernels import ops, tuning
from pagellm.kernels.tuning import (
    F32_PANELS,
    UNLIMITED_ROWS,
    CpuTuning,
    DecodeShape,
    RowLimits,
    TuningKey,
    collect_probes,
    make_probe,
    measure_cpu_tuning,
    measure_row_limits,
    tune_row_limits,
)

SHAPE = tuning.SMOLLM2_DECODE_SHAPE

pytestmark = pytest.mark.skipif(not ops.available(), reason="C++ kernels unavailable")


@dataclass(frozen=True)
class Panels:
    panels: torch.Tensor


def panels_of(weight: torch.Tensor) -> Panels:
    return Panels(ops.pack_weight(weight))


def fake_costs(monkeypatch, cost) -> list[tuple[int, str]]:
    """Replaces the timing with ``cost(rows, path)``; returns the log of what was timed."""
    timed: list[tuple[int, str]] = []

    def time_path(probes, rows: int, path: str, flush) -> float:
        timed.append((rows, path))
        return cost(rows, path)

    monkeypatch.setattr(tuning, "time_path", time_path)
    monkeypatch.setattr(tuning, "FLUSH_BYTES", 4096)
    return timed


def a_probe() -> tuning.Probe:
    weight = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    return make_probe(weight, panels_of(weight))


def test_limit_is_the_last_probe_won_before_the_first_loss(monkeypatch) -> None:
    # BLAS costs 40 + rows / 3, the panels 10 + rows / 2: the panels are ahead below 180 rows.
    costs = {"panels": lambda r: 10 + r / 2, "blas": lambda r: 40 + r / 3}
    timed = fake_costs(monkeypatch, lambda rows, path: costs[path](rows))
    assert measure_row_limits([a_probe()]) == RowLimits(packed_max_rows=64)
    assert {path for _, path in timed} == {"panels", "blas"}
    # Stops probing at the first loss.
    assert (256, "panels") in timed and (1024, "panels") not in timed


def test_panels_ahead_at_every_probe_means_no_limit(monkeypatch) -> None:
    fake_costs(monkeypatch, lambda rows, path: {"panels": 2.0, "blas": 3.0}[path] * rows)
    assert measure_row_limits([a_probe()]) == RowLimits(UNLIMITED_ROWS)


def test_losing_at_the_first_probe(monkeypatch) -> None:
    # BLAS is ahead from the first probe: the packed kernel keeps the smaller rows, where BLAS
    # was never timed.
    fake_costs(monkeypatch, lambda rows, path: {"panels": 2.0, "blas": 1.0}[path] * rows)
    assert measure_row_limits([a_probe()]) == RowLimits(tuning.BLAS_PROBE_ROWS[0])


def test_a_tie_keeps_the_default_path(monkeypatch) -> None:
    fake_costs(monkeypatch, lambda rows, path: 1.0)  # within MIN_GAIN
    assert measure_row_limits([a_probe()]) == RowLimits(tuning.BLAS_PROBE_ROWS[0])


def test_probe_is_the_first_output_rows_of_the_weight(monkeypatch) -> None:
    monkeypatch.setattr(tuning, "PROBE_MAX_OUT_FEATURES", 100)
    weight = torch.randn(160, 64, generator=torch.Generator().manual_seed(1))
    packed = panels_of(weight)
    probe = make_probe(weight, packed)
    cols = packed.panels.shape[2]
    n = probe.weight.shape[0]
    assert n == 100 // cols * cols and probe.panels.shape[0] == n // cols
    x = torch.randn(3, 64)
    out = torch.empty(3, n)
    ops.linear_packed(out, x, probe.panels, None)
    torch.testing.assert_close(out, x @ weight[:n].T, rtol=1e-5, atol=1e-5)


def test_probes_are_the_first_weights_up_to_the_budget(monkeypatch) -> None:
    monkeypatch.setattr(tuning, "PROBE_MAX_WEIGHTS", 96 * 64 + 1)
    weights = [torch.randn(96, 64) for _ in range(3)]
    probes = collect_probes([(w, panels_of(w)) for w in weights])
    assert [p.weight.data_ptr() for p in probes] == [w.data_ptr() for w in weights[:2]]


def test_limits_are_keyed_by_ggml_type_and_layout() -> None:
    assert F32_PANELS == ("F32", "panels") and F32_PANELS.ggml_type == "F32" and F32_PANELS.layout == "panels"
    cpu_tuning = CpuTuning(row_limits=((F32_PANELS, RowLimits(16)),))
    assert cpu_tuning.limits_for(F32_PANELS) == cpu_tuning.limits_for(("F32", "panels")) == RowLimits(16)
    assert cpu_tuning.limits_for(TuningKey("Q4_1", "panels")) is None
    assert CpuTuning.untuned().limits_for(F32_PANELS) is None


def test_tune_measures_once_over_every_probe(monkeypatch) -> None:
    weights = [torch.randn(96, 64), torch.randn(40, 64)]
    measured = []
    monkeypatch.setattr(tuning, "measure_row_limits", lambda probes: (measured.append(len(probes)), RowLimits(16))[1])
    cpu_tuning = measure_cpu_tuning("cpu", [(w, panels_of(w)) for w in weights])
    assert measured == [2]
    assert cpu_tuning.row_limits == ((F32_PANELS, RowLimits(16)),)
    assert cpu_tuning.limits_for(("F32", "panels")) == RowLimits(16)


def test_nothing_to_measure_without_weights(monkeypatch) -> None:
    monkeypatch.setattr(tuning, "measure_row_limits", lambda probes: pytest.fail("measured without weights"))
    assert tune_row_limits([]) == ()
    assert measure_cpu_tuning("cpu", []) == CpuTuning.untuned()


def test_real_measurement_gives_a_probed_limit() -> None:
    weight = torch.randn(256, 128, generator=torch.Generator().manual_seed(4))
    ((key, limits),) = tune_row_limits([(weight, panels_of(weight))])
    assert key == F32_PANELS
    assert limits.packed_max_rows in (*tuning.BLAS_PROBE_ROWS, UNLIMITED_ROWS)


def test_nothing_is_measured_off_the_cpu() -> None:
    weight = torch.randn(96, 64)
    assert measure_cpu_tuning("meta", [(weight, panels_of(weight))]) == CpuTuning.untuned()


def test_measure_cpu_tuning_measures_both_and_prints_as_json(monkeypatch) -> None:
    asked: list[DecodeShape] = []
    monkeypatch.setattr(tuning, "decode_prefetch_to_l2", lambda shape: asked.append(shape) or True)
    monkeypatch.setattr(tuning, "measure_row_limits", lambda probes: RowLimits(256))
    weight = torch.randn(96, 64)
    cpu_tuning = measure_cpu_tuning("cpu", [(weight, panels_of(weight))], SHAPE)
    assert asked == [SHAPE]
    assert cpu_tuning == CpuTuning(decode_prefetch_to_l2=True, row_limits=((F32_PANELS, RowLimits(256)),))
    assert json.loads(cpu_tuning.to_json()) == {
        "decode_prefetch_to_l2": True,
        "row_limits": {"F32/panels": {"packed_max_rows": 256}},
    }
    assert not measure_cpu_tuning("cpu", []).decode_prefetch_to_l2


def test_command_line_prints_the_tuning_as_json(monkeypatch, capsys) -> None:
    monkeypatch.setattr(tuning, "measure_decode_prefetch", lambda shape=None: False)
    monkeypatch.setattr(tuning, "measure_row_limits", lambda probes: RowLimits(64))
    assert tuning.main([]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == {"decode_prefetch_to_l2": False, "row_limits": {"F32/panels": {"packed_max_rows": 64}}}


@pytest.mark.parametrize(
    "shape, seqs", [(SHAPE, 32), (DecodeShape(32, 32, 64, torch.bfloat16), 32), (DecodeShape(32, 32, 64, torch.float32), 16)], ids=str
)
def test_decode_prefetch_probe_runs_at_the_models_shape(shape: DecodeShape, seqs: int) -> None:
    query, caches, block_table, seq_lens, _ = tuning._decode_probe(shape)
    assert query.shape == (seqs, shape.num_heads, shape.head_dim)  # fewer where a token's rows are large
    assert caches[0].shape[3:] == (shape.num_kv_heads, shape.head_dim) and caches[0].dtype == shape.probe_dtype
    # Together more than a last-level cache, each copy at most the probe's bound, each sequence
    # within its bounds of context.
    assert sum(c.numel() * c.element_size() for c in caches) >= tuning.DECODE_PROBE_TOTAL_BYTES
    assert caches[0].numel() * caches[0].element_size() <= tuning.DECODE_PROBE_MAX_CACHE_BYTES
    assert tuning.DECODE_PROBE_MIN_CONTEXT <= int(seq_lens[0]) <= tuning.DECODE_PROBE_MAX_CONTEXT
    assert block_table.shape[1] * tuning.DECODE_PROBE_BLOCK >= int(seq_lens[0])
    assert isinstance(tuning.measure_decode_prefetch(shape), bool)


def test_a_16_or_8_bit_cache_is_probed_as_bfloat16() -> None:
    assert DecodeShape(9, 3, 64, torch.float16).probe_dtype == torch.bfloat16
    assert DecodeShape(9, 3, 64, torch.float8_e4m3fn).key == SHAPE.key == "9q/3kv/64d/bfloat16"
    assert DecodeShape(9, 3, 64, torch.float32).key == "9q/3kv/64d/float32"


def test_decode_prefetch_level_is_measured_once_per_kernel_build_and_shape(monkeypatch, tmp_path) -> None:
    measured: list[str] = []

    def measure(shape: DecodeShape) -> bool:
        measured.append(shape.key)
        return len(measured) == 1  # the first measurement says L2, any later one L1

    other = DecodeShape(32, 32, 64, torch.bfloat16)
    monkeypatch.setattr(tuning, "measure_decode_prefetch", measure)
    monkeypatch.setattr(tuning.build, "loaded_build_dir", lambda: tmp_path)
    monkeypatch.delenv("PAGELLM_RETUNE", raising=False)
    # A file of the earlier format (one answer for every shape) is measured over.
    (tmp_path / tuning.DECODE_PREFETCH_FILE).write_text(json.dumps({"decode_prefetch_to_l2": False}))
    assert tuning.decode_prefetch_to_l2(SHAPE) is True
    assert tuning.decode_prefetch_to_l2(SHAPE) is True  # read back, not measured
    assert measured == [SHAPE.key]
    assert tuning.decode_prefetch_to_l2(other) is False  # another shape: measured, kept beside it
    assert tuning.decode_prefetch_to_l2(other) is False
    assert measured == [SHAPE.key, other.key]
    kept = json.loads((tmp_path / tuning.DECODE_PREFETCH_FILE).read_text())
    assert kept[SHAPE.key] is True and kept[other.key] is False
    monkeypatch.setenv("PAGELLM_RETUNE", "1")
    assert tuning.decode_prefetch_to_l2(SHAPE) is False  # measured again, and kept
    assert len(measured) == 3
    assert json.loads((tmp_path / tuning.DECODE_PREFETCH_FILE).read_text())[SHAPE.key] is False
    monkeypatch.delenv("PAGELLM_RETUNE")
    assert tuning.decode_prefetch_to_l2(SHAPE) is False and len(measured) == 3
    (tmp_path / tuning.DECODE_PREFETCH_FILE).write_text("{not json")
    assert tuning.decode_prefetch_to_l2(SHAPE) is False and len(measured) == 4  # a damaged file is measured over
    assert sorted(p.name for p in tmp_path.iterdir()) == [tuning.DECODE_PREFETCH_FILE]  # no partial file left


def test_a_head_size_the_kernel_does_not_run_is_not_measured(monkeypatch) -> None:
    monkeypatch.setattr(tuning, "measure_decode_prefetch", lambda shape: pytest.fail("measured"))
    assert tuning.decode_prefetch_to_l2(DecodeShape(4, 2, 16, torch.bfloat16)) is False


def test_decode_prefetch_level_without_a_build_folder_is_measured_every_time(monkeypatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(tuning, "measure_decode_prefetch", lambda shape: calls.append(1) or False)
    monkeypatch.setattr(tuning.build, "loaded_build_dir", lambda: None)
    assert tuning.decode_prefetch_to_l2(SHAPE) is False and tuning.decode_prefetch_to_l2(SHAPE) is False
    assert len(calls) == 2


def test_loaded_build_dir_holds_the_loaded_library() -> None:
    folder = tuning.build.loaded_build_dir()
    assert folder is not None and (folder / f"{tuning.build.LIB_NAME}.so").exists()
