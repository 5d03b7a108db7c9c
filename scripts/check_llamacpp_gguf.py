"""The tiny random checkpoints of tests/models/test_architectures.py (with SmolLM2's vocabulary),
converted by llama.cpp's own converter (outside this repository: PEERS_DIR's download, see
docs/benchmarks.md), loaded by pagellm and compared with transformers on the original weights.
The suite checks the same through tests/models/gguf_writer.py, which CI can run; this checks that
writer's conventions against the converter itself.

usage: python scripts/check_llamacpp_gguf.py
"""
import random
import shutil
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests" / "models"), str(REPO / "tests")]
from model_utils import PagedDriver, make_random_hf_model  # noqa: E402
from test_architectures import CONFIGS, GGUF_CONFIGS  # noqa: E402

from pagellm.attention.torch_ref import TorchReferenceBackend  # noqa: E402
from pagellm.models.loader import load_hf_config, load_model  # noqa: E402

SRC = "/tmp/peers/dl/llama_cpp_python-0.3.36/vendor/llama.cpp"  # what ../shared/peers/ downloads
TOK = Path("/tmp/models/smollm2-135m-instruct")
for name in GGUF_CONFIGS:
    config = CONFIGS[name][0]()
    config.vocab_size = 49152
    config.bos_token_id, config.eos_token_id = 1, 2
    if hasattr(config, "pad_token_id"):
        config.pad_token_id = 2
    d = Path(f"/tmp/llamacpp-gguf-check/{name}")
    shutil.rmtree(d, ignore_errors=True)
    hf = make_random_hf_model(config, seed=1)
    hf.save_pretrained(d)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt"):
        if (TOK / f).exists():
            shutil.copy(TOK / f, d / f)
    out = d / "model-f32.gguf"
    r = subprocess.run(["/tmp/peers/hf-venv/bin/python", f"{SRC}/convert_hf_to_gguf.py", str(d), "--outtype", "f32", "--outfile", str(out)],
                       env={"PYTHONPATH": f"{SRC}/gguf-py", "PATH": "/usr/bin:/bin"}, capture_output=True, text=True)
    if r.returncode:
        print(name, "the converter failed:", r.stderr.strip().splitlines()[-1])
        continue
    lc = load_hf_config(str(out))
    model = load_model(str(out), lc, torch.float32, torch.device("cpu"), TorchReferenceBackend())
    rng = random.Random(0)
    toks = [rng.randrange(49152) for _ in range(24)]
    with torch.no_grad():
        ref = hf(torch.tensor([toks])).logits[0]
    lg = PagedDriver(model, lc, block_size=4).step([(0, toks)])
    print(name, lc.architectures, f"max |logit diff| = {(lg - ref).abs().max().item():.2e}")
