#!/usr/bin/env bash
# The CUDA path's correctness and speed on one GPU, offline (docs/gpu.md).
#   scripts/gpu_check.sh TOKENIZER_DIR [OUT_JSON] [more gpu_check.py flags, e.g. --smoke]
# TOKENIZER_DIR: from `python scripts/export_tokenizer.py build/tokenizer` on a machine with the
# packaged model. Needs torch with CUDA, transformers and triton; no network.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
TOKENIZER=${1:?usage: scripts/gpu_check.sh TOKENIZER_DIR [OUT_JSON] [flags]}
OUT=${2:-gpu_check.json}
shift $(( $# >= 2 ? 2 : 1 ))
# The whole check is planned for under 8 minutes; stop it at 9 rather than hold the machine.
PYTHONPATH=. timeout 540 "$PY" scripts/gpu_check.py --tokenizer "$TOKENIZER" --out "$OUT" "$@"
