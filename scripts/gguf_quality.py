"""The 14 prompts of tests/engine/test_llm_vs_hf.py on other GGUF files of the default model (e.g.
llama-quantize's Q4_K_M / Q5_K_M / Q6_K, which CI cannot make): greedy output of the exact path
(``--dtype float32``) and of the default int8 path against transformers' GGUF load of the same
file, by vLLM's rule, with how many stay identical (docs/benchmarks.md).

usage: .venv/bin/python scripts/gguf_quality.py FILE.gguf [FILE.gguf ...]
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import hf_oracle
from engine.test_llm_vs_hf import MAX_TOKENS, PARAMS, prompts

from pagellm import LLM
from pagellm.models.loader import eos_token_ids, load_hf_config


def main() -> None:
    items = prompts.__wrapped__()  # the test's fixture, called directly
    for path in sys.argv[1:]:
        model = hf_oracle.hf_gguf_model(path)
        hf_oracle.hf_model_and_tokenizer = lambda model=model: (model, None)
        eos = eos_token_ids(path, load_hf_config(path))
        references = [hf_oracle.hf_greedy(p["prompt_token_ids"], MAX_TOKENS, eos) for p in items]
        for name, kwargs in (("float32", dict(dtype="float32")), ("default int8", {})):
            outputs = LLM(model=path, **kwargs).generate(items, PARAMS, use_tqdm=False)
            identical = sum(hf_oracle.check_close(o, r, f"{path}/{name}/{i}") for i, (o, r) in enumerate(zip(outputs, references)))
            print(f"{Path(path).name} {name}: vLLM's rule met on {len(items)}/{len(items)}, identical {identical}/{len(items)}", flush=True)


if __name__ == "__main__":
    main()
