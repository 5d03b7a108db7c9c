"""The tiny random checkpoints of tests/models/test_architectures.py (with SmolLM2's vocabulary),
converted by llama.cpp's own converter (outside this repository: PEERS_DIR's download, see
docs/benchmarks.md), loaded by pagellm and compared with transformers on the original weights.
The suite checks the same through tests/models/gguf_writer.py, which CI can run; this checks that
writer's conventions against the converter itself.

The hybrid architectures (Qwen3-Next, Qwen3.5 dense and MoE: tests/models/test_gguf_hybrid_names.py's
checkpoints) are checked at the tensor level, as their model classes may not exist yet: the
converter's file (f32, q8_0, and f32 with --fuse-qkv --fuse-gate-up-exps) read by pagellm's GGUF
loader against the safetensors original, the config against the checkpoint's, and the test
writer's file against the converter's, tensor by tensor and key by key.

usage: python scripts/check_llamacpp_gguf.py [NAME ...]   (default: every architecture of both kinds)
"""
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests" / "models"), str(REPO / "tests")]
from gguf_writer import write_gguf  # noqa: E402
from model_utils import PagedDriver, make_random_hf_model  # noqa: E402
from test_architectures import CONFIGS, GGUF_CONFIGS  # noqa: E402
from test_gguf_hybrid_names import _CONFIG_FIELDS  # noqa: E402
from test_gguf_hybrid_names import CONFIGS as HYBRID_CONFIGS  # noqa: E402

from pagellm.attention.torch_ref import TorchReferenceBackend  # noqa: E402
from pagellm.layers.gguf_types import GGUFWeight  # noqa: E402
from pagellm.models.gguf_config import load_gguf_config  # noqa: E402
from pagellm.models.gguf_loader import GGUFFile, iter_gguf_weights  # noqa: E402
from pagellm.models.loader import default_model_path, load_hf_config, load_model  # noqa: E402

SRC = "/tmp/peers/dl/llama_cpp_python-0.3.36/vendor/llama.cpp"  # what ../shared/peers/ downloads
PYTHON = next(p for p in ("/tmp/peers/hf-venv/bin/python", str(REPO / ".venv" / "bin" / "python")) if Path(p).exists())
WORK = Path("/tmp/llamacpp-gguf-check")
TOK_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")
VOCAB = 49152


def tokenizer_dir() -> Path:
    """SmolLM2's tokenizer files: a local HF download if there is one, else transformers' read of
    the default model's GGUF vocabulary, saved once."""
    local = Path("/tmp/models/smollm2-135m-instruct")
    if (local / "tokenizer.json").exists():
        return local
    out = WORK / "tokenizer"
    if not (out / "tokenizer.json").exists():
        from transformers import AutoTokenizer

        path = Path(default_model_path())
        AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(str(out))
    return out


# transformers gives a qwen3_5_moe_text directory Qwen3.5's own tokenizer class whatever its files
# say, which re-splits SmolLM2's vocabulary into a pre-tokenizer the converter does not know: the
# converter runs with the files' class kept (the vocabulary only, no tensor, depends on it).
# (The Qwen3 family's converter tries sentencepiece first: the logit checks need it installed, as
# /tmp/peers/hf-venv has it; pagellm's .venv does not.)
_CONVERT = """
import runpy, sys
from transformers.models.auto import tokenization_auto as t
t.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS.discard("qwen3_5_moe_text")
t.TOKENIZER_MAPPING_NAMES["qwen3_5_moe_text"] = "TokenizersBackend"
sys.argv = sys.argv[1:]
sys.path.insert(0, sys.argv[0].rsplit("/", 1)[0])
runpy.run_path(sys.argv[0], run_name="__main__")
"""


# The converter takes Gemma 4 only with a tokenizer in Gemma's format: the suite's small one (1,024 tokens).
GEMMA4_TOKENIZER = REPO / "tests" / "tokenizer" / "fixtures" / "gemma4" / "hf"
GEMMA4_VOCAB = 1024


def convert(d: Path, out: Path, *flags: str, tokenizer: Path | None = None) -> str | None:
    """Runs the converter; None on success, else its last error line."""
    tokenizer = tokenizer or tokenizer_dir()
    for f in (*TOK_FILES, "chat_template.jinja"):
        if (tokenizer / f).exists():
            shutil.copy(tokenizer / f, d / f)
    cmd = [PYTHON, "-c", _CONVERT, f"{SRC}/convert_hf_to_gguf.py", str(d), "--outfile", str(out), *flags]
    r = subprocess.run(cmd, env={"PYTHONPATH": f"{SRC}/gguf-py", "PATH": "/usr/bin:/bin"}, capture_output=True, text=True)
    return r.stderr.strip().splitlines()[-1] if r.returncode else None


def check_logits(name: str) -> None:
    config = CONFIGS[name][0]()
    gemma4 = config.model_type == "gemma4_text"
    vocab = GEMMA4_VOCAB if gemma4 else VOCAB
    config.vocab_size = vocab
    config.bos_token_id, config.eos_token_id = (2, 1) if gemma4 else (1, 2)
    if hasattr(config, "pad_token_id"):
        config.pad_token_id = 0 if gemma4 else 2
    if gemma4 and config.hidden_size_per_layer_input:
        config.vocab_size_per_layer_input = vocab
    d = WORK / name
    shutil.rmtree(d, ignore_errors=True)
    hf = make_random_hf_model(config, seed=1)
    hf.save_pretrained(d)
    out = d / "model-f32.gguf"
    if err := convert(d, out, "--outtype", "f32", tokenizer=GEMMA4_TOKENIZER if gemma4 else None):
        print(name, "the converter failed:", err)
        return
    lc = load_hf_config(str(out))
    model = load_model(str(out), lc, torch.float32, torch.device("cpu"), TorchReferenceBackend())
    rng = random.Random(0)
    toks = [rng.randrange(vocab) for _ in range(24)]
    with torch.no_grad():
        ref = hf(torch.tensor([toks])).logits[0]
    lg = PagedDriver(model, lc, block_size=4).step([(0, toks)])
    print(name, lc.architectures, f"max |logit diff| = {(lg - ref).abs().max().item():.2e}")


def _shifted_or_log(name: str) -> bool:
    """Tensors the converter rounds in float32 (1 + w norms, -exp(A_log))."""
    return name.endswith("A_log") or (name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"))


def _loader_vs_checkpoint(gguf_path: Path, original: dict[str, torch.Tensor], quantized: bool) -> list[str]:
    """What differs between pagellm's read of the converter's file and the safetensors checkpoint."""
    problems = []
    ours = dict(iter_gguf_weights(str(gguf_path), load_gguf_config(str(gguf_path))))
    if set(ours) != set(original):
        problems.append(f"names: missing {sorted(set(original) - set(ours))}, extra {sorted(set(ours) - set(original))}")
    in_blocks = 0
    for name in sorted(set(ours) & set(original)):
        tensor, want = ours[name], original[name]
        in_blocks += isinstance(tensor, GGUFWeight)
        got = tensor.dequantize() if isinstance(tensor, GGUFWeight) else tensor.float()
        if tuple(got.shape) != tuple(want.shape):
            got = got.reshape(want.shape) if got.numel() == want.numel() and isinstance(tensor, GGUFWeight) else got
        if tuple(got.shape) != tuple(want.shape):
            problems.append(f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
            continue
        diff = (got - want).abs().max().item()
        limit = 4e-3 if quantized else 2.4e-7 if _shifted_or_log(name) else 0.0
        if diff > limit:
            problems.append(f"{name}: max |diff| {diff:.2e}")
    if quantized and in_blocks == 0:
        problems.append("no tensor stayed in its blocks")
    return problems


def _config_vs_checkpoint(gguf_path: Path, hf_config) -> list[str]:
    ours = load_gguf_config(str(gguf_path))
    problems = [
        f"{f}: {getattr(ours, f, None)!r} != {getattr(hf_config, f)!r}"
        for f in _CONFIG_FIELDS
        if hasattr(hf_config, f) and getattr(ours, f, None) != getattr(hf_config, f)
    ]
    for key in ("rope_type", "rope_theta", "partial_rotary_factor"):
        if ours.rope_parameters.get(key) != hf_config.rope_parameters.get(key):
            problems.append(f"rope_parameters[{key}]: {ours.rope_parameters.get(key)!r} != {hf_config.rope_parameters.get(key)!r}")
    return problems


def _writer_vs_converter(ours: Path, theirs: Path) -> list[str]:
    """The test writer's file against the converter's: tensor names, shapes, types and values, and
    every architecture key the writer writes."""
    a, b = GGUFFile(str(ours)), GGUFFile(str(theirs))
    problems = []
    if set(a.tensors) != set(b.tensors):
        problems.append(f"tensors only in the writer's: {sorted(set(a.tensors) - set(b.tensors))}, "
                        f"only in the converter's: {sorted(set(b.tensors) - set(a.tensors))}")
    for name in sorted(set(a.tensors) & set(b.tensors)):
        ta, tb = a.tensors[name], b.tensors[name]
        if (ta.shape, ta.ggml_type) != (tb.shape, tb.ggml_type):
            problems.append(f"{name}: {ta.shape} {ta.ggml_type.name} != {tb.shape} {tb.ggml_type.name}")
        elif not torch.equal(a.dequantized(name), b.dequantized(name)):
            problems.append(f"{name}: values differ (max {(a.dequantized(name) - b.dequantized(name)).abs().max().item():.2e})")
    arch = a.architecture
    for key, value in a.metadata.items():
        if key.startswith(f"{arch}.") and key not in ("general.name",):
            other = b.metadata.get(key)
            same = np.allclose(value, other) if isinstance(value, (float, list)) and other is not None else value == other
            if not same:
                problems.append(f"{key}: writer {value!r}, converter {other!r}")
    return problems


def check_hybrid(name: str) -> None:
    from safetensors.torch import load_file
    from transformers import AutoConfig

    model_type, fields = HYBRID_CONFIGS[name]
    config = AutoConfig.for_model(model_type, **dict(fields, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=2))
    d = WORK / name
    shutil.rmtree(d, ignore_errors=True)
    make_random_hf_model(config, seed=1).save_pretrained(d)
    hf_config = AutoConfig.from_pretrained(d)
    original = load_file(str(d / "model.safetensors"))
    for label, flags, quantized in (
        ("f32", ("--outtype", "f32"), False),
        ("q8_0", ("--outtype", "q8_0"), True),
        ("f32 --fuse-qkv --fuse-gate-up-exps", ("--outtype", "f32", "--fuse-qkv", "--fuse-gate-up-exps"), False),
    ):
        out = d / f"model-{label.replace(' ', '').replace('--', '-')}.gguf"
        if err := convert(d, out, *flags, "--no-mtp"):
            print(f"{name} [{label}]: the converter failed: {err}")
            continue
        problems = _loader_vs_checkpoint(out, original, quantized) + _config_vs_checkpoint(out, hf_config)
        if not quantized:  # the converter's q8_0 picks its own tensors; the writer's Q8_0 is the suite's choice
            fused = "fuse" in label
            mine = write_gguf(d, hf_config, out.with_name("writer-" + out.name), fuse_qkv=fused, fuse_gate_up_exps=fused)
            problems += [f"writer: {p}" for p in _writer_vs_converter(mine, out)]
        names = {n for n, _ in iter_gguf_weights(str(out), load_gguf_config(str(out)))}
        print(f"{name} [{label}] ({GGUFFile(str(out)).architecture}, {len(names)} HF tensors):", "OK" if not problems else "")
        for p in problems:
            print("   ", p)


if __name__ == "__main__":
    wanted = sys.argv[1:] or [*GGUF_CONFIGS, *HYBRID_CONFIGS]
    for name in wanted:
        if name in HYBRID_CONFIGS:
            check_hybrid(name)
        else:
            check_logits(name)
