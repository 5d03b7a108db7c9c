"""Random-weight GGUF checkpoints of real shapes, written block by block (no float copy of the
weights, so an 18 GB file is written in a few hundred MB of memory), with the default model's
tokenizer, for speed and memory measurements (speed does not depend on the values). Types follow
llama-quantize's Q4_K_M recipe: Q6_K for attn_v and ffn_down(_exps) on its "more bits" layers and
for the output matrix, Q4_K elsewhere; norms and the MoE router in F32.

usage: python scripts/make_random_gguf.py SHAPE OUT.gguf    SHAPE: qwen3-30b-a3b | qwen3-a3b-dense | smollm2-1.7b | llama-3.1-8b
"""
from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from gguf_blocks import random_blocks

from pagellm.models.loader import default_model_path

Q = GGMLQuantizationType
# Qwen3-30B-A3B's body; the dense twin has the same attention and one MLP as wide as the eight
# experts a token uses, so both read the same weights per token.
SHAPES = {
    "qwen3-30b-a3b": dict(arch="qwen3moe", layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128, used=8, expert_ff=768),
    "qwen3-a3b-dense": dict(arch="qwen3", layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, ff=8 * 768),
    # SmolLM2-1.7B's body: the default model's tokenizer, so the default model can draft for it.
    "smollm2-1.7b": dict(
        arch="llama", layers=24, hidden=2048, heads=32, kv_heads=32, head_dim=64, ff=8192, context=8192, rope_base=130000.0
    ),
    # Llama-3.1-8B's body (its context cut to 8,192), the size a 16-32 GB laptop serves as Q4_K_M.
    "llama-3.1-8b": dict(
        arch="llama", layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, ff=14336, context=8192, rope_base=500000.0
    ),
}


def more_bits(layer: int, layers: int) -> bool:
    """llama-quantize's use_more_bits: the first and last eighth, and every third layer between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def copy_tokenizer(writer: gguf.GGUFWriter) -> int:
    reader = GGUFReader(default_model_path())
    vocab = 0
    for field in reader.fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            values = [field.contents(i) for i in range(len(field.data))]
            writer.add_key_value(field.name, values, kind, sub_type=sub)
            if field.name == "tokenizer.ggml.tokens":
                vocab = len(values)
        else:
            writer.add_key_value(field.name, field.contents(), kind)
    return vocab


def tensors(shape: dict, vocab: int) -> list[tuple[str, tuple[int, ...], GGMLQuantizationType]]:
    h, d = shape["hidden"], shape["head_dim"]
    out = [("token_embd.weight", (vocab, h), Q.Q4_K), ("output_norm.weight", (h,), Q.F32), ("output.weight", (vocab, h), Q.Q6_K)]
    for i in range(shape["layers"]):
        p, big = f"blk.{i}.", more_bits(i, shape["layers"])
        out += [
            (p + "attn_norm.weight", (h,), Q.F32),
            (p + "attn_q.weight", (shape["heads"] * d, h), Q.Q4_K),
            (p + "attn_k.weight", (shape["kv_heads"] * d, h), Q.Q4_K),
            (p + "attn_v.weight", (shape["kv_heads"] * d, h), Q.Q6_K if big else Q.Q4_K),
            (p + "attn_output.weight", (h, shape["heads"] * d), Q.Q4_K),
            (p + "ffn_norm.weight", (h,), Q.F32),
        ]
        if shape["arch"] != "llama":  # Qwen3's q/k norms
            out += [(p + "attn_q_norm.weight", (d,), Q.F32), (p + "attn_k_norm.weight", (d,), Q.F32)]
        if "experts" in shape:
            e, f = shape["experts"], shape["expert_ff"]
            out += [
                (p + "ffn_gate_inp.weight", (e, h), Q.F32),
                (p + "ffn_gate_exps.weight", (e, f, h), Q.Q4_K),
                (p + "ffn_up_exps.weight", (e, f, h), Q.Q4_K),
                (p + "ffn_down_exps.weight", (e, h, f), Q.Q6_K if big else Q.Q4_K),
            ]
        else:
            f = shape["ff"]
            out += [
                (p + "ffn_gate.weight", (f, h), Q.Q4_K),
                (p + "ffn_up.weight", (f, h), Q.Q4_K),
                (p + "ffn_down.weight", (h, f), Q.Q6_K if big else Q.Q4_K),
            ]
    return out


def data(name: str, dims: tuple[int, ...], qtype: GGMLQuantizationType, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if qtype == Q.F32:
        if "norm" in name:
            return (1.0 + 0.1 * rng.standard_normal(dims)).astype(np.float32)
        return (0.02 * rng.standard_normal(dims)).astype(np.float32)
    rows = int(np.prod(dims[:-1]))
    return random_blocks(qtype, rows, dims[-1], seed).reshape(*dims[:-1], -1)


def main(shape_name: str, out: str) -> None:
    shape = SHAPES[shape_name]
    writer = gguf.GGUFWriter(out, shape["arch"])
    writer.add_name(f"random {shape_name}")
    vocab = copy_tokenizer(writer)
    writer.add_context_length(shape.get("context", 40960))
    writer.add_embedding_length(shape["hidden"])
    writer.add_block_count(shape["layers"])
    writer.add_feed_forward_length(shape.get("ff", 6144))
    writer.add_head_count(shape["heads"])
    writer.add_head_count_kv(shape["kv_heads"])
    writer.add_key_length(shape["head_dim"])
    writer.add_value_length(shape["head_dim"])
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(shape.get("rope_base", 1e6))
    if shape["arch"] == "llama":
        writer.add_rope_dimension_count(shape["head_dim"])
    if "experts" in shape:
        writer.add_expert_count(shape["experts"])
        writer.add_expert_used_count(shape["used"])
        writer.add_expert_feed_forward_length(shape["expert_ff"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    specs = tensors(shape, vocab)
    for name, dims, qtype in specs:
        block, size = GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(dims)) // block * size
        if qtype == Q.F32:
            writer.add_tensor_info(name, dims, np.dtype(np.float32), nbytes)
        else:  # gguf-py takes a quantized tensor's shape in bytes per row
            writer.add_tensor_info(name, (*dims[:-1], dims[-1] // block * size), np.dtype(np.uint8), nbytes, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for seed, (name, dims, qtype) in enumerate(specs):
        writer.write_tensor_data(data(name, dims, qtype, seed))
    writer.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
