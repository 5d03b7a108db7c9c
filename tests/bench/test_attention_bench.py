"""The attention micro-benchmark runs, checks agreement and writes its JSON."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagellm.attention.synthetic import make_batch
from pagellm.bench import attention_bench
from pagellm.kernels.build import load_kernels


def test_bench_writes_result(tmp_path: Path, capsys) -> None:
    out = tmp_path / "attn.json"
    code = attention_bench.main(
        ["--cases", "decode_short", "--backends", "torch_sdpa,torch_ref", "--min-seconds", "0", "--save-result", str(out)]
    )
    assert code == 0
    result = json.loads(out.read_text())
    assert result["all_agree"] is True
    rows = {row["backend"]: row for row in result["rows"]}
    assert set(rows) == {"torch_sdpa", "torch_ref"}
    assert rows["torch_ref"]["speedup_vs_ref"] == 1.0
    assert all(0 < row["best_ms"] <= row["ms_per_call"] and row["max_abs_diff"] < 1e-4 for row in rows.values())
    assert "decode_short" in capsys.readouterr().out


def test_flop_and_byte_counts() -> None:
    # One 2-token prefill from scratch: query 0 sees 1 key, query 1 sees 2.
    assert attention_bench.attention_flops([(2, 2)]) == 4.0 * 3 * attention_bench.NUM_HEADS * attention_bench.HEAD_DIM
    assert attention_bench.kv_bytes([(1, 10)]) == 10 * 2 * attention_bench.NUM_KV_HEADS * attention_bench.HEAD_DIM * 4


def test_shared_prefix_case_over_several_layers(tmp_path: Path) -> None:
    out = tmp_path / "attn.json"
    backends = "torch_sdpa,torch_ref" + (",cpu_paged" if load_kernels() else "")
    code = attention_bench.main(["--cases", "decode_prefix", "--backends", backends, "--layers", "2", "--min-seconds", "0",
                                 "--max-repeats", "3", "--save-result", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["layers"] == 2 and result["all_agree"] is True


def test_share_prefixes_points_tables_at_the_same_blocks() -> None:
    batch = make_batch([(1, 64)] * 6, 9, 3, 64, attention_bench.BLOCK_SIZE, seed=0)
    before = batch.metadata.block_table.clone()
    attention_bench.share_prefixes(batch, num_prefixes=2, prefix_tokens=32)
    table = batch.metadata.block_table
    prefixes = {tuple(row[:2].tolist()) for row in table}
    assert len(prefixes) == 2  # two prefixes, three sequences each
    assert sorted(sum(tuple(row[:2].tolist()) == p for row in table) for p in prefixes) == [3, 3]
    assert torch.equal(table[:, 2:], before[:, 2:])  # past the prefix every sequence keeps its own blocks


def test_other_head_shape(tmp_path: Path) -> None:
    # Gemma 4's full layers: counts and the JSON follow --heads.
    out = tmp_path / "attn.json"
    code = attention_bench.main(
        ["--cases", "decode_short", "--backends", "torch_sdpa", "--heads", "8,2,512", "--min-seconds", "0", "--save-result", str(out)]
    )
    assert code == 0
    result = json.loads(out.read_text())
    assert result["shapes"] == {"num_heads": 8, "num_kv_heads": 2, "head_dim": 512, "block_size": attention_bench.BLOCK_SIZE}
    heads = attention_bench.parse_heads("8,2,512")
    assert attention_bench.kv_bytes([(1, 10)], heads=heads) == 10 * 2 * 2 * 512 * 4
    assert attention_bench.attention_flops([(2, 2)], heads=heads) == 4.0 * 3 * 8 * 512


def test_bad_heads_are_refused() -> None:
    for text in ("8,2", "8,3,64", "8,0,64", "a,b,c"):
        with pytest.raises(ValueError, match="--heads"):
            attention_bench.parse_heads(text)
