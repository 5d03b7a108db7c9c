"""vLLM's own 8-bit KV caches on the 14 prompts of tests/engine/test_llm_vs_hf.py, judged by the
rule pagellm's are (greedy ids equal, or at the first difference each side's token in the other's
top-5): is what pagellm's fp8_e5m2 misses the format's, or pagellm's?

Two steps, two virtual environments (docs/kv_cache.md):
  .venv/bin/python scripts/vllm_kv_rule_check.py dump REFS.json
      the prompts as token ids and transformers' greedy references (float32 GGUF load)
  /tmp/peers/vllm-venv/bin/python scripts/vllm_kv_rule_check.py judge REFS.json HF_DIR [KV_DTYPE ...]
      vLLM (float32 weights, the default model as a Hugging Face directory made by
      ../shared/peers/convert_gguf_to_hf.py) with each --kv-cache-dtype, counted by the rule
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def dump(out_path: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import hf_oracle
    from engine.test_llm_vs_hf import MAX_TOKENS, prompts

    from pagellm.models.loader import default_model_path, eos_token_ids, load_hf_config

    items = prompts.__wrapped__()  # the test's fixture, called directly
    path = default_model_path()
    eos = eos_token_ids(path, load_hf_config(path))
    refs = [hf_oracle.hf_greedy(p["prompt_token_ids"], MAX_TOKENS, eos) for p in items]
    data = {
        "max_tokens": MAX_TOKENS,
        "prompts": [p["prompt_token_ids"] for p in items],
        "references": [{"token_ids": r.token_ids, "top_logprobs": [list(t) for t in r.top_logprobs]} for r in refs],
    }
    Path(out_path).write_text(json.dumps(data))
    print(f"{len(items)} prompts and references -> {out_path}")


def verdict(ours: list[int], our_tops: list[set[int]], ref_ids: list[int], ref_tops: list[list[int]]) -> str:
    """'identical', 'close' (vLLM's rule met at the first difference) or why it fails: the rule of
    tests/hf_oracle.py's check_close, restated on plain lists because this side runs in vLLM's
    environment, which has no pagellm to import."""
    for i, (a, b) in enumerate(zip(ours, ref_ids)):
        if a != b:
            if a not in ref_tops[i]:
                return f"fails at {i}: token {a} not in transformers' top-5"
            if b not in our_tops[i]:
                return f"fails at {i}: transformers' token {b} not in the engine's top-5"
            return "close"
    return "identical" if len(ours) == len(ref_ids) else f"fails: {len(ours)} tokens against {len(ref_ids)}"


def judge(refs_path: str, hf_dir: str, kv_dtypes: list[str]) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    data = json.loads(Path(refs_path).read_text())
    params = SamplingParams(temperature=0.0, max_tokens=data["max_tokens"], logprobs=5)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in data["prompts"]]
    for kv_dtype in kv_dtypes:
        llm = LLM(model=hf_dir, dtype="float32", kv_cache_dtype=kv_dtype, max_model_len=4096, enforce_eager=True, seed=0)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        verdicts = []
        for out, ref in zip(outputs, data["references"]):
            completion = out.outputs[0]
            tops = [set(step) for step in completion.logprobs]
            verdicts.append(verdict(list(completion.token_ids), tops, ref["token_ids"], ref["top_logprobs"]))
        meeting = sum(not v.startswith("fails") for v in verdicts)
        print(
            json.dumps(
                {
                    "kv_cache_dtype": kv_dtype,
                    "identical": verdicts.count("identical"),
                    "meet_rule": meeting,
                    "num_prompts": len(verdicts),
                    "failures": [f"prompt {i}: {v}" for i, v in enumerate(verdicts) if v.startswith("fails")],
                }
            ),
            flush=True,
        )
        del llm


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "dump":
        dump(sys.argv[2])
    elif len(sys.argv) >= 4 and sys.argv[1] == "judge":
        judge(sys.argv[2], sys.argv[3], sys.argv[4:] or ["auto", "fp8_e5m2"])
    else:
        sys.exit(__doc__)
