#!/usr/bin/env bash
# pagellm against vLLM's CPU build, on this machine, in one run, with vLLM's own `bench serve`
# client ($PEERS_DIR/peer_bench.sh): workloads R (64 x 256 in / 128 out), P (4 shared
# 512-token prefixes + 64 unique, 64 out) and V (256 in/out spread 10%..190%), 32 in flight.
# Then pagellm's own `bench serve` on the same server, and the MFU of every run against the
# fp32 matmul peak (the higher of one measured before pagellm's runs and one right after).
#
# Needs PEERS_DIR: a folder OUTSIDE this repository (default ../shared/peers, relative to the repo
# root; set PEERS_DIR to use another) holding the reference-engine scripts this one calls:
# vllm-serve.sh (starts vLLM's CPU build) and peer_bench.sh (runs vLLM's `bench serve` client).
# They are not part of pagellm; set them up first as their README.md says (the model as an HF
# directory in /tmp/models/smollm2-135m-instruct, vLLM in /tmp/peers/vllm-venv).
# Usage: [PEERS_DIR=DIR] scripts/peer_compare.sh OUTDIR [skip-vllm]
# PAGELLM_SERVE_ARGS adds flags to `pagellm serve` (e.g. "--kv-cache-dtype float16").
# VLLM_DTYPE: vLLM's --dtype (default bfloat16 on a CPU with AVX512_BF16, where it is vLLM's best,
# else float32). PAGELLM_FLOAT32=1 (default) also serves `pagellm serve --dtype float32` (the exact
# path) as "pagellm-fp32". WITH_LLAMACPP=1 also runs llama.cpp's llama-server (llamacpp-install.sh,
# the same GGUF file, 2 threads, 32 slots) on R and P. summary.md tables every run against vLLM.
#
# AVX2_ONLY=1 measures this machine as one without AVX-512 (the issue's reference class): torch,
# MKL and oneDNN are held to AVX2 and pagellm's kernels are built for x86-64-v3, so the servers
# and the matmul peak in mfu.txt all run on AVX2 and FMA only (vLLM's own C++ kernels excepted).
set -euo pipefail
if [ "${AVX2_ONLY:-0}" = 1 ]; then
  export ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 PAGELLM_CPU_ARCH=x86-64-v3
fi
# A PEERS_DIR given as a relative path counts from where the script was called; the default
# counts from the repository root.
case "${PEERS_DIR:-}" in ''|/*) ;; *) PEERS_DIR=$PWD/$PEERS_DIR ;; esac
cd "$(dirname "$0")/.."
out=${1:?usage: [PEERS_DIR=DIR] peer_compare.sh OUTDIR [skip-vllm]}
PEERS_DIR=${PEERS_DIR:-$(pwd)/../shared/peers}
need=(peer_bench.sh)
[ "${2:-}" = skip-vllm ] || need+=(vllm-serve.sh)
for f in "${need[@]}"; do
  if [ ! -f "$PEERS_DIR/$f" ]; then
    cat >&2 <<EOF
peer_compare.sh: $PEERS_DIR/$f not found.
It needs PEERS_DIR (now '$PEERS_DIR'): the reference-engine scripts that live
outside this repository (peer_bench.sh, and vllm-serve.sh unless skip-vllm), with vLLM's CPU build
and the model installed as that folder's README.md says. Point PEERS_DIR at your copy, e.g.
  PEERS_DIR=/path/to/peers scripts/peer_compare.sh $out
EOF
    exit 2
  fi
done
peers=$(cd "$PEERS_DIR" && pwd)
mkdir -p "$out"

wait_ready() {  # port pid -> seconds until /health answers 200
  local start=$SECONDS
  until curl -sf "http://127.0.0.1:$1/health" >/dev/null; do
    kill -0 "$2" 2>/dev/null || { echo "server on port $1 died" >&2; return 1; }
    sleep 0.5
  done
  echo $((SECONDS - start))
}

if [ -z "${VLLM_DTYPE:-}" ]; then
  if grep -qw avx512_bf16 /proc/cpuinfo; then VLLM_DTYPE=bfloat16; else VLLM_DTYPE=float32; fi
fi
echo "vLLM --dtype $VLLM_DTYPE" > "$out/vllm-dtype.txt"
if [ "${2:-}" != skip-vllm ]; then
  DTYPE=$VLLM_DTYPE bash "$peers/vllm-serve.sh" 8100 > "$out/vllm-server.log" 2>&1 &
  vpid=$!
  echo "vLLM ready after $(wait_ready 8100 $vpid) s" | tee "$out/vllm-ready.txt"
  WITH_V=1 bash "$peers/peer_bench.sh" vllm 8100 "$out"
  kill -TERM $vpid; wait $vpid || true
fi

# The peak now and again after the runs; MFU is rated against the higher (the machine drifts).
.venv/bin/pagellm bench mfu | tee "$out/peak-before.txt"
peak_before=$(sed -n 's/.*: \([0-9.]*\) GFLOP\/s$/\1/p' "$out/peak-before.txt")
# shellcheck disable=SC2086  # the extra flags are meant to split into words
.venv/bin/pagellm serve --port 8000 ${PAGELLM_SERVE_ARGS:-} > "$out/pagellm-server.log" 2>&1 &
ppid=$!
echo "pagellm ready after $(wait_ready 8000 $ppid) s" | tee "$out/pagellm-ready.txt"
WITH_V=1 bash "$peers/peer_bench.sh" pagellm 8000 "$out"
.venv/bin/pagellm bench serve --base-url http://127.0.0.1:8000 --dataset-name random --random-input-len 256 \
  --random-output-len 128 --num-prompts 64 --max-concurrency 32 --request-rate inf --seed 0 --disable-tqdm \
  --save-result --result-dir "$out" --result-filename pagellm-own-random.json > "$out/pagellm-own-random.log"
kill -TERM $ppid; wait $ppid || true

if [ "${PAGELLM_FLOAT32:-1}" = 1 ]; then
  # shellcheck disable=SC2086
  .venv/bin/pagellm serve --port 8000 --dtype float32 ${PAGELLM_SERVE_ARGS:-} > "$out/pagellm-fp32-server.log" 2>&1 &
  ppid=$!
  echo "pagellm --dtype float32 ready after $(wait_ready 8000 $ppid) s" | tee "$out/pagellm-fp32-ready.txt"
  WITH_V=1 bash "$peers/peer_bench.sh" pagellm-fp32 8000 "$out"
  kill -TERM $ppid; wait $ppid || true
fi

if [ "${WITH_LLAMACPP:-0}" = 1 ]; then
  # One HTTP thread per client: with its default pool, 32 clients got connections reset.
  LLAMA_ARG_THREADS_HTTP=40 PARALLEL=32 CTX_PER_SLOT=1024 THREADS=2 bash "$peers/llama-server-serve.sh" 8201 > "$out/llamacpp-server.log" 2>&1 &
  lpid=$!
  echo "llama.cpp ready after $(wait_ready 8201 $lpid) s" | tee "$out/llamacpp-ready.txt"
  bash "$peers/peer_bench.sh" llamacpp 8201 "$out"
  kill -TERM $lpid; wait $lpid || true
fi

.venv/bin/python scripts/peer_summary.py "$out" | tee "$out/summary.md"

.venv/bin/pagellm bench mfu --peak-floor "$peak_before" --result "$out"/*-random.json "$out"/*-prefix.json "$out"/*-variable.json | tee "$out/mfu.txt"
