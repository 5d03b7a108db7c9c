"""Hugging Face transformers on the same GGUF weights, as the test oracle, and vLLM's comparison rule."""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch

from pagellm.outputs import RequestOutput


@dataclass
class HFGreedy:
    token_ids: list[int]
    top_logprobs: list[dict[int, float]]  # per generated position, the top-5


def hf_gguf_model(path: str) -> torch.nn.Module:
    """transformers' own GGUF load of ``path``, dequantized to float32: the test oracle."""
    from transformers import AutoModelForCausalLM, GgufConfig

    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path),
        gguf_file=os.path.basename(path),
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
        local_files_only=True,
    ).eval()


@lru_cache(maxsize=1)
def hf_model_and_tokenizer():
    from transformers import AutoTokenizer

    from pagellm.models.loader import default_model_path

    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    return hf_gguf_model(path), tokenizer


@torch.inference_mode()
def hf_greedy(
    prompt_token_ids: list[int], max_new_tokens: int, eos_token_ids: set[int], model: torch.nn.Module | None = None
) -> HFGreedy:
    """Greedy decoding by hand (no generation-config surprises), stopping at EOS like the engine;
    ``model`` defaults to the default GGUF's float32 load."""
    if model is None:
        model, _ = hf_model_and_tokenizer()
    input_ids = torch.tensor([prompt_token_ids])
    out = model(input_ids=input_ids, use_cache=True)
    past = out.past_key_values
    logits = out.logits[0, -1]
    token_ids: list[int] = []
    tops: list[dict[int, float]] = []
    for _ in range(max_new_tokens):
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        values, ids = logprobs.topk(5)
        tops.append(dict(zip(ids.tolist(), values.tolist())))
        token = int(ids[0])
        token_ids.append(token)
        if token in eos_token_ids:
            break
        out = model(input_ids=torch.tensor([[token]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[0, -1]
    return HFGreedy(token_ids, tops)


@torch.inference_mode()
def hf_greedy_uncached(model: torch.nn.Module, prompt_token_ids: list[int], max_new_tokens: int) -> HFGreedy:
    """Greedy decoding by a full forward pass per token, no cache: transformers' own masks (a
    sliding window's) and layers (a hybrid's recurrent ones) over the whole sequence every time."""
    ids = list(prompt_token_ids)
    token_ids, tops = [], []
    for _ in range(max_new_tokens):
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
        values, top = logprobs.topk(5)
        tops.append(dict(zip(top.tolist(), values.tolist())))
        token_ids.append(int(top[0]))
        ids.append(int(top[0]))
    return HFGreedy(token_ids, tops)


def check_close(ours: RequestOutput, ref: HFGreedy, name: str) -> bool:
    """vLLM's rule: equal greedy ids, or at the first difference each side's token is in the
    other's top-5, after which the sequences are free to diverge. Returns True if identical."""
    our_ids = ours.outputs[0].token_ids
    our_lps = ours.outputs[0].logprobs
    for i, (a, b) in enumerate(zip(our_ids, ref.token_ids)):
        if a != b:
            assert our_lps is not None, f"{name}: differs at {i} and no logprobs to judge by"
            assert a in ref.top_logprobs[i], f"{name}: at {i} our token {a} not in HF top-5 {ref.top_logprobs[i]}"
            assert b in our_lps[i], f"{name}: at {i} HF token {b} not in our top-5 {list(our_lps[i])}"
            return False
    assert len(our_ids) == len(ref.token_ids), f"{name}: lengths differ: {len(our_ids)} vs {len(ref.token_ids)}"
    return True


@torch.inference_mode()
def hf_embedding(prompt_token_ids: list[int], pooling_type: str, normalize: bool = True, dimensions: Optional[int] = None) -> torch.Tensor:
    """transformers' last hidden state (``output_hidden_states``' last entry: after the final norm),
    pooled as vLLM's pooling runner does: LAST, MEAN or CLS, truncated, then L2-normalized."""
    model, _ = hf_model_and_tokenizer()
    hidden = model(input_ids=torch.tensor([prompt_token_ids]), output_hidden_states=True).hidden_states[-1][0].float()
    pooled = {"LAST": lambda h: h[-1], "MEAN": lambda h: h.mean(dim=0), "CLS": lambda h: h[0]}[pooling_type](hidden)
    pooled = pooled[:dimensions] if dimensions is not None else pooled
    return torch.nn.functional.normalize(pooled, dim=0) if normalize else pooled


def cosine(a, b) -> float:
    """Cosine similarity of two vectors given as lists or tensors, in float64."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def logprob_close(ours: float, theirs: float) -> bool:
    """Equal to a float32 log-probability within 1e-3 plus 1e-4 of its magnitude: logits of ~20 carry
    summation-order error of that size, and it differs between CPUs (AVX2 against AVX-512)."""
    return abs(ours - theirs) < 1e-3 + 1e-4 * abs(theirs)
