"""What a loaded model reports as its weights' resident bytes: every layer's stored forms and its
parameters, a table a tied head shares with the embedding counted once (whatever form it is in)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_utils import make_random_hf_model
from transformers import LlamaConfig

from pagellm.attention.torch_ref import TorchReferenceBackend
from pagellm.config import EXACT_LINEAR, LinearPrecision
from pagellm.kernels import ops
from pagellm.models.decoder import distinct_bytes
from pagellm.models.loader import default_model_path, load_hf_config, load_model

BF16 = LinearPrecision(kind="bfloat16", fallback="bfloat16")
INT8 = LinearPrecision(kind="int8", fallback="bfloat16")


def test_distinct_bytes_counts_shared_memory_once() -> None:
    storage = torch.zeros(1000, dtype=torch.uint8)
    a, b = storage[:400], storage[600:]  # two views of one storage: each its own bytes
    assert distinct_bytes([a, b]) == 800
    assert distinct_bytes([a, b, a, storage[200:300]]) == 800  # again, or inside one: nothing more
    assert distinct_bytes([a, storage[300:700]]) == 700  # overlapping: their union
    assert distinct_bytes([torch.zeros(3), torch.zeros(0), torch.zeros(5, dtype=torch.bfloat16)]) == 22


def summed(model: torch.nn.Module, with_embedding: bool) -> int:
    """Every linear form's bytes and the parameters', and the embedding's unless its head shares it."""
    linear = sum(layer.method.nbytes for _, layer in model.linear_layers())
    params = sum(p.nbytes for p in model.parameters())
    return linear + params + (model.model.embed_tokens.nbytes if with_embedding else 0)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("case", ["float32-exact", "bfloat16-panels"])
def test_a_tied_heads_table_is_counted_once(tmp_path: Path, tied: bool, case: str) -> None:
    dtype, precision = (torch.float32, EXACT_LINEAR) if case == "float32-exact" else (torch.bfloat16, BF16)
    if precision is BF16 and not ops.bf16_matmul_available():
        pytest.skip("no bf16 dot products in this build")
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    make_random_hf_model(config).to(dtype).save_pretrained(tmp_path)
    model = load_model(str(tmp_path), load_hf_config(str(tmp_path)), torch.float32, torch.device("cpu"), TorchReferenceBackend(), precision)
    embed = model.model.embed_tokens
    if tied:  # the head holds the table itself: dense rows, or bfloat16 panels the embedding reads
        assert embed.dense is model.lm_head.method.resident_tensors()[0] or embed.head_panels is not None
    assert model.weight_bytes() == summed(model, with_embedding=not tied)


@pytest.mark.skipif(not ops.int8_matmul_available(), reason="no int8 dot products in this build")
def test_int8_panels_shared_by_the_embedding_and_its_tied_head_count_once() -> None:
    path = default_model_path()
    model = load_model(path, load_hf_config(path), torch.float32, torch.device("cpu"), TorchReferenceBackend(), INT8)
    assert model.model.embed_tokens.packed is model.lm_head.method
    assert model.weight_bytes() == summed(model, with_embedding=False)
