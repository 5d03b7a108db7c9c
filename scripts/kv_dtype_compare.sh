#!/usr/bin/env bash
# The KV cache's element types served in turns (bf16 fp8 int8 bf16 fp8 int8 ...), for ratios on a
# noisy machine: each round starts `pagellm serve --kv-cache-dtype X` fresh for each type, measures
# it with pagellm's own `bench serve` on each workload, and stops it.
#   scripts/kv_dtype_compare.sh OUTDIR [ROUNDS]
# Workloads: R (64 prompts, 256 random tokens in, 128 out, 32 in flight) and long (8 prompts,
# 4,096 in, 128 out, 8 in flight), all at once, ignore_eos.
# Env: KV_DTYPES (default "bfloat16 fp8 int8"), WORKLOADS (default "R long"), SERVE_ARGS (more
# `pagellm serve` flags, e.g. "--dtype float32").
set -euo pipefail
cd "$(dirname "$0")/.."
py=$(pwd)/.venv/bin/python
[ $# -ge 1 ] || { echo "usage: $0 OUTDIR [ROUNDS]" >&2; exit 2; }
out=$(mkdir -p "$1" && cd "$1" && pwd)
rounds=${2:-2}
port=8232
read -r -a dtypes <<< "${KV_DTYPES:-bfloat16 fp8 int8}"
read -r -a workloads <<< "${WORKLOADS:-R long}"

workload_args() {
  case $1 in
    R) echo "--random-input-len 256 --random-output-len 128 --num-prompts 64 --max-concurrency 32" ;;
    long) echo "--random-input-len 4096 --random-output-len 128 --num-prompts 8 --max-concurrency 8" ;;
    *) echo "unknown workload $1" >&2; return 1 ;;
  esac
}

for i in $(seq 1 "$rounds"); do
  for dtype in "${dtypes[@]}"; do
    label="$dtype-$i"
    # shellcheck disable=SC2086  # the flags are meant to split into words
    "$py" -m pagellm.cli serve --port $port --kv-cache-dtype "$dtype" ${SERVE_ARGS:-} > "$out/$label-server.log" 2>&1 &
    pid=$!
    until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
      kill -0 $pid 2>/dev/null || { echo "server $label died; see $out/$label-server.log" >&2; exit 1; }
      sleep 0.5
    done
    for w in "${workloads[@]}"; do
      # shellcheck disable=SC2046
      "$py" -m pagellm.cli bench serve --base-url "http://127.0.0.1:$port" --dataset-name random $(workload_args "$w") \
        --request-rate inf --seed "$i" --disable-tqdm --save-result --result-dir "$out" \
        --result-filename "$w-$label.json" > "$out/$w-$label.log"
      python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(f\"{sys.argv[2]}: {r['output_throughput']:.1f} out tok/s, mean TTFT {r['mean_ttft_ms']:.0f} ms, mean TPOT {r['mean_tpot_ms']:.1f} ms\")" \
        "$out/$w-$label.json" "$w $label" | tee -a "$out/summary.txt"
    done
    grep -m1 -o "KV cache: .*" "$out/$label-server.log" | sed "s/^/$label: /" >> "$out/summary.txt" || true
    kill -TERM $pid; wait $pid || true
  done
done
