#!/usr/bin/env bash
# The KV offloading tier on a multi-turn agent load whose prefixes outgrow the KV budget
# (`pagellm bench agent`): on each checkpoint in MODELS, in turns, the same load against
#   notier    pagellm serve, prefix caching only
#   tier      pagellm serve --kv-offloading-backend native --kv-offloading-size TIER_GIB --kv-offloading-dir OUT/tier/LABEL
#             (the directory emptied first, so no run starts with an earlier run's blocks)
#   tier-ram  the same tier in host memory (no --kv-offloading-dir); not run unless named in SERVERS
#   llamacpp  llama.cpp's llama-server (PEERS_DIR/llama-server-serve.sh) with --cache-ram CACHE_RAM_MIB (default 8192,
#             as TIER_GIB), the anchor
#   llamacpp-noram  the same with --cache-ram 0 (no prompt cache beyond its slots); not run unless named in SERVERS
# each with the same KV budget in tokens: pagellm --num-kv-blocks KV_TOKENS/16 (exact, whatever the
# model's bytes per token), llama.cpp LLAMACPP_SLOTS slots of KV_TOKENS/LLAMACPP_SLOTS tokens (-c KV_TOKENS).
#   scripts/tier_bench.sh OUTDIR [ROUNDS]
# e.g. MODELS="default /tmp/models/rand-smollm2-1.7b-Q4_K_M.gguf" scripts/tier_bench.sh /tmp/tier 1
# MODELS (or MODEL): GGUF files, "default" = the packaged SmolLM2-135M (the default).
# The load (bench agent's flags): SESSIONS (32), TURNS (8), DOCS (4), DOC_LEN (2000), DOC_SHARE (0.5),
#   SYSTEM_LEN (64), TURN_LEN (128), OUTPUT_LEN (32), CONCURRENCY (2), SEED (0).
# KV_TOKENS: the budget (default: the load's working set / RATIO, RATIO default 6, raised where needed so that
#   each slot holds the longest prompt plus its output). SERVERS (default "notier tier llamacpp").
# Results: OUT/<model>-<server>-<round>.json and .log, the server logs, and OUT/summary.txt. The tier's
# directory is removed after its run unless KEEP_TIER=1 (it holds up to TIER_GIB).
# A server that does not start, or a load that fails, is noted in the summary and the script goes on.
set -uo pipefail
cd "$(dirname "$0")/.."
py=$(pwd)/.venv/bin/python
[ $# -ge 1 ] || { echo "usage: $0 OUTDIR [ROUNDS]" >&2; exit 2; }
out=$(mkdir -p "$1" && cd "$1" && pwd)
rounds=${2:-1}
peers=$(readlink -f "${PEERS_DIR:-../shared/peers}")
port=${PORT:-8241}
block=16
slots=${LLAMACPP_SLOTS:-${CONCURRENCY:-2}}
servers=${SERVERS:-notier tier llamacpp}
models=${MODELS:-${MODEL:-default}}
default_model=$("$py" -c "from pagellm.models.loader import default_model_path; print(default_model_path())")
agent_flags="--num-sessions ${SESSIONS:-32} --num-turns ${TURNS:-8} --num-documents ${DOCS:-4} --document-len ${DOC_LEN:-2000}
  --document-share ${DOC_SHARE:-0.5} --system-len ${SYSTEM_LEN:-64} --turn-len ${TURN_LEN:-128} --output-len ${OUTPUT_LEN:-32}
  --max-concurrency ${CONCURRENCY:-2} --seed ${SEED:-0}"

# The load's sizes (no server), then the budget: working set / RATIO, 256-token steps per slot, each slot
# at least the longest prompt plus its output (pagellm's --max-model-len, llama.cpp's context per slot).
# shellcheck disable=SC2086  # the flags are meant to split into words
"$py" -m pagellm.cli bench agent $agent_flags --dry-run --save-result "$out/workload.json" > /dev/null || exit 1
read -r working longest < <(python3 -c "import json,sys; w=json.load(open(sys.argv[1]))['workload']; print(w['working_set_tokens'], w['max_prompt_len'] + w['output_len'])" "$out/workload.json")
# Whole multiples of 256 tokens per slot: llama.cpp rounds a slot's context to them.
step=256
per_slot_min=$(( (longest + step - 1) / step * step ))
if [ -n "${KV_TOKENS:-}" ]; then kv=$KV_TOKENS; else kv=$(python3 -c "print(round($working / ${RATIO:-6}))"); fi
per_slot=$(( (kv / slots + step / 2) / step * step ))
if [ "$per_slot" -lt "$per_slot_min" ]; then
  echo "note: $slots slots of $per_slot tokens cannot hold the longest prompt + output ($longest); raised to $per_slot_min per slot" >&2
  per_slot=$per_slot_min
fi
kv=$((per_slot * slots))
{
  echo "# $(date -u +%FT%TZ) $(git rev-parse --short HEAD) $(uname -n), $(nproc) cores"
  echo "# load: $(echo $agent_flags)"
  echo "# working set $working prompt tokens; KV budget $kv tokens ($slots x $per_slot) = working set / $(python3 -c "print(f'{$working / $kv:.2f}')")"
} | tee -a "$out/summary.txt"

wait_ready() {  # pid label -> 0 once /v1/models answers, 1 if the server died or took over READY_TIMEOUT s
  local pid=$1 label=$2 t0=$SECONDS
  until curl -sf "http://127.0.0.1:$port/health" >/dev/null && curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null; do
    if ! kill -0 "$pid" 2>/dev/null || [ $((SECONDS - t0)) -gt "${READY_TIMEOUT:-600}" ]; then
      echo "$label: server did not start; see $out/$label-server.log" | tee -a "$out/summary.txt"
      tail -3 "$out/$label-server.log" | sed 's/^/    /' | tee -a "$out/summary.txt"
      return 1
    fi
    sleep 0.5
  done
}

stop() {  # pid
  kill -TERM "$1" 2>/dev/null
  for _ in $(seq 1 60); do kill -0 "$1" 2>/dev/null || break; sleep 0.5; done
  kill -KILL "$1" 2>/dev/null
  wait "$1" 2>/dev/null
  return 0
}

measure() {  # pid label tokenizer
  local pid=$1 label=$2
  if wait_ready "$pid" "$label"; then
    # shellcheck disable=SC2086
    if ! "$py" -m pagellm.cli bench agent --base-url "http://127.0.0.1:$port" $agent_flags --tokenizer "$3" \
        --kv-budget-tokens "$kv" --label "$label" --disable-tqdm --save-result "$out/$label.json" > "$out/$label.log" 2>&1; then
      echo "$label: the load failed; see $out/$label.log" | tee -a "$out/summary.txt"
      tail -3 "$out/$label.log" | sed 's/^/    /' | tee -a "$out/summary.txt"
    fi
    # The server's resident memory once the load is done (its process tree): what a tier adds, if anything.
    local rss_kib
    rss_kib=$(ps -o rss= -p "$pid" $(pgrep -d' ' -P "$pid" | sed 's/^/-p /') 2>/dev/null | awk '{s+=$1} END {print s}')
    python3 -c "import sys; print(f'{sys.argv[1]}: resident after the load {int(sys.argv[2]) / 2**20:.2f} GiB')" "$label" "${rss_kib:-0}" \
      | tee -a "$out/summary.txt"
  fi
  stop "$pid"
}

run_pagellm() {  # model label [serve flags]
  # shellcheck disable=SC2086  # the flags are meant to split into words
  "$py" -m pagellm.cli serve "$1" --port "$port" --num-kv-blocks $((kv / block)) --block-size $block \
    --max-model-len "$per_slot" ${PAGELLM_ARGS:-} ${3:-} > "$out/$2-server.log" 2>&1 &
  measure $! "$2" "$1"
}

run_llamacpp() {  # model label cache-ram-MiB
  [ -x /tmp/peers/llamacpp-build/bin/llama-server ] || { echo "$2: no llama-server (build-llama-server.sh)" | tee -a "$out/summary.txt"; return; }
  MODEL="$1" PARALLEL=$slots CTX_PER_SLOT=$per_slot ALIAS=$(basename "$1" .gguf) LLAMA_ARG_CACHE_RAM=$3 \
    "$peers/llama-server-serve.sh" "$port" > "$out/$2-server.log" 2>&1 &
  measure $! "$2" "$1"
}

for r in $(seq 1 "$rounds"); do
  for m in $models; do
    [ "$m" = default ] && m=$default_model
    name=$(basename "$m" .gguf)
    for s in $servers; do
      label="$name-$s-$r"
      case $s in
        notier) run_pagellm "$m" "$label" ;;
        tier) rm -rf "$out/tier/$label"; mkdir -p "$out/tier"
              run_pagellm "$m" "$label" "--kv-offloading-backend native --kv-offloading-size ${TIER_GIB:-8} --kv-offloading-dir $out/tier/$label"
              du -sh "$out/tier/$label" 2>/dev/null | sed "s|^|$label: tier on disk |" | tee -a "$out/summary.txt"
              [ "${KEEP_TIER:-0}" = 1 ] || rm -rf "$out/tier/$label" ;;
        tier-ram) run_pagellm "$m" "$label" "--kv-offloading-backend native --kv-offloading-size ${TIER_GIB:-8}" ;;
        llamacpp) run_llamacpp "$m" "$label" "${CACHE_RAM_MIB:-8192}" ;;
        llamacpp-noram) run_llamacpp "$m" "$label" 0 ;;
        *) echo "unknown server $s" >&2 ;;
      esac
    done
  done
done

# The table: one line per run, in the order run.
python3 - "$out" $(for r in $(seq 1 "$rounds"); do for m in $models; do [ "$m" = default ] && m=$default_model
  for s in $servers; do echo "$(basename "$m" .gguf)-$s-$r"; done; done; done) <<'EOF' | tee -a "$out/summary.txt"
import json, os, sys
out, labels = sys.argv[1], sys.argv[2:]
pct = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"
rows = [("run", "done/failed", "hit share", "ideal", "later turns", "mean TTFT ms", "p90 TTFT ms", "mean E2E ms", "wall s", "cached from")]
for label in labels:
    path = os.path.join(out, label + ".json")
    if not os.path.exists(path):
        rows.append((label,) + ("-",) * 9)
        continue
    r = json.load(open(path))
    rows.append((label, f"{r['completed']}/{r['failed']}", pct(r["prefix_hit_share"]), pct(r["ideal_hit_share"]),
                 pct(r["later_turns"]["prefix_hit_share"]), f"{r['mean_ttft_ms']:.0f}", f"{r['p90_ttft_ms']:.0f}",
                 f"{r['mean_e2el_ms']:.0f}", f"{r['duration_s']:.1f}", "+".join(sorted(r["cached_tokens_source"])) or "-"))
widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
for row in rows:
    print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
EOF
