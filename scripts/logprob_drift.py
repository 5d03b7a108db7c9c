"""How far a GGUF file's default (int8) path scores text from the same file's float32 path.

    .venv/bin/python scripts/logprob_drift.py FILE.gguf [FILE.gguf ...]

Scores 1,500-character chunks of docs/kv_cache.md and README.md (the first 6,000 characters of
each) with ``prompt_logprobs`` on both paths and prints, per file, the tokens scored, the mean
|difference| of a token's logprob and each path's mean loss (nats). Run it from another tree
(``cd TREE && PYTHONPATH=TREE python .../logprob_drift.py``) for a before/after of a kernel.
"""
from __future__ import annotations

import sys
from pathlib import Path

from pagellm import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
CHUNK_CHARS = 1500


def chunks() -> list[str]:
    text = (ROOT / "docs" / "kv_cache.md").read_text()[:6000] + (ROOT / "README.md").read_text()[:6000]
    return [text[i : i + CHUNK_CHARS] for i in range(0, len(text), CHUNK_CHARS)]


def token_logprobs(llm: LLM, prompts: list[str]) -> list[float]:
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    scores = []
    for output in llm.generate(prompts, params):
        for pos, entry in enumerate(output.prompt_logprobs):
            if entry is not None:  # the first token has no logprob
                scores.append(entry[output.prompt_token_ids[pos]].logprob)
    return scores


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__, file=sys.stderr)
        return 2
    prompts = chunks()
    for path in paths:
        exact = token_logprobs(LLM(model=path, dtype="float32"), prompts)
        default = token_logprobs(LLM(model=path), prompts)
        n = len(exact)
        drift = sum(abs(a - b) for a, b in zip(exact, default)) / n
        print(f"{Path(path).name}: {n} tokens, mean |d logprob| {drift:.4f}, "
              f"loss float32 {-sum(exact) / n:.4f} default {-sum(default) / n:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
