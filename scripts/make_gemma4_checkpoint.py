"""A random-weight Gemma 4-E4B-shape checkpoint whose tokenizer is in Gemma's format, so that
llama.cpp's `convert_hf_to_gguf.py` takes it as is (it reads a `gemma4` vocabulary only from a
Gemma-style tokenizer; SmolLM2's, which ../shared/peers/make_random_model.py copies, is refused).

The tokenizer is trained here on Python's own standard library sources: BPE with byte fallback,
spaces as "▁", Gemma 4's special tokens (<pad> <eos> <bos> <unk> <mask>, the turn, channel, tool
and quote tokens) first, then the 256 byte tokens, then the learned merges, padded with
<unusedN> to the model's vocabulary, and Gemma 4's turn-based chat template. Speed does not
depend on the weights' values or on which text the tokenizer learned from.

usage: python scripts/make_gemma4_checkpoint.py OUT [--tokenizer-only] [--vocab-size 49152] [--learned 8000]
then:  convert_hf_to_gguf.py OUT --outtype f16 --outfile F16.gguf; llama-quantize F16.gguf Q4_K_M.gguf Q4_K_M 2
"""
from __future__ import annotations

import argparse
import json
import sysconfig
from pathlib import Path

SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>", "<|channel>", "<channel|>",
           "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>']
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<|turn>' + role + '\n' + message['content'] | trim + '<turn|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|turn>model\n' }}{% endif %}"
)
# Gemma 4-E4B's text body: 42 layers, sliding windows of 512 five to one, 512-wide heads on the
# global layers, per-layer inputs of 256, the last 18 layers reading earlier layers' KV.
E4B = dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=42, num_attention_heads=8,
           num_key_value_heads=2, head_dim=256, num_kv_shared_layers=18, hidden_size_per_layer_input=256,
           sliding_window=512, final_logit_softcapping=30.0, max_position_embeddings=8192,
           layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 7,
           per_layer_config={f"{i:02d}": {"head_dim": 512} for i in range(5, 42, 6)})


def train_tokenizer(out: Path, vocab_size: int, learned: int) -> None:
    """Writes tokenizer.json, tokenizer_config.json and chat_template.jinja to `out`."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    num_trained = len(SPECIAL) + 256 + learned
    if num_trained > vocab_size:
        raise ValueError(f"{learned} learned tokens do not fit a vocabulary of {vocab_size} after the specials and bytes")
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    trainer = trainers.BpeTrainer(vocab_size=num_trained, special_tokens=SPECIAL + byte_tokens,
                                  show_progress=False)
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    tok.train([str(p) for p in sources], trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos>:1 $B:1", special_tokens=[("<bos>", 2)])
    # The trainer made every special token an added token; byte fallback needs the byte tokens as
    # plain vocabulary entries, so only Gemma's specials stay added. <unusedN> pads to the model's size.
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    num_used = len(vocab)
    vocab.update({f"<unused{i}>": num_used + i for i in range(vocab_size - num_used)})
    data["added_tokens"] = [
        {"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": True} for i, s in enumerate(SPECIAL)]
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "backend": "tokenizers", "tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>", "eos_token": "<eos>",
        "pad_token": "<pad>", "unk_token": "<unk>", "mask_token": "<mask>", "extra_special_tokens": SPECIAL[5:],
    }, indent=2), encoding="utf-8")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")


def make_model(out: Path, vocab_size: int, dtype: str) -> int:
    """Random Gemma 4-E4B-shape weights (seed 0) saved to `out`; returns the parameter count."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gemma4_text", vocab_size=vocab_size, vocab_size_per_layer_input=vocab_size,
                                  bos_token_id=2, eos_token_id=1, pad_token_id=0, tie_word_embeddings=True,
                                  initializer_range=0.02, **E4B)
    config.architectures = ["Gemma4ForCausalLM"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(out, max_shard_size="5GB")
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--vocab-size", type=int, default=49152)
    ap.add_argument("--learned", type=int, default=8000, help="BPE tokens learned before the <unusedN> padding")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokenizer-only", action="store_true")
    args = ap.parse_args()
    train_tokenizer(args.out, args.vocab_size, args.learned)
    params = None if args.tokenizer_only else make_model(args.out, args.vocab_size, args.dtype)
    print(json.dumps({"out": str(args.out), "vocab_size": args.vocab_size, "params": params}))


if __name__ == "__main__":
    main()
