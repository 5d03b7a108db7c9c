"""xgrammar behind a small interface: a request's spec in, a compiled grammar (cached) out.

Compiling a JSON schema is costly (more so the larger the schema), so grammars are compiled once per distinct
spec text and kept in an LRU; a spec that cannot compile is the user's error (ValueError -> 400).
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

from pagellm.sampling_params import StructuredOutputsParams

# Distinct grammars kept compiled; a JSON schema's grammar is tens of KiB.
GRAMMAR_CACHE_SIZE = 256


def _ebnf_literal(text: str) -> str:
    return json.dumps(text)  # a JSON string literal is a valid GBNF string literal


class XgrammarBackend:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: set[int]) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.vocab_size = vocab_size
        hf_tokenizer = getattr(tokenizer, "hf", tokenizer)  # xgrammar reads a transformers tokenizer
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids) or None
        )
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()  # compile runs on the engine thread, but tests call it from others

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar for ``spec``; ValueError saying why when it cannot compile."""
        key = spec.cache_key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiled = self._compile(*key)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, kind: str, text: str) -> Any:
        try:
            if kind == "json":
                return self.compiler.compile_json_schema(text, any_whitespace=False)
            if kind == "json_object":
                # OpenAI's json_object is an object (the builtin JSON grammar also allows arrays
                # and scalars), with compact whitespace so that it cannot run on in blank lines.
                return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return self.compiler.compile_regex(text)
            if kind == "choice":
                choices = json.loads(text)
                return self.compiler.compile_grammar("root ::= " + " | ".join(_ebnf_literal(c) for c in choices))
            if kind == "grammar":
                return self.compiler.compile_grammar(text)
            if kind == "structural_tag":
                return self.compiler.compile_structural_tag(text)
        except (RuntimeError, ValueError, TypeError) as e:
            # xgrammar reports bad schemas and grammars as RuntimeError("[time] file:line: reason").
            reason = str(e).split(": ", 1)[-1] if str(e).startswith("[") else str(e)
            raise ValueError(f"invalid {kind.replace('_', ' ')} for structured output: {reason}") from None
        raise ValueError(f"unknown structured output kind {kind!r}")

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def allocate_bitmask(self, num_rows: int) -> Any:
        return self.xgr.allocate_token_bitmask(num_rows, self.vocab_size)

    def apply_bitmask(self, logits: Any, bitmask: Any, indices: list[int]) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=indices)
