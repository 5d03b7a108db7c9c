#!/usr/bin/env bash
# A server's resident memory (VmRSS, RssAnon, RssFile from /proc) 1 s after /health answers, and
# after one chat answer of 8 tokens once it stops growing (the server faults its KV cache in while
# idle, at a rate that varies with the machine): what `pagellm serve MODEL` holds at most.
#   scripts/serve_rss.sh MODEL [serve flags...]     e.g. scripts/serve_rss.sh /tmp/models/rand-smollm2-1.7b-Q4_K_M.gguf --no-packed-weight-cache
# TREE=DIR measures another source tree of pagellm with this checkout's .venv (`python -m` puts the
# working directory first on sys.path, so it picks the tree).
set -euo pipefail
cd "$(dirname "$0")/.."
py=$PWD/.venv/bin/python
model=${1:?usage: serve_rss.sh MODEL [serve flags...]}
shift
tree=$(cd "${TREE:-.}" && pwd)
port=${PORT:-8394}
(cd "$tree" && PYTHONPATH="$tree" exec "$py" -m pagellm.cli serve "$model" --host 127.0.0.1 --port "$port" --max-model-len 2048 "$@") \
  > /tmp/serve_rss.log 2>&1 &
pid=$!
until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
  kill -0 $pid 2>/dev/null || { echo "the server died; see /tmp/serve_rss.log" >&2; exit 1; }
  sleep 0.1
done
rss() { grep -E "VmRSS|RssAnon|RssFile" /proc/$pid/status | awk '{printf "%s %.2f GiB  ", $1, $2 / 1048576}'; }
sleep 1
after_ready=$(rss)
served=$(curl -sf "http://127.0.0.1:$port/v1/models" | python3 -c "import json, sys; print(json.load(sys.stdin)['data'][0]['id'])")
curl -sf "http://127.0.0.1:$port/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"model": "'"$served"'", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}' >/dev/null
vmrss() { awk '/VmRSS/ {print $2}' /proc/$pid/status; }
last=0
for _ in $(seq 1 120); do  # settled: under 8 MiB more in half a second, or 60 s
  sleep 0.5
  now=$(vmrss)
  [ $((now - last)) -lt 8192 ] && break
  last=$now
done
echo "$tree $*: after ready: $after_ready"
echo "$tree $*: after a chat, settled:  $(rss)"
kill $pid
wait $pid 2>/dev/null || true
