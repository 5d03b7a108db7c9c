"""The multi-LoRA micro-benchmark runs its decode and prefill tables and writes its JSON."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagellm.bench import lora_bench
from pagellm.kernels import ops

pytestmark = pytest.mark.skipif(not ops.available(), reason="C++ kernels unavailable")


def test_bench_writes_result(tmp_path: Path, capsys) -> None:
    out = tmp_path / "lora.json"
    code = lora_bench.main(["--shapes", "40x72", "--ranks", "8", "--stream-mib", "1", "--prefill-rows", "4,40", "--prefill-ranks",
                            "16", "--reps", "1", "--save-result", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert [(row["rank"], row["dtype"]) for row in result["decode"]] == [(8, "float32"), (8, "bfloat16")]
    assert all(row["kernel_ms"] > 0 and row["kernel_gb_s"] > 0 and row["num_pools"] >= 2 for row in result["decode"])
    assert [row["segment_rows"] for row in result["prefill"]] == [4, 40, 4, 40]
    assert "GB/s" in capsys.readouterr().out


def test_pools_hold_the_bytes_asked_for() -> None:
    pools = lora_bench.make_pools(64, 96, 8, torch.bfloat16, [1] * 4, stream_bytes=1 << 20)
    pool_bytes = 4 * 8 * (64 + 96) * 2
    assert len(pools.lora_a) == -(-(1 << 20) // pool_bytes)
    assert pools.bytes_per_call() == pool_bytes  # every slot used once
    assert pools.seg_starts.tolist() == [0, 1, 2, 3, 4] and pools.seg_slots.tolist() == [0, 1, 2, 3]


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="IN x OUT"):
        lora_bench._shape_list("576x")
