"""The vocabulary embedding: a bfloat16 table read from its tied head's bfloat16 panels."""
from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from pagellm.kernels import ops
from pagellm.layers.embedding import VocabParallelEmbedding

pytestmark = pytest.mark.skipif(not ops.bf16_matmul_available(), reason="no bf16 dot products in this build")

VOCAB, DIM = 101, 96  # a last panel of 5 rows, and a width of 48 pairs


def table(dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(VOCAB, DIM, generator=torch.Generator().manual_seed(0)).to(dtype)


def embedding(weights: torch.Tensor) -> VocabParallelEmbedding:
    embed = VocabParallelEmbedding(VOCAB, DIM)
    embed.load(weights)
    embed.process_weights_after_loading("cpu", torch.float32)
    return embed


def test_rows_come_from_the_heads_panels_with_the_tables_values() -> None:
    weights = table()
    embed = embedding(weights.clone())
    panels = ops.pack_weight_bf16(embed.source_rows(VOCAB), False)
    assert embed.share_head_panels(panels)
    assert embed.dense is None and embed.head_panels is panels and embed.nbytes == panels.nbytes
    ids = torch.tensor([[0, 31, 32, 100], [64, 5, 99, 33]])
    got = embed(ids)
    assert got.dtype == torch.float32 and got.shape == (2, 4, DIM)
    assert torch.equal(got, F.embedding(ids, weights).float())
    assert torch.equal(embed.weight, weights.float())


def test_a_float32_table_keeps_its_own_values() -> None:
    embed = embedding(table(torch.float32))  # its head's panels hold it rounded to bfloat16
    panels = ops.pack_weight_bf16(embed.source_rows(VOCAB), False)
    assert not embed.share_head_panels(panels)
    assert embed.dense is not None and embed.head_panels is None
