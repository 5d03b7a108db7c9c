#!/usr/bin/env bash
# A server's first start with an empty packed-weights cache (docs/kernels.md, "Packed weights kept
# between starts"): seconds to /health, to the answer of a one-token chat sent at once, then a
# 32-token completion, and how long the server takes to exit after it (it finishes the file first).
#   scripts/first_start.sh MODEL [ROUNDS]     e.g. scripts/first_start.sh /tmp/models/rand-smollm2-1.7b 2
# OLD_TREE=DIR also times another source tree of pagellm in each round (this checkout's .venv; its
# kernels built under OLD_KERNEL_DIR, default /tmp/first-start-old-kernels, so the builds keep apart).
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:?usage: first_start.sh MODEL [ROUNDS]}
rounds=${2:-1}
port=8395
pagellm=$PWD/.venv/bin/pagellm
one() {  # label [env...]
  local label=$1
  shift
  local dir
  dir=$(mktemp -d /tmp/first-start-pack.XXXXXX)
  local t0 t1 t2 t3 t4 pid served
  t0=$(date +%s.%N)
  env PAGELLM_PACKED_WEIGHT_CACHE="$dir" "$@" "$pagellm" serve "$model" --host 127.0.0.1 --port $port \
    --max-model-len 2048 > "/tmp/first-start-$label.log" 2>&1 &
  pid=$!
  until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
    kill -0 $pid 2>/dev/null || { echo "$label died; see /tmp/first-start-$label.log" >&2; return 1; }
    sleep 0.05
  done
  t1=$(date +%s.%N)
  served=$(curl -sf "http://127.0.0.1:$port/v1/models" | python3 -c "import json, sys; print(json.load(sys.stdin)['data'][0]['id'])")
  curl -sf "http://127.0.0.1:$port/v1/chat/completions" -H 'Content-Type: application/json' \
    -d '{"model": "'"$served"'", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}' >/dev/null
  t2=$(date +%s.%N)
  curl -sf "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
    -d '{"model": "'"$served"'", "prompt": "Once upon a time", "max_tokens": 32, "ignore_eos": true}' >/dev/null
  t3=$(date +%s.%N)
  kill $pid
  wait $pid 2>/dev/null || true
  t4=$(date +%s.%N)
  python3 - "$label" "$dir" "$t0" "$t1" "$t2" "$t3" "$t4" <<'PY'
import sys
from pathlib import Path
label, folder, *t = sys.argv[1:]
t = [float(x) for x in t]
mib = sum(f.stat().st_size for f in Path(folder).glob("*.pack")) / 2**20
print(f"{label}: ready {t[1] - t[0]:.2f} s, first chat answer {t[2] - t[0]:.2f} s, then 32 tokens in {t[3] - t[2]:.2f} s, "
      f"exit after {t[4] - t[3]:.2f} s; file {mib:.0f} MiB")
PY
  rm -rf "$dir"
}
for _ in $(seq 1 "$rounds"); do
  if [ -n "${OLD_TREE:-}" ]; then
    one old PYTHONPATH="$(cd "$OLD_TREE" && pwd)" PAGELLM_CACHE_DIR="${OLD_KERNEL_DIR:-/tmp/first-start-old-kernels}"
  fi
  one new
done
