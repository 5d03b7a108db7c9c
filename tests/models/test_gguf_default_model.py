"""The default SmolLM2 GGUF: our config, weights and logits against transformers' GGUF load."""
from __future__ import annotations

import os
import time

import pytest
import torch
from hf_oracle import hf_gguf_model
from model_utils import PagedDriver
from transformers import AutoConfig, PretrainedConfig

from pagellm.attention.torch_ref import TorchReferenceBackend
from pagellm.config import LinearPrecision
from pagellm.kernels import ops
from pagellm.layers.activation import silu_and_mul
from pagellm.layers.linear_method import GGUFInt8Method
from pagellm.models.gguf_loader import GGUFFile, iter_dequantized_gguf_weights
from pagellm.models.loader import default_model_path, eos_token_ids, get_max_model_len, load_hf_config, load_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return default_model_path()


@pytest.fixture(scope="module")
def hf_model(gguf_path: str) -> torch.nn.Module:
    return hf_gguf_model(gguf_path)


def test_config_matches_transformers(gguf_path: str) -> None:
    ours = load_hf_config(gguf_path)
    theirs = AutoConfig.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), local_files_only=True)
    assert ours.architectures == ["LlamaForCausalLM"]
    skip = {"architectures", "_name_or_path", "_model_name_or_path", "transformers_version"}
    ours_fields = {k: v for k, v in ours.to_dict().items() if k not in skip}
    theirs_fields = {k: v for k, v in theirs.to_dict().items() if k not in skip}
    assert ours_fields == {k: theirs_fields[k] for k in ours_fields}
    # ours is built without transformers: what it leaves out is only PretrainedConfig's generic
    # fields (output flags, label maps), at their defaults, which no model here reads.
    base = PretrainedConfig().to_dict()
    assert {k: v for k, v in theirs_fields.items() if k not in ours_fields} == {
        k: base[k] for k in theirs_fields if k not in ours_fields
    }
    assert (ours.num_hidden_layers, ours.hidden_size, ours.num_attention_heads, ours.num_key_value_heads) == (30, 576, 9, 3)
    assert ours.tie_word_embeddings and ours.vocab_size == 49152
    assert get_max_model_len(ours) == 8192


def test_weights_are_bit_identical_to_transformers(gguf_path: str, hf_model: torch.nn.Module) -> None:
    theirs = hf_model.state_dict()
    ours = dict(iter_dequantized_gguf_weights(gguf_path, load_hf_config(gguf_path)))
    expected = {k for k in theirs if k != "lm_head.weight"}  # tied: transformers aliases the embeddings
    assert set(ours) == expected
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, theirs[name]), name


def test_loaded_model_matches_transformers_logits(gguf_path: str, hf_model: torch.nn.Module) -> None:
    config = load_hf_config(gguf_path)
    start = time.perf_counter()
    model = load_model(gguf_path, config, torch.float32, torch.device("cpu"), TorchReferenceBackend())
    load_seconds = time.perf_counter() - start
    print(f"default model load: {load_seconds:.2f}s")
    assert load_seconds < 30  # ~1.5 s on 2 cores; generous for a loaded CI box

    attn = model.model.layers[7].self_attn
    theirs = hf_model.model.layers[7].self_attn
    assert torch.equal(attn.qkv_proj.weight, torch.cat([theirs.q_proj.weight, theirs.k_proj.weight, theirs.v_proj.weight]))

    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 2, 198, 1, 4093, 198, 19556, 17, 2]
    with torch.no_grad():
        reference = hf_model(torch.tensor([prompt])).logits[0]
    driver = PagedDriver(model, config, block_size=16, num_blocks=8)
    prefill = driver.step([(0, prompt[:-1])])
    decode = driver.step([(0, prompt[-1:])])
    torch.testing.assert_close(torch.cat([prefill, decode]), reference, atol=2e-3, rtol=1e-3)
    assert torch.equal(torch.cat([prefill, decode]).argmax(-1), reference.argmax(-1))


@pytest.mark.skipif(not ops.int8_matmul_available(), reason="no int8 dot products in this build")
def test_default_model_keeps_its_blocks_on_the_int8_path(gguf_path: str) -> None:
    # Q4_1 projections and the Q8_0 embedding (the tied head) are repacked from their file blocks:
    # no float32 copy, resident bytes near the file's, and each product equal to the product with
    # transformers' dequantized weights up to the int8 activations' error.
    config = load_hf_config(gguf_path)
    precision = LinearPrecision(kind="int8", fallback="float32")
    model = load_model(gguf_path, config, torch.float32, torch.device("cpu"), TorchReferenceBackend(), precision)
    linears = [m for _, m in model.linear_layers()]
    assert len(linears) == 4 * 30 + 1
    assert all(isinstance(m.method, GGUFInt8Method) for m in linears)
    assert {m.method.ggml_type.name for m in linears} == {"Q4_1", "Q8_0"}
    assert model.model.layers[5].mlp.gate_up_proj.method.fused_gate_up
    # One copy of the table: looked up row by row from the panels the tied head multiplies by.
    assert model.model.embed_tokens.packed is model.lm_head.method
    assert model.weight_bytes() < 1.1 * os.path.getsize(gguf_path)
    dequantized = dict(iter_dequantized_gguf_weights(gguf_path, config))
    x = torch.randn(32, 576)
    qkv = torch.cat([dequantized[f"model.layers.5.self_attn.{p}_proj.weight"] for p in "qkv"])
    for layer, weight in ((model.model.layers[5].self_attn.qkv_proj, qkv), (model.lm_head, dequantized["model.embed_tokens.weight"])):
        want = x @ weight.T
        assert (layer(x) - want).norm() / want.norm() < 1e-2
    gate = dequantized["model.layers.5.mlp.gate_proj.weight"]
    up = dequantized["model.layers.5.mlp.up_proj.weight"]
    want = silu_and_mul(torch.cat([x @ gate.T, x @ up.T], dim=1))
    assert (model.model.layers[5].mlp.gate_up_proj(x) - want).norm() / want.norm() < 1e-2
    ids = torch.tensor([0, 5, 49151, 17])
    assert torch.equal(model.model.embed_tokens(ids), dequantized["model.embed_tokens.weight"][ids])


def test_eos_token_ids_from_gguf(gguf_path: str) -> None:
    assert eos_token_ids(gguf_path, load_hf_config(gguf_path)) == {2}  # <|im_end|>
    metadata = GGUFFile(gguf_path).metadata
    assert metadata["tokenizer.ggml.eos_token_id"] == 2


def _resident_file_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile:"))


def test_tensors_are_read_in_place_and_their_pages_released(gguf_path: str) -> None:
    # Blocks are views of the map (packing reads them where they lie, no copy to fault in), and
    # release() drops the pages from this process while a view still reads the same bytes.
    gguf_file = GGUFFile(gguf_path)
    name = "blk.3.ffn_down.weight"
    first, second = gguf_file.read(name), gguf_file.read(name)
    assert first.data.data_ptr() == second.data.data_ptr()
    want = first.data.clone()
    touched = int(first.data.sum(dtype=torch.int64))  # faults every page of the tensor in
    before = _resident_file_kib()
    gguf_file.release(name)
    assert _resident_file_kib() <= before - first.data.numel() // 1024 // 2
    assert int(first.data.sum(dtype=torch.int64)) == touched and torch.equal(first.data, want)
    gguf_file.release()
    assert torch.equal(gguf_file.read(name).data, want)
