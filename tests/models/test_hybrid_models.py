"""Hybrid models served by the engine (Qwen3.5 dense and MoE, Qwen3-Next): Gated DeltaNet layers
with a state slot per request beside gated attention on the paged KV cache. Greedy decoding against
transformers by vLLM's rule under chunked prefill and preemption, from safetensors and from a GGUF
file written as llama.cpp writes it; prefix caching on equal to off for prompts that share a prefix
cut mid-block, sent after the prompt they share it with; two tensor-parallel ranks against one; n-gram
speculative decoding with every state rolled back to the accepted drafts."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import numpy as np
import pytest
import torch
from gguf_writer import write_gguf
from hf_oracle import HFGreedy, check_close, hf_greedy_uncached
from model_utils import TINY_QWEN3_5, make_random_hf_model
from transformers import AutoConfig, PretrainedConfig

from pagellm import LLM, SamplingParams
from pagellm.models.loader import default_model_path, load_hf_config
from pagellm.models.shape import ModelShape
from pagellm.spec_decode.ngram_proposer import NgramProposer

_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
_NEMOTRON_H = dict(layers_block_type=None, mamba_num_heads=8, mamba_head_dim=8, n_groups=2, ssm_state_size=16, conv_kernel=4)


def _config(model_type: str, **fields) -> Callable[[], PretrainedConfig]:
    return lambda: AutoConfig.for_model(model_type, **{**TINY_QWEN3_5, **fields})


# Granite 4.0-H: Mamba-2 layers and one attention layer, NoPE, Granite's multipliers; two groups of B and C in the
# dense model (split over TP ranks), one in the MoE model (as the released ones: every rank holds it).
_GRANITE = dict(
    vocab_size=128, hidden_size=64, max_position_embeddings=256, num_attention_heads=4, num_key_value_heads=2,
    num_hidden_layers=4, layer_types=["mamba", "mamba", "attention", "mamba"], mamba_n_heads=8, mamba_d_head=16,
    mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16, position_embedding_type="nope",
    embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.125, logits_scaling=2.0,
)


def _granite(**fields) -> Callable[[], PretrainedConfig]:
    return lambda: AutoConfig.for_model("granitemoehybrid", **{**_GRANITE, **fields})


# LFM2: gated short convolutions and one attention layer; the MLP's width from 2/3 of intermediate_size
# rounded up to block_multiple_of (100 -> 66 -> 96); LFM2-MoE's first block dense, the others experts.
_LFM2 = dict(
    vocab_size=128, hidden_size=64, intermediate_size=100, max_position_embeddings=256, num_attention_heads=4,
    num_key_value_heads=2, num_hidden_layers=4, conv_L_cache=3, layer_types=["conv", "conv", "full_attention", "conv"],
)


def _lfm2(model_type: str, **fields) -> Callable[[], PretrainedConfig]:
    return lambda: AutoConfig.for_model(model_type, **{**_LFM2, **fields})


CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "qwen3.5": _config("qwen3_5_text"),
    "qwen3.5-moe": _config("qwen3_5_moe_text", **_MOE),
    "qwen3-next": _config("qwen3_next", **_MOE),
    "lfm2": _lfm2("lfm2", block_multiple_of=32),
    "lfm2-moe": _lfm2("lfm2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, num_dense_layers=1),
    "granite-4.0-h": _granite(num_local_experts=0, shared_intermediate_size=96),
    "granite-4.0-h-moe": _granite(
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, shared_intermediate_size=48, mamba_n_groups=1
    ),
    # Mamba-2 (M), attention (*), ReLU² MLP (-) and MoE (E) blocks; the MoE routes in two groups.
    "nemotron-h": _config("nemotron_h", hybrid_override_pattern="M-M*-M-", **_NEMOTRON_H),
    "nemotron-h-moe": _config(
        "nemotron_h", hybrid_override_pattern="ME*EM", n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48, n_group=2, topk_group=1, routed_scaling_factor=2.5, **_NEMOTRON_H,
    ),
}
_MAX_TOKENS = 10


def _prompts() -> list[list[int]]:
    """Four prompts longer than a 16-token chunk; the last three share a stem with the first, cut
    inside a 4-token block (at 30, 41 and 37 tokens)."""
    stem = [(5 * j + 3) % 120 + 3 for j in range(45)]
    return [stem + [7, 8, 9], stem[:30] + [11, 12], stem[:41] + [21, 22, 23], stem[:37] + [1]]


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory) -> tuple[str, Path, PretrainedConfig, list[HFGreedy]]:
    path = tmp_path_factory.mktemp(request.param)
    hf_model = make_random_hf_model(CONFIGS[request.param](), seed=1)
    with torch.no_grad():  # learnt buffers too (Nemotron-H's and LFM2-MoE's routing bias), which transformers initialises to zero
        for name, buffer in hf_model.named_buffers():
            if name.endswith(("e_score_correction_bias", "expert_bias")):  # LFM2-MoE: expert_bias
                buffer.normal_(0.0, 0.1)
    hf_model.save_pretrained(path)
    return request.param, path, hf_model.config, [hf_greedy_uncached(hf_model, p, _MAX_TOKENS) for p in _prompts()]


def _generate(model: Path, one_by_one: bool = False, check: Optional[Callable[[object], None]] = None, **kwargs):
    """Greedy outputs, and the engine's state cache after them; ``check`` looks at the engine's
    core before it shuts down."""
    llm = LLM(model=str(model), tokenizer=default_model_path(), dtype="float32", **{"max_model_len": 96, **kwargs})
    try:
        params = SamplingParams(temperature=0.0, max_tokens=_MAX_TOKENS, logprobs=5, ignore_eos=True)
        batches = [[p] for p in _prompts()] if one_by_one else [_prompts()]
        outputs = [o for batch in batches for o in llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)]
        core = llm.llm_engine.core
        if check is not None:
            check(core)
        return outputs, core.kv_cache_manager.state_cache, core.scheduler.num_preemptions
    finally:
        llm.shutdown()


def test_engine_greedy_matches_transformers_under_chunks_and_preemption(checkpoint) -> None:
    name, path, _, reference = checkpoint
    # 24 blocks of 4 tokens hold one attention layer's KV for fewer tokens than the four prompts
    # need together: requests are preempted and recomputed; 16 tokens a step chunk every prompt.
    outputs, _, preemptions = _generate(path, block_size=4, num_kv_blocks=24, max_num_batched_tokens=16, max_num_seqs=4)
    assert preemptions > 0
    for i, (ours, ref) in enumerate(zip(outputs, reference)):
        check_close(ours, ref, f"{name} prompt {i}")


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_5_moe"])
def test_image_text_checkpoint_with_an_mtp_head_serves_its_language_model(model_type: str, tmp_path: Path) -> None:
    """Qwen3.5 ships as Qwen3_5(Moe)ForConditionalGeneration with its vision tower (model.visual.*) and
    a multi-token-prediction head (mtp.*) beside the language model: both are left unread, as
    transformers' causal-LM class leaves them, and the language model matches transformers."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration

    text = AutoConfig.for_model(f"{model_type}_text", **TINY_QWEN3_5, **(_MOE if model_type.endswith("moe") else {})).to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4, spatial_merge_size=2)
    model_class = Qwen3_5MoeForConditionalGeneration if model_type.endswith("moe") else Qwen3_5ForConditionalGeneration
    config = AutoConfig.for_model(model_type, text_config=text, vision_config=vision)
    hf_model = make_random_hf_model(config, seed=1, model_class=model_class)
    hf_model.save_pretrained(tmp_path)
    (weights_file,) = tmp_path.glob("*.safetensors")
    tensors = load_file(weights_file)
    assert any(name.startswith("model.visual.") for name in tensors)
    tensors["mtp.fc.weight"] = torch.zeros(64, 128)  # an MTP layer's tensors, as the released checkpoints carry
    tensors["mtp.layers.0.input_layernorm.weight"] = torch.ones(64)
    save_file(tensors, weights_file, metadata={"format": "pt"})
    assert load_hf_config(str(tmp_path)).architectures[0].endswith("ForCausalLM")
    outputs, _, _ = _generate(tmp_path, block_size=4, max_num_batched_tokens=16)
    for i, (ours, prompt) in enumerate(zip(outputs, _prompts())):
        check_close(ours, hf_greedy_uncached(hf_model, prompt, _MAX_TOKENS), f"{model_type} image-text prompt {i}")


@pytest.mark.parametrize("source", ["safetensors", "gguf"])
def test_prefix_caching_resumes_state_and_equals_no_caching(checkpoint, source: str, tmp_path: Path) -> None:
    name, path, hf_config, reference = checkpoint
    if source == "gguf":
        path = write_gguf(path, hf_config, tmp_path / "model.gguf")
    kwargs = dict(block_size=4, num_kv_blocks=128, max_num_batched_tokens=16, one_by_one=True, state_checkpoint_interval=16)
    cached, state, _ = _generate(path, **kwargs)
    plain, _, _ = _generate(path, enable_prefix_caching=False, **kwargs)
    # The deepest saved state each time: every 16 tokens and where an earlier hit's KV ran further
    # (28 after the second prompt, 40 after the third, past the fourth's 36-token reach).
    assert [o.num_cached_tokens for o in cached] == [0, 16, 32, 32]
    assert state.num_checkpoints_restored == 3
    for i, (a, b, ref) in enumerate(zip(cached, plain, reference)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, f"{name} prompt {i}: caching changed the output"
        check_close(a, ref, f"{name} prompt {i}")


def test_gguf_file_matches_transformers(checkpoint, tmp_path: Path) -> None:
    name, path, hf_config, reference = checkpoint
    gguf_path = write_gguf(path, hf_config, tmp_path / "model.gguf")
    config = load_hf_config(str(gguf_path))
    assert ModelShape.from_hf_config(config) == ModelShape.from_hf_config(hf_config)
    outputs, _, _ = _generate(gguf_path, block_size=4, num_kv_blocks=64, max_num_batched_tokens=16)
    for i, (ours, ref) in enumerate(zip(outputs, reference)):
        check_close(ours, ref, f"{name} GGUF prompt {i}")


@pytest.mark.slow
@pytest.mark.parametrize("source", ["safetensors", "gguf"])
def test_tensor_parallel_two_ranks_match_one(checkpoint, source: str, tmp_path: Path) -> None:
    name, path, hf_config, _ = checkpoint
    if source == "gguf":
        path = write_gguf(path, hf_config, tmp_path / "model.gguf")
    one, _, _ = _generate(path, num_kv_blocks=64)
    two, _, _ = _generate(path, num_kv_blocks=64, tensor_parallel_size=2, block_size=4, max_num_batched_tokens=16)
    for a, b in zip(one, two):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, name
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert all(abs(x[k].logprob - y[k].logprob) < 1e-3 for k in x.keys() & y.keys()), name


@pytest.mark.parametrize("flag", ["mamba_ssm_cache_dtype", "mamba_cache_dtype"])
def test_bfloat16_state_matches_transformers_and_shrinks_its_slots(checkpoint, flag) -> None:
    """--mamba-ssm-cache-dtype bfloat16: the recurrent matrices in bfloat16 slots (the convolutions'
    tails stay float32); --mamba-cache-dtype bfloat16: every state tensor in bfloat16. Under chunked
    prefill, preemption and prefix caching, greedy output still passes vLLM's rule against
    transformers in float32."""
    name, path, hf_config, reference = checkpoint
    shape = ModelShape.from_hf_config(hf_config)
    every_tensor = flag == "mamba_cache_dtype"
    if not any(t.ssm or every_tensor for t in shape.state_tensors):
        pytest.skip(f"{name} keeps no recurrent matrix (short convolutions only)" if shape.state_tensors else f"{name} keeps no state")
    llm = LLM(
        model=str(path), tokenizer=default_model_path(), dtype="float32", max_model_len=96, block_size=4, num_kv_blocks=24,
        max_num_batched_tokens=16, max_num_seqs=4, state_checkpoint_interval=16, **{flag: "bfloat16"},
    )
    try:
        core = llm.llm_engine.core
        states = [t for cache in core.runner.kv_caches if isinstance(cache, tuple) for t in cache]
        assert len(states) == len(shape.state_layer_ids) * len(shape.state_tensors)
        halved = [spec.ssm or every_tensor for spec in shape.state_tensors]
        assert [t.dtype for t in states] == [torch.bfloat16 if h else torch.float32 for h in halved] * len(shape.state_layer_ids)
        halved_bytes = sum(spec.nbytes(torch.float32, torch.float32) for spec, h in zip(shape.state_tensors, halved) if h)
        assert core.kv_cache_plan.state_slot_bytes == shape.state_slot_bytes(torch.float32, torch.float32) - len(
            shape.state_layer_ids
        ) * halved_bytes // 2
        params = SamplingParams(temperature=0.0, max_tokens=_MAX_TOKENS, logprobs=5, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
        assert core.scheduler.num_preemptions > 0
    finally:
        llm.shutdown()
    for i, (ours, ref) in enumerate(zip(outputs, reference)):
        check_close(ours, ref, f"{name} bfloat16 state ({flag}), prompt {i}")


_SPEC = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}


def _oracle_drafter(reference: list[HFGreedy], vocab_size: int) -> Callable[..., list[int]]:
    """An n-gram proposer's ``propose`` that knows transformers' continuation of each prompt and
    spoils one draft in turn: 0, 1, 2, ... drafts hold."""
    continuations = {tuple(p): ref.token_ids for p, ref in zip(_prompts(), reference)}

    def propose(self, token_ids: np.ndarray, num_draft_tokens: int) -> list[int]:
        ids = token_ids.tolist()
        prompt = max((p for p in continuations if tuple(ids[: len(p)]) == p), key=len)
        done, want = ids[len(prompt) :], continuations[prompt]
        if done != want[: len(done)]:
            return []  # the output took the other side of a near tie (vLLM's rule allows it): no oracle
        drafts = want[len(done) : len(done) + num_draft_tokens]
        spoilt = len(done) % (num_draft_tokens + 1)
        if spoilt < len(drafts):
            drafts[spoilt] = (drafts[spoilt] + 1) % vocab_size
        return drafts

    return propose


def test_speculative_decoding_rolls_the_state_back_to_the_accepted_drafts(checkpoint, monkeypatch) -> None:
    """n-gram speculative decoding: a step verifies a token and its drafts, and each recurrent
    layer's state goes back to the one saved after the accepted drafts (a draft slot becomes the
    live one). The drafter is replaced by one that knows transformers' continuation and spoils one
    draft in turn, so every rollback depth (0 to 3 drafts accepted) happens; under chunked prefill,
    preemption and prefix caching, greedy output still passes vLLM's rule against transformers, and
    every state slot is accounted for afterwards."""
    name, path, hf_config, reference = checkpoint
    monkeypatch.setattr(NgramProposer, "propose", _oracle_drafter(reference, hf_config.vocab_size))
    outputs, state, preemptions = _generate(
        path, max_model_len=64, block_size=4, num_kv_blocks=18, max_num_batched_tokens=16, max_num_seqs=4,
        state_checkpoint_interval=16, speculative_config=_SPEC, check=lambda core: _check_speculation(core, name),
    )
    assert preemptions > 0
    assert state.stats().num_live == 0
    for i, (ours, ref) in enumerate(zip(outputs, reference)):
        check_close(ours, ref, f"{name} speculative, prompt {i}")


def _check_speculation(core, name: str) -> None:
    stats = core.scheduler.spec.stats
    assert core.kv_cache_plan.num_state_draft_slots == 3 and core.kv_cache_manager.state_cache.slots_per_request == 4
    assert stats.num_accepted_tokens < stats.num_draft_tokens, f"{name}: no draft was rejected: {stats}"
    assert all(n > 0 for n in stats.num_accepted_tokens_per_pos), f"{name}: not every depth of drafts was accepted: {stats}"
    core.kv_cache_manager.check_integrity()


@pytest.mark.slow
def test_speculative_decoding_on_two_ranks_matches_one(checkpoint) -> None:
    """Rank 0 proposes and verifies, and its scheduler rolls every rank's state back: two ranks give
    one rank's output. The real n-gram lookup (the ranks are other processes), whose drafts these
    prompts mostly refute. One model per kind of state (the delta rule, Mamba-2, short convolutions)."""
    name, path, _, reference = checkpoint
    if name not in ("qwen3.5", "granite-4.0-h", "lfm2"):
        pytest.skip("one model per kind of recurrent state")
    spec = {**_SPEC, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    kwargs = dict(block_size=4, num_kv_blocks=64, max_num_batched_tokens=16, speculative_config=spec)
    stats = []
    one, _, _ = _generate(path, **kwargs)
    two, _, _ = _generate(path, tensor_parallel_size=2, check=lambda core: stats.append(core.scheduler.spec.stats), **kwargs)
    assert stats[0].num_draft_tokens > stats[0].num_accepted_tokens, f"{name}: no draft was refuted: {stats[0]}"
    for a, b, ref in zip(one, two, reference):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, name
        check_close(b, ref, f"{name} speculative on two ranks")


def test_a_draft_model_is_refused_with_a_reason(checkpoint) -> None:
    _, path, _, _ = checkpoint
    with pytest.raises(ValueError, match="not supported for hybrid models.*use 'ngram'"):
        speculative_config = {"model": str(path), "num_speculative_tokens": 2}
        LLM(model=str(path), tokenizer=default_model_path(), dtype="float32", speculative_config=speculative_config)
