"""``grounded``: prompts whose answers copy spans of the prompt (repeat, correct, summarise a text).

What n-gram speculation is for: each prompt is a chat request about a passage of real English
(the Python language reference that ships with CPython, ``pydoc_data.topics``, so nothing is
downloaded), cut to about ``input_len`` tokens. The tasks take turns: repeat the passage
verbatim, correct the typos put into it, or summarise it in its own words.
"""
from __future__ import annotations

import random
from typing import Any

from pagellm.bench.sample_request import SampleRequest

TASKS = (
    "Repeat the following text exactly, word for word:\n\n{text}",
    "The following text has a few typos. Write it out again with the typos corrected:\n\n{text}",
    "Summarize the following text, quoting its key sentences:\n\n{text}",
)


def _passages() -> list[str]:
    from pydoc_data.topics import topics

    paragraphs = []
    for name in sorted(topics):
        for para in topics[name].split("\n\n"):
            para = " ".join(para.split())
            # Prose, not code listings or grammar rules.
            if len(para) > 200 and para.count("::=") == 0 and not para.startswith((">>>", "$")):
                paragraphs.append(para)
    return paragraphs


def _add_typos(text: str, rng: random.Random, rate: float = 0.03) -> str:
    words = text.split(" ")
    for i, w in enumerate(words):
        if len(w) > 3 and w.isalpha() and rng.random() < rate:
            j = rng.randrange(len(w) - 1)
            words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2 :]
    return " ".join(words)


def grounded_dataset(num_prompts: int, input_len: int, output_len: int, tokenizer: Any, seed: int = 0) -> list[SampleRequest]:
    """``num_prompts`` chat prompts of about ``input_len`` tokens (template included)."""
    from pagellm.tokenizer import apply_chat_template

    if num_prompts < 1 or input_len < 32 or output_len < 1:
        raise ValueError(
            f"grounded prompts need num_prompts >= 1, input_len >= 32, output_len >= 1; got {num_prompts}, {input_len}, {output_len}"
        )
    rng = random.Random(seed)
    paragraphs = _passages()
    samples = []
    for i in range(num_prompts):
        task = TASKS[i % len(TASKS)]
        start = rng.randrange(len(paragraphs))
        text, ids = "", []
        for k in range(len(paragraphs)):
            candidate = (text + "\n\n" + paragraphs[(start + k) % len(paragraphs)]).strip()
            body = _add_typos(candidate, random.Random(seed + i)) if i % len(TASKS) == 1 else candidate
            candidate_ids = apply_chat_template(tokenizer, [{"role": "user", "content": task.format(text=body)}])
            if ids and len(candidate_ids) > input_len:
                break
            text, ids = candidate, candidate_ids
        words = text.split(" ")
        while len(ids) > input_len and len(words) > 1:  # one paragraph alone too long: cut its words
            words = words[: len(words) * 3 // 4]
            ids = apply_chat_template(tokenizer, [{"role": "user", "content": task.format(text=" ".join(words))}])
        samples.append(SampleRequest(ids, output_len))
    return samples
