"""The recurrent-state kernels' micro-benchmarks (recurrent_bench, mamba_bench): their state type and
layer rotation reach the kernels, and the results carry them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagellm.bench import mamba_bench, recurrent_bench
from pagellm.kernels import ops

needs_cpp = pytest.mark.skipif(not ops.available(), reason="C++ kernels unavailable")


@needs_cpp
def test_recurrent_bench_runs_bfloat16_states_over_layers(tmp_path: Path, capsys) -> None:
    argv = ["--cases", "decode_1", "--reps", "2", "--state-dtype", "bfloat16", "--layers", "3", "--save-result",
            "--result-dir", str(tmp_path), "--result-filename", "r.json"]
    assert recurrent_bench.main(argv) == 0
    assert "bfloat16 state, 3 layer(s)" in capsys.readouterr().out
    result = json.loads((tmp_path / "r.json").read_text())
    assert (result["state_dtype"], result["layers"]) == ("bfloat16", 3)
    assert [(r["case"], r["op"]) for r in result["rows"]] == [("decode_1", "causal_conv1d"), ("decode_1", "gated_delta_rule")]
    assert all(r["cpp_ms"] > 0 and r["torch_ms"] > 0 for r in result["rows"])


def test_bench_inputs_take_the_state_type() -> None:
    assert recurrent_bench.make_inputs([1, 1], state_dtype=torch.bfloat16)["gdr"]["state"].dtype == torch.bfloat16
    shape = mamba_bench.SHAPES["granite-4.0-h-micro"]
    state = mamba_bench.make_inputs(shape, [1], state_dtype=torch.bfloat16)["state"]
    assert state.dtype == torch.bfloat16 and tuple(state.shape) == (1, 64, 64, 128)


@needs_cpp
def test_mamba_bench_runs_bfloat16_states_over_layers(tmp_path: Path, capsys) -> None:
    argv = ["--shapes", "granite-4.0-h-micro", "--cases", "decode_16", "--reps", "2", "--state-dtype", "bfloat16", "--layers", "2",
            "--save-result", "--result-dir", str(tmp_path), "--result-filename", "m.json"]
    assert mamba_bench.main(argv) == 0
    assert "bfloat16 state, 2 layer(s)" in capsys.readouterr().out
    result = json.loads((tmp_path / "m.json").read_text())
    assert (result["state_dtype"], result["layers"]) == ("bfloat16", 2)
    assert [(r["shape"], r["case"], r["tokens"]) for r in result["rows"]] == [("granite-4.0-h-micro", "decode_16", 16)]


def test_layers_must_be_positive() -> None:
    for bench in (recurrent_bench, mamba_bench):
        with pytest.raises(SystemExit):
            bench.main(["--layers", "0"])
