"""One benchmark request: a prompt of token ids and the exact number of tokens it must generate.

Its own module so that the dataset makers (``datasets``, ``grounded``) share it without importing each other.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SampleRequest:
    prompt_token_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)
