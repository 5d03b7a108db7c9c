#!/usr/bin/env bash
# pagellm against llama.cpp's server and vLLM on checkpoints of the sizes people serve, one engine at
# a time on a quiet machine, with the peers' scale_bench.sh (vLLM's own `bench serve` client; time
# to ready and resident memory of the process tree): docs/benchmarks.md, the sections per CPU.
# usage: scripts/scale_compare.sh OUTDIR [STEPS]   STEPS: any of q4km q4km1 bf16 big (default: all)
# Needs ../shared/peers (PEERS_DIR): build-llama-cpp.sh, make-scale-models.sh (BIG=1 for the 8B),
# vllm-install.sh for the bf16 step.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p "${1:?usage: scale_compare.sh OUTDIR [STEPS]}"
out=$(readlink -f "$1")
steps=${2:-"q4km q4km1 bf16 big"}
peers=$(readlink -f "${PEERS_DIR:-../shared/peers}")
M=/tmp/models
export PAGELLM_VENV=$PWD/.venv
run() {  # ENGINE MODEL TAG [env...]
  local engine=$1 model=$2 tag=$3
  shift 3
  env "$@" "$peers/scale_bench.sh" "$engine" "$model" 8311 "$out/$tag" | tail -1
}
bandwidth() {  # GB/s this machine reads: the sum of a 2 GiB float32 tensor, best of 5
  "$PAGELLM_VENV/bin/python" - <<'PY'
import time, torch
x = torch.ones(2**29)
best = min((lambda t0: (x.sum(), time.perf_counter() - t0)[1])(time.perf_counter()) for _ in range(5))
print(f"{x.numel() * 4 / best / 1e9:.1f}")
PY
}
echo "memory read bandwidth (GB/s): $(bandwidth)" | tee "$out/bandwidth.txt"
for step in $steps; do
  case $step in
    q4km)  # 1.7B shape Q4_K_M, 16 in flight
      run llamacpp $M/rand-smollm2-1.7b-Q4_K_M.gguf q4km
      run pagellm $M/rand-smollm2-1.7b-Q4_K_M.gguf q4km ;;
    q4km1)  # the same file, one stream: time per output token
      run llamacpp $M/rand-smollm2-1.7b-Q4_K_M.gguf q4km1 NUM=6 CONC=1
      run pagellm $M/rand-smollm2-1.7b-Q4_K_M.gguf q4km1 NUM=6 CONC=1 ;;
    bf16)  # 1.7B shape bf16 safetensors against vLLM in bfloat16
      run vllm $M/rand-smollm2-1.7b bf16
      run pagellm $M/rand-smollm2-1.7b bf16 ;;
    big)  # Llama-3.1-8B's body in Q4_K_M, 4 in flight
      run llamacpp $M/rand-llama-8b-Q4_K_M.gguf big NUM=8 CONC=4 OUT=32
      run pagellm $M/rand-llama-8b-Q4_K_M.gguf big NUM=8 CONC=4 OUT=32 ;;
  esac
done
