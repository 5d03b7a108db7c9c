"""The harmony encoding for tests: o200k_base.tiktoken from .venv/share/tiktoken (scripts/fetch_o200k.sh puts it
there), else the test skips with the reason."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from pagellm.reasoning.harmony_vocab import FILE_NAME, SHA256, sha256_of

SHARE = Path(sys.prefix) / "share" / "tiktoken"


def harmony_or_skip(monkeypatch: pytest.MonkeyPatch) -> Any:
    path = SHARE / FILE_NAME
    if not path.is_file() or sha256_of(path) != SHA256:
        pytest.skip(f"{path} is absent (or not o200k_base): run scripts/fetch_o200k.sh to test gpt-oss's harmony parsing")
    monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", str(SHARE))
    from pagellm.reasoning.harmony_vocab import harmony_encoding

    return harmony_encoding()
