#!/usr/bin/env bash
# Workload R on one `pagellm serve`, without and with a JSON schema on every request, in turns.
# The schema (an object holding an array of at least 64 strings) keeps every request under its
# grammar for all 128 tokens: a grammar that may end early would leave the rest unconstrained
# (with ignore_eos). Prefix caching is off: each turn reuses the same random prompts.
#   scripts/structured_output_overhead.sh OUTDIR [TURNS]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: $0 OUTDIR [TURNS]}
turns=${2:-3}
port=8232
mkdir -p "$out"
.venv/bin/pagellm serve --port $port --no-enable-prefix-caching --disable-uvicorn-access-log > "$out/server.log" 2>&1 &
pid=$!
trap 'kill -TERM $pid 2>/dev/null; wait $pid 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
  kill -0 $pid 2>/dev/null || { echo "server died; see $out/server.log" >&2; exit 1; }
  sleep 0.5
done
schema='{"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object",
  "properties": {"items": {"type": "array", "items": {"type": "string"}, "minItems": 64}}, "required": ["items"]}}}}'
run() {  # name [extra args...]
  local name=$1; shift
  .venv/bin/pagellm --log-level warning bench serve --base-url "http://127.0.0.1:$port" --dataset-name random \
    --random-input-len 256 --random-output-len 128 --num-prompts 64 --max-concurrency 32 --request-rate inf \
    --seed 0 --disable-tqdm --save-result --result-dir "$out" --result-filename "$name.json" "$@" > "$out/$name.log"
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(f\"{sys.argv[2]}: {r['output_throughput']:.1f} out tok/s, mean TTFT {r['mean_ttft_ms']:.0f} ms, mean TPOT {r['mean_tpot_ms']:.1f} ms\")" "$out/$name.json" "$name" | tee -a "$out/summary.txt"
}
run warmup --num-prompts 16
for i in $(seq 1 "$turns"); do
  run "plain-$i"
  run "schema-$i" --extra-body "$schema"
done
