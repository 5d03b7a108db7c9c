"""Nemotron-H's tiny test checkpoints (tests/models/test_hybrid_models.py's nemotron-h and
nemotron-h-moe, with SmolLM2's vocabulary) converted by llama.cpp's own converter, their config.json
written as the released checkpoints' (``hybrid_override_pattern``, no expert fields on a dense
model): tests/models/gguf_writer.py's file against the converter's, tensor by tensor and key by key,
and pagellm serving the converter's file with transformers' greedy tokens (vLLM's rule).

The converter reads a config through AutoConfig where transformers knows the model type; the
released checkpoints' remote-code configs make it fall back to config.json as written, which an
unknown model_type reproduces here.

usage: python scripts/check_llamacpp_nemotron_h.py [nemotron-h] [nemotron-h-moe]
"""
import json
import shutil
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "scripts"), str(REPO / "tests" / "models"), str(REPO / "tests")]
import check_llamacpp_gguf as chk  # noqa: E402
from gguf_writer import write_gguf  # noqa: E402
from hf_oracle import check_close, hf_greedy_uncached  # noqa: E402
from model_utils import make_random_hf_model  # noqa: E402
from test_hybrid_models import _MAX_TOKENS, CONFIGS, _prompts  # noqa: E402

from pagellm import LLM, SamplingParams  # noqa: E402
from pagellm.models.loader import default_model_path  # noqa: E402

# What a released dense Nemotron-H's config.json does not state (transformers 5 saves them all).
_EXPERT_FIELDS = (
    "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group", "moe_intermediate_size", "moe_shared_expert_intermediate_size",
    "routed_scaling_factor", "norm_topk_prob", "n_shared_experts", "moe_latent_size", "moe_shared_expert_overlap",
)


def check(name: str) -> None:
    config = CONFIGS[name]()
    config.vocab_size = chk.VOCAB
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 1, 2, 2
    d = chk.WORK / name
    shutil.rmtree(d, ignore_errors=True)
    hf = make_random_hf_model(config, seed=1)
    with torch.no_grad():
        for buffer_name, buffer in hf.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    hf.save_pretrained(d)
    raw = json.loads((d / "config.json").read_text())
    raw.update(model_type="nemotron_h_remote", num_hidden_layers=len(hf.config.layers_block_type))
    raw["hybrid_override_pattern"] = hf.config.hybrid_override_pattern
    del raw["layers_block_type"]
    if "moe" not in hf.config.layers_block_type:
        for field in _EXPERT_FIELDS:
            raw.pop(field, None)
    (d / "config.json").write_text(json.dumps(raw, indent=2))
    out = d / "model-f32.gguf"
    if err := chk.convert(d, out, "--outtype", "f32"):
        print(name, "the converter failed:", err)
        return
    problems = chk._writer_vs_converter(write_gguf(d, hf.config, d / "writer.gguf"), out)
    print(f"{name}: the writer's file against the converter's:", "OK" if not problems else "")
    for p in problems:
        print("   ", p)
    reference = [hf_greedy_uncached(hf, p, _MAX_TOKENS) for p in _prompts()]
    llm = LLM(model=str(out), tokenizer=default_model_path(), dtype="float32", max_model_len=96, block_size=4, max_num_batched_tokens=16)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=_MAX_TOKENS, logprobs=5, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
        for i, (ours, ref) in enumerate(zip(outputs, reference)):
            check_close(ours, ref, f"{name} prompt {i}")
        print(f"{name}: the converter's file served, greedy as transformers' on {len(outputs)} prompts")
    finally:
        llm.shutdown()


if __name__ == "__main__":
    for arg in sys.argv[1:] or ["nemotron-h", "nemotron-h-moe"]:
        check(arg)
