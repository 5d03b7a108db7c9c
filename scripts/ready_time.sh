#!/usr/bin/env bash
# Seconds from launching a server to its first answers on /health and /v1/models, polled every
# 50 ms (scale_bench.sh polls once a second), for pagellm and llama.cpp's server in turns.
#   scripts/ready_time.sh MODEL [ROUNDS]      e.g. scripts/ready_time.sh /tmp/models/rand-smollm2-1.7b-Q4_K_M.gguf 3
# Each line also gives the time to the first answer of a chat completion (one token) sent at once
# after ready: what a client that starts the server and talks to it waits.
# OLD_TREE=DIR also times another source tree of pagellm (run with this checkout's .venv) in each
# round. llama.cpp needs ../shared/peers (PEERS_DIR) and its build-llama-cpp.sh; it serves one slot
# of 2,048 tokens unless PARALLEL and CTX_PER_SLOT say otherwise (16 and 1024: scale_bench.sh's load).
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:?usage: ready_time.sh MODEL [ROUNDS]}
rounds=${2:-3}
peers=$(readlink -f "${PEERS_DIR:-../shared/peers}")
py=$PWD/.venv/bin/python
port=8391
time_one() {  # label command...
  local label=$1
  shift
  local t0 pid
  t0=$(date +%s.%N)
  "$@" > "/tmp/ready-$label.log" 2>&1 &
  pid=$!
  until curl -sf "http://127.0.0.1:$port/health" >/dev/null && curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null; do
    kill -0 $pid 2>/dev/null || { echo "$label died; see /tmp/ready-$label.log" >&2; return 1; }
    sleep 0.05
  done
  local t_ready served
  t_ready=$(date +%s.%N)
  served=$(curl -sf "http://127.0.0.1:$port/v1/models" | python3 -c "import json, sys; print(json.load(sys.stdin)['data'][0]['id'])")
  curl -sf "http://127.0.0.1:$port/v1/chat/completions" -H 'Content-Type: application/json' \
    -d '{"model": "'"$served"'", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}' >/dev/null || echo "$label: the chat request failed" >&2
  python3 -c "import sys, time; t0, t1 = map(float, sys.argv[2:]); print(f'{sys.argv[1]}: ready in {t1 - t0:.2f} s, first chat answer at {time.time() - t0:.2f} s')" "$label" "$t0" "$t_ready"
  kill $pid
  wait $pid 2>/dev/null || true
}
serve_tree() {  # tree: `python -m` puts the working directory first on sys.path, so it picks the tree
  cd "$1" && PYTHONPATH="$1" exec "$py" -m pagellm.cli serve "$model" --host 127.0.0.1 --port $port --max-model-len 2048
}
for _ in $(seq 1 "$rounds"); do
  time_one llamacpp env MODEL="$model" PARALLEL="${PARALLEL:-1}" CTX_PER_SLOT="${CTX_PER_SLOT:-2048}" "$peers/llama-server-serve.sh" $port
  [ -z "${OLD_TREE:-}" ] || time_one pagellm-old serve_tree "$(cd "$OLD_TREE" && pwd)"
  time_one pagellm serve_tree "$PWD"
done
