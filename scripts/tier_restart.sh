#!/usr/bin/env bash
# A long prefix across a restart, with the disk tier: the time to first token of one request whose
# PREFIX_LEN-token prompt (default 8000) is computed cold, then, after a clean restart of the server
# on the same --kv-offloading-dir, read back from disk; and whether the greedy outputs are the same.
#   scripts/tier_restart.sh OUTDIR
# MODEL (default: the packaged SmolLM2-135M), EXTRA (more `pagellm serve` flags, e.g. "--dtype float32"),
# ROUNDS (default 2: cold, restart, cold, restart, ...; each cold run starts from an empty directory).
set -euo pipefail
cd "$(dirname "$0")/.."
py=$(pwd)/.venv/bin/python
out=$(mkdir -p "$1" && cd "$1" && pwd)
port=${PORT:-8251}
len=${PREFIX_LEN:-8000}
tier="$out/tier"

serve() {  # label
  # shellcheck disable=SC2086  # MODEL and EXTRA split into words
  "$py" -m pagellm.cli serve ${MODEL:-} --port "$port" --max-model-len $((len + 64)) --kv-offloading-backend native \
    --kv-offloading-size 4 --kv-offloading-dir "$tier" --disable-uvicorn-access-log ${EXTRA:-} > "$out/$1-server.log" 2>&1 &
  pid=$!
  until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
    kill -0 $pid 2>/dev/null || { echo "server died: $out/$1-server.log" >&2; exit 1; }
    sleep 0.5
  done
}

ask() {  # label -> TTFT, cached tokens and the greedy tokens, one line of JSON appended to results.jsonl
  "$py" - "$port" "$len" "$1" >> "$out/results.jsonl" <<'EOF'
import json, sys, time, httpx, numpy as np
port, n, label = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
prompt = np.random.default_rng(0).integers(100, 40000, size=n).tolist()
body = {"prompt": prompt, "max_tokens": 16, "temperature": 0.0, "stream": True, "logprobs": 0,
        "return_tokens_as_token_ids": True, "stream_options": {"include_usage": True}}
t0, ttft, tokens, cached = time.perf_counter(), None, [], None
with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=3600) as r:
    for line in r.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        for c in chunk.get("choices", []):
            if ttft is None and c.get("text") is not None:
                ttft = time.perf_counter() - t0
            tokens += [int(t.split(":")[1]) for t in (c.get("logprobs") or {}).get("tokens", [])]
        if chunk.get("usage"):
            cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
print(json.dumps({"label": label, "ttft_s": ttft, "cached_tokens": cached, "tokens": tokens}))
EOF
}

rm -f "$out/results.jsonl"
for i in $(seq 1 "${ROUNDS:-2}"); do
  rm -rf "$tier"
  serve "cold-$i"; ask "cold-$i"; kill -TERM $pid; wait $pid || true   # the clean stop writes the prefix to disk
  serve "restart-$i"; ask "restart-$i"; kill -TERM $pid; wait $pid || true
done
"$py" - "$out/results.jsonl" <<'EOF' | tee "$out/summary.txt"
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
cold = [r for r in rows if r["label"].startswith("cold")]
for r in rows:
    same = r["tokens"] == cold[0]["tokens"]
    print(f"{r['label']:<12} TTFT {r['ttft_s']:.2f} s   cached {r['cached_tokens']:>5}   greedy same as cold-1: {same}")
warm = [r for r in rows if r["label"].startswith("restart")]
ratios = [c["ttft_s"] / w["ttft_s"] for c, w in zip(cold, warm)]
print("cold / restart TTFT, pair by pair: " + ", ".join(f"{x:.1f}x" for x in ratios))
EOF
