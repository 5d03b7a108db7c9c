"""Tiny random-weight sliding-window models generating well past their windows through the whole
engine, blocks of 16, under chunked prefill and preemption: greedy tokens as transformers
generates them, and each request's sliding groups holding no more blocks than the window needs.

Mistral: every layer sliding (one KV cache group). Gemma 3: five sliding layers to one full one
(six groups of one layer, each layer reading its own group's block table)."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, MistralConfig, PretrainedConfig

from pagellm import LLM, SamplingParams
from pagellm.models.loader import default_model_path

WINDOW = 24
BLOCK = 16
BUDGET = 20  # tokens a step: prompts of 30-45 tokens are prefilled in chunks beside decodes
_TINY = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    max_position_embeddings=512, sliding_window=WINDOW, tie_word_embeddings=False,
)
_GEMMA_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
}


def mistral() -> PretrainedConfig:
    return MistralConfig(**_TINY, num_hidden_layers=3)


def gemma3() -> PretrainedConfig:
    return AutoConfig.for_model("gemma3_text", **_TINY, num_hidden_layers=6, query_pre_attn_scalar=16, rope_parameters=_GEMMA_ROPE)


# name -> (config, KV blocks: few enough that the four requests cannot all hold their windows, expected groups)
MODELS = {"mistral": (mistral, 8, 1), "gemma3": (gemma3, 40, 6)}


def save_random(config: PretrainedConfig, path: Path) -> Path:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            # O(0.1) weights and norms off their defaults, so a misplaced tensor or a wrong mask shows.
            param.copy_(1.0 + 0.1 * torch.randn_like(param)) if "norm" in name else param.normal_(0.0, 0.1)
    model.save_pretrained(path)
    return path


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[list[int]]]:
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
        return_dict_in_generate=True, pad_token_id=0, eos_token_id=None,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, [logits[0].topk(5).indices.tolist() for logits in out.logits]


@pytest.mark.parametrize(("name", "backend"), [("mistral", None), ("mistral", "torch_sdpa"), ("gemma3", None)])
def test_greedy_tokens_match_transformers_past_the_window(name: str, backend, tmp_path: Path) -> None:
    make_config, num_kv_blocks, num_groups = MODELS[name]
    path = save_random(make_config(), tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    rng = random.Random(1)
    prompts = [[rng.randrange(1, 128) for _ in range(rng.randrange(30, 46))] for _ in range(4)]
    max_new = 50  # prompt and output reach 80-95 tokens: more than three windows
    llm = LLM(
        model=str(path), tokenizer=default_model_path(), dtype="float32", block_size=BLOCK, num_kv_blocks=num_kv_blocks,
        max_num_batched_tokens=BUDGET, max_num_seqs=4, max_model_len=256, attention_backend=backend,
    )
    core = llm.llm_engine.core
    kv = core.kv_cache_manager
    assert kv.num_kv_cache_groups == num_groups
    sliding = [m for m in kv.group_managers if m.sliding_window == WINDOW]
    assert sliding and len(sliding) == num_groups - (num_groups > 1)
    bound = -(-(WINDOW - 1 + BUDGET) // BLOCK) + 1  # the window before a step's first token, and the step
    peak = 0
    step = core.step

    def watched_step():
        nonlocal peak
        outputs = step()
        for request in core.scheduler.running:
            peak = max(peak, *(m.num_held_blocks(request.request_id) for m in sliding))
        kv.check_integrity()
        return outputs

    core.step = watched_step
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert core.scheduler.num_preemptions > 0
    assert 0 < peak <= bound  # never the whole context: 6 blocks by the end, at most 4 held
    assert kv.block_pool.num_used_blocks == 0
    for prompt, result in zip(prompts, results):
        ours = list(result.outputs[0].token_ids)
        theirs, top5 = hf_greedy(hf, prompt, max_new)
        if ours != theirs:  # float noise may flip a near tie: then each side's token is in the other's top 5
            i = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
            assert ours[i] in top5[i], (i, ours[i], top5[i])
            one = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
            ours_top5 = llm.generate([{"prompt_token_ids": prompt + ours[:i]}], one, use_tqdm=False)
            assert theirs[i] in ours_top5[0].outputs[0].logprobs[0]


def test_tensor_parallel_ranks_lay_out_the_same_groups(tmp_path: Path) -> None:
    # Each rank builds its own six groups from the config; the driver's block ids must mean the same pages there.
    path = save_random(gemma3(), tmp_path)
    rng = random.Random(2)
    prompts = [{"prompt_token_ids": [rng.randrange(1, 128) for _ in range(rng.randrange(30, 46))]} for _ in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outputs = []
    for tp in (1, 2):
        llm = LLM(
            model=str(path), tokenizer=default_model_path(), dtype="float32", block_size=BLOCK, num_kv_blocks=40,
            max_num_batched_tokens=BUDGET, max_num_seqs=4, max_model_len=256, tensor_parallel_size=tp,
        )
        try:
            outputs.append([list(r.outputs[0].token_ids) for r in llm.generate(prompts, params, use_tqdm=False)])
            assert llm.llm_engine.core.scheduler.num_preemptions > 0
        finally:
            llm.shutdown()
    assert outputs[0] == outputs[1]
