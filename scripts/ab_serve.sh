#!/usr/bin/env bash
# Workload R served by two source trees of pagellm in turns (A B A B ...), for before/after figures
# on a noisy machine: each tree's `pagellm serve` is started fresh, measured with pagellm's own
# `bench serve` (64 prompts, 256 random tokens in, 128 out, 32 in flight, all at once, ignore_eos),
# and stopped. Both trees run with this checkout's .venv, each from its own directory (`python -m`
# puts the working directory first on sys.path, ahead of PYTHONPATH, so it picks the tree).
#   scripts/ab_serve.sh OLD_TREE NEW_TREE OUTDIR [ROUNDS]
# e.g. git worktree add /tmp/before <commit>; scripts/ab_serve.sh /tmp/before . /tmp/ab 2
# OLD_ARGS / NEW_ARGS add `pagellm serve` flags for one tree (e.g. NEW_ARGS="--dtype float32").
set -euo pipefail
cd "$(dirname "$0")/.."
py=$(pwd)/.venv/bin/python
[ $# -ge 3 ] || { echo "usage: $0 OLD_TREE NEW_TREE OUTDIR [ROUNDS]" >&2; exit 2; }
trees=("$(cd "$1" && pwd)" "$(cd "$2" && pwd)")
out=$(mkdir -p "$3" && cd "$3" && pwd)
rounds=${4:-2}
mkdir -p "$out"
port=8231

run_one() {  # tree label [serve flags]
  # shellcheck disable=SC2086  # the flags are meant to split into words
  (cd "$1" && PYTHONPATH="$1" exec "$py" -m pagellm.cli serve --port $port ${3:-}) > "$out/$2-server.log" 2>&1 &
  local pid=$!
  until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
    kill -0 $pid 2>/dev/null || { echo "server $2 died; see $out/$2-server.log" >&2; return 1; }
    sleep 0.5
  done
  (cd "$1" && PYTHONPATH="$1" "$py" -m pagellm.cli bench serve --base-url "http://127.0.0.1:$port" \
    --dataset-name random --random-input-len 256 --random-output-len 128 --num-prompts 64 --max-concurrency 32 \
    --request-rate inf --seed 0 --disable-tqdm --save-result --result-dir "$out" --result-filename "$2.json" \
    > "$out/$2.log")
  kill -TERM $pid; wait $pid || true
  grep -m1 -o "engine ready.*" "$out/$2-server.log" | sed "s/^/$2: /" >> "$out/summary.txt" || true  # which code and paths ran
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(f\"{sys.argv[2]}: {r['output_throughput']:.1f} out tok/s, mean TTFT {r['mean_ttft_ms']:.0f} ms, mean TPOT {r['mean_tpot_ms']:.1f} ms\")" "$out/$2.json" "$2" | tee -a "$out/summary.txt"
}

for i in $(seq 1 "$rounds"); do
  run_one "${trees[0]}" "old-$i" "${OLD_ARGS:-}"
  run_one "${trees[1]}" "new-$i" "${NEW_ARGS:-}"
done
