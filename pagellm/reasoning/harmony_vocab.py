"""The o200k_base vocabulary file that ``openai_harmony`` needs, found or made without the internet.

Harmony loads ``o200k_base.tiktoken`` (lines ``base64(token bytes) rank``) from
``TIKTOKEN_ENCODINGS_BASE`` and checks its sha256, else downloads it. This module looks for a good
copy (that variable's folder, the virtual environment's ``share/tiktoken`` where
``scripts/fetch_o200k.sh`` puts one, the user's cache), or writes one from a gpt-oss model's own
Hugging Face tokenizer, whose byte-level BPE vocabulary holds the same tokens; then it points the
variable there and loads the encoding.
"""

from __future__ import annotations

import base64
import hashlib
import os
import sys
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

FILE_NAME = "o200k_base.tiktoken"
SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
NUM_RANKS = 199998  # ranks 0..199997: the mergeable tokens; the special tokens come after


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as a printable character (printable Latin-1 bytes as
    themselves, the others shifted past 255), as byte-level BPE vocabularies write their tokens."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shift)
            shift += 1
    return table


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def candidate_dirs() -> list[Path]:
    dirs = []
    if base := os.environ.get("TIKTOKEN_ENCODINGS_BASE"):
        dirs.append(Path(base))
    dirs.append(Path(sys.prefix) / "share" / "tiktoken")
    dirs.append(cache_dir())
    return dirs


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagellm" / "tiktoken"


def find_o200k() -> Optional[Path]:
    """The folder of a good ``o200k_base.tiktoken``, None if none is at hand."""
    for d in candidate_dirs():
        path = d / FILE_NAME
        if path.is_file() and sha256_of(path) == SHA256:
            return d
    return None


def o200k_lines_from_vocab(vocab: dict[str, int]) -> bytes:
    """The tiktoken file's bytes from a byte-level BPE vocabulary (token string -> id, ids = ranks)."""
    to_byte = {ch: b for b, ch in byte_to_unicode().items()}
    by_rank: dict[int, str] = {}
    for token, rank in vocab.items():
        if 0 <= rank < NUM_RANKS:
            by_rank[rank] = token
    missing = [r for r in range(NUM_RANKS) if r not in by_rank]
    if missing:
        raise ValueError(
            f"the tokenizer's vocabulary lacks {len(missing)} of o200k's {NUM_RANKS} ranks (first: {missing[0]}); is it gpt-oss's?"
        )
    out = []
    for rank in range(NUM_RANKS):
        try:
            raw = bytes(to_byte[ch] for ch in by_rank[rank])
        except KeyError:
            raise ValueError(f"token {by_rank[rank]!r} (id {rank}) is not byte-level BPE text; is the tokenizer gpt-oss's?") from None
        out.append(base64.b64encode(raw) + b" " + str(rank).encode() + b"\n")
    return b"".join(out)


def write_o200k(tokenizer: Any, directory: Path) -> Path:
    """Writes ``o200k_base.tiktoken`` into ``directory`` from a gpt-oss HF tokenizer; returns the folder."""
    data = o200k_lines_from_vocab(dict(tokenizer.get_vocab()))
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHA256:
        raise ValueError(
            f"the o200k_base file made from this tokenizer has sha256 {digest}, not {SHA256}: it is not gpt-oss's o200k vocabulary"
        )
    directory.mkdir(parents=True, exist_ok=True)
    # Written aside and renamed, so that a reader never sees half a file.
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=FILE_NAME + ".")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, directory / FILE_NAME)
    return directory


def ensure_o200k(tokenizer: Any = None) -> Path:
    """The folder of a good o200k file: found, or written from ``tokenizer`` into the user's cache."""
    found = find_o200k()
    if found is not None:
        return found
    if tokenizer is not None and hasattr(tokenizer, "get_vocab"):
        return write_o200k(tokenizer, cache_dir())
    raise ValueError(
        f"harmony (gpt-oss) needs {FILE_NAME} with sha256 {SHA256}; none was found in "
        f"{', '.join(str(d) for d in candidate_dirs())}. Run scripts/fetch_o200k.sh, set TIKTOKEN_ENCODINGS_BASE "
        "to a folder holding it, or load a gpt-oss model (its tokenizer is converted)."
    )


@lru_cache(maxsize=1)
def _load(directory: str) -> Any:
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    os.environ["TIKTOKEN_ENCODINGS_BASE"] = directory
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def harmony_encoding(tokenizer: Any = None) -> Any:
    """gpt-oss's harmony encoding, loaded from a local o200k file (see ``ensure_o200k``)."""
    return _load(str(ensure_o200k(tokenizer)))
