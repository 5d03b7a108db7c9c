#!/usr/bin/env bash
# Serving workloads on two source trees of pagellm in turns (A B A B ...), for before/after figures
# on a noisy machine: each tree's `pagellm serve` is started fresh, measured with the NEW tree's
# `bench serve` (ignore_eos, all requests at once), and stopped. Both trees run with this
# checkout's .venv, each from its own directory (`python -m` puts the working directory first on
# sys.path, ahead of PYTHONPATH, so it picks the tree).
#   scripts/ab_serve.sh OLD_TREE NEW_TREE OUTDIR [ROUNDS]
# e.g. git worktree add /tmp/before <commit>; scripts/ab_serve.sh /tmp/before . /tmp/ab 2
# WORKLOADS (default R), any of:
#   R  64 prompts, 256 random tokens in, 128 out, 32 in flight
#   P  64 prompts over 4 shared 512-token prefixes + 64 unique tokens, 64 out, 32 in flight
#   S  32 prompts, 256 in, 64 out, 16 in flight (the load of the peers' scale_bench.sh)
#   1  4 prompts, 256 in, 64 out, one at a time (single stream)
#   L  one 4,096-token prompt, 16 out (its time to first token; serve with --max-model-len 8192)
# MODEL: the checkpoint both serve (default: the packaged SmolLM2-135M). WITH_LLAMACPP=1 also serves
# MODEL with llama.cpp's server (PEERS_DIR, default ../shared/peers; build-llama-cpp.sh) first in
# each round, as the anchor (LLAMACPP_PARALLEL slots, default 32, of LLAMACPP_CTX tokens each, default 1024).
# OLD_ARGS / NEW_ARGS add `pagellm serve` flags for one tree; SKIP_OLD=1 measures only NEW_TREE (and llama.cpp).
# Each server's resident memory once ready (its process tree, GiB) goes to the summary.
set -euo pipefail
cd "$(dirname "$0")/.."
py=$(pwd)/.venv/bin/python
[ $# -ge 3 ] || { echo "usage: $0 OLD_TREE NEW_TREE OUTDIR [ROUNDS]" >&2; exit 2; }
trees=("$(cd "$1" && pwd)" "$(cd "$2" && pwd)")
out=$(mkdir -p "$3" && cd "$3" && pwd)
rounds=${4:-2}
peers=$(readlink -f "${PEERS_DIR:-../shared/peers}")
port=8231

workload() {  # NAME -> bench serve flags
  case $1 in
    R) echo "--dataset-name random --random-input-len 256 --random-output-len 128 --num-prompts 64 --max-concurrency 32" ;;
    P) echo "--dataset-name prefix --prefix-len 512 --suffix-len 64 --num-prefixes 4 --output-len 64 --num-prompts 64 --max-concurrency 32" ;;
    S) echo "--dataset-name random --random-input-len 256 --random-output-len 64 --num-prompts 32 --max-concurrency 16" ;;
    1) echo "--dataset-name random --random-input-len 256 --random-output-len 64 --num-prompts 4 --max-concurrency 1" ;;
    L) echo "--dataset-name random --random-input-len 4096 --random-output-len 16 --num-prompts 1 --max-concurrency 1" ;;
    *) echo "unknown workload $1" >&2; return 1 ;;
  esac
}

measure() {  # server-pid label
  local pid=$1 label=$2 w
  until curl -sf "http://127.0.0.1:$port/health" >/dev/null && curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null; do
    kill -0 "$pid" 2>/dev/null || { echo "server $label died; see $out/$label-server.log" >&2; return 1; }
    sleep 0.5
  done
  local rss_kib
  rss_kib=$(ps -o rss= -p "$pid" $(pgrep -d' ' -P "$pid" | sed 's/^/-p /') 2>/dev/null | awk '{s+=$1} END {print s}')
  python3 -c "import sys; print(f'{sys.argv[1]}: resident once ready {int(sys.argv[2]) / 2**20:.2f} GiB')" "$label" "${rss_kib:-0}" | tee -a "$out/summary.txt"
  for w in ${WORKLOADS:-R}; do
    # shellcheck disable=SC2046  # the workload's flags are meant to split into words
    (cd "${trees[1]}" && PYTHONPATH="${trees[1]}" "$py" -m pagellm.cli bench serve --base-url "http://127.0.0.1:$port" \
      $(workload "$w") --request-rate inf --seed 0 --disable-tqdm --save-result --result-dir "$out" \
      --result-filename "$label-$w.json" > "$out/$label-$w.log")
    python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(f\"{sys.argv[2]}: {r['output_throughput']:.1f} out tok/s, mean TTFT {r['mean_ttft_ms']:.0f} ms, mean TPOT {r['mean_tpot_ms']:.1f} ms\")" "$out/$label-$w.json" "$label-$w" | tee -a "$out/summary.txt"
  done
  kill -TERM "$pid"; wait "$pid" || true
}

run_tree() {  # tree label [serve flags]
  # shellcheck disable=SC2086  # the flags are meant to split into words
  (cd "$1" && PYTHONPATH="$1" exec "$py" -m pagellm.cli serve ${MODEL:-} --port $port ${3:-}) > "$out/$2-server.log" 2>&1 &
  local pid=$!
  measure $pid "$2"
  grep -m1 -o "engine ready.*" "$out/$2-server.log" | sed "s/^/$2: /" >> "$out/summary.txt" || true  # which code and paths ran
}

run_llamacpp() {  # label
  MODEL="${MODEL:?WITH_LLAMACPP needs MODEL}" PARALLEL=${LLAMACPP_PARALLEL:-32} CTX_PER_SLOT=${LLAMACPP_CTX:-1024} "$peers/llama-server-serve.sh" $port > "$out/$1-server.log" 2>&1 &
  measure $! "$1"
}

for i in $(seq 1 "$rounds"); do
  [ "${WITH_LLAMACPP:-0}" = 1 ] && run_llamacpp "llamacpp-$i"
  [ "${SKIP_OLD:-0}" = 1 ] || run_tree "${trees[0]}" "old-$i" "${OLD_ARGS:-}"
  run_tree "${trees[1]}" "new-$i" "${NEW_ARGS:-}"
done
