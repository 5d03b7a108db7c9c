"""Structured output: grammar-constrained decoding (JSON schema, regex, choice, EBNF) via xgrammar.

``backend`` compiles and caches grammars, ``request_state`` follows one request through its
grammar, ``manager`` masks a whole batch's logits each step.
"""
from pagellm.structured_output.backend import XgrammarBackend
from pagellm.structured_output.manager import StructuredOutputManager

__all__ = ["StructuredOutputManager", "XgrammarBackend"]
