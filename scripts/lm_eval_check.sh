#!/usr/bin/env bash
# lm-evaluation-harness against `pagellm serve`, checked against lm-eval's own HF backend on the same weights.
#
#   scripts/lm_eval_check.sh            # from anywhere; idempotent (venv, HF weights reused when present)
#
# 1. a separate venv (default /tmp/lmeval-venv; the project's .venv is untouched): torch 2.13.0 (CPU),
#    lm-eval[api] 0.4.13, transformers 5.19.0, gguf, accelerate
# 2. the packaged SmolLM2-135M-Instruct GGUF (Q4_1) dequantized to an fp32 HF directory with
#    /work/shared/peers/convert_gguf_to_hf.py (paths rewritten; output under $WORK, not in the repo)
# 3. the local task scripts/lm_eval_task (pagellm_mc: 300 seeded four-way multiple-choice items; no download)
# 4. lm_eval --model hf (fp32, CPU, batch 8) and lm_eval --model local-completions against
#    `pagellm serve` (started here on $PORT, stopped at exit); prints acc / acc_norm of both, the
#    differences, and per-item agreement; exits 1 when acc or acc_norm differ by more than 0.5 points.
# Env: LMEVAL_VENV, LMEVAL_WORK (default /tmp/lmeval), PORT (default 18231), SERVE_ARGS (
#      `pagellm serve` flags; default "--dtype float32", the exact path the 0.5-point check is for;
#      SERVE_ARGS="" scores the default int8 path), SKIP_HF=1 (reuse the last HF result in $WORK/out_hf), LIMIT (items, for a smoke run),
#      OUT_API (default $WORK/out_api: where pagellm's samples go; scripts/lm_eval_compare.py compares two such runs),
#      NUM_ITEMS (default 300: the committed items; more writes the same 300 and further ones under $WORK, for finer comparisons),
#      SERVE_CMD (another OpenAI-compatible server to score instead of `pagellm serve`, run by bash with $PORT set; e.g.
#      SERVE_CMD='EAGER=1 exec ../shared/peers/vllm-serve.sh $PORT --kv-cache-dtype fp8_e4m3' for vLLM's own fp8 cache).
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
VENV=${LMEVAL_VENV:-/tmp/lmeval-venv}
WORK=${LMEVAL_WORK:-/tmp/lmeval}
PORT=${PORT:-18231}
HF_DIR=$WORK/smollm2-135m-instruct-hf
CONVERTER=${CONVERTER:-/work/shared/peers/convert_gguf_to_hf.py}
PAGELLM=$REPO/.venv/bin/pagellm
TASK=pagellm_mc
NUM_ITEMS=${NUM_ITEMS:-300}
TASK_DIR=scripts/lm_eval_task
OUT_HF=$WORK/out_hf
OUT_API=${OUT_API:-$WORK/out_api}
LIMIT_ARGS=()
[[ -n "${LIMIT:-}" ]] && LIMIT_ARGS=(--limit "$LIMIT")
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$WORK"
T0=$(date +%s)

# 1. venv
if ! "$VENV/bin/python" -c "import lm_eval, transformers, gguf, accelerate, torch, tenacity, aiohttp" 2>/dev/null; then
  echo "== creating $VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "torch==2.13.0"   # the CPU build, found on local disk; never another torch spec
  "$VENV/bin/pip" install -q "lm-eval[api]==0.4.13" "transformers==5.19.0" gguf accelerate "torch==2.13.0"
fi
"$VENV/bin/python" -c "import torch, transformers, lm_eval.api; print('venv: torch', torch.__version__, 'transformers', transformers.__version__)"

# 2. HF weights (fp32, dequantized from the GGUF pagellm serves)
GGUF=$("$REPO/.venv/bin/python" -c "from pagellm.models.loader import default_model_path; print(default_model_path())")
if [[ ! -f "$HF_DIR/model.safetensors" ]]; then
  echo "== converting $GGUF -> $HF_DIR"
  sed -e "s#^SRC_DIR = .*#SRC_DIR = \"$(dirname "$GGUF")\"#" -e "s#^NAME = .*#NAME = \"$(basename "$GGUF")\"#" \
      -e "s#^OUT = .*#OUT = \"$HF_DIR\"#" "$CONVERTER" > "$WORK/convert.py"
  "$VENV/bin/python" "$WORK/convert.py" > "$WORK/convert.log" 2>&1 || { tail -20 "$WORK/convert.log"; exit 1; }
fi

# 3. task items (deterministic; rewrites the committed JSONL with identical bytes)
"$VENV/bin/python" scripts/lm_eval_task/make_items.py
if [[ "$NUM_ITEMS" != 300 ]]; then
  TASK_DIR=$WORK/task_$NUM_ITEMS
  OUT_HF=$WORK/out_hf_$NUM_ITEMS
  mkdir -p "$TASK_DIR"
  "$VENV/bin/python" scripts/lm_eval_task/make_items.py "$TASK_DIR/items.jsonl" --num-items "$NUM_ITEMS"
  sed "s#scripts/lm_eval_task/items.jsonl#$TASK_DIR/items.jsonl#" scripts/lm_eval_task/pagellm_mc.yaml > "$TASK_DIR/pagellm_mc.yaml"
fi

# 4a. lm-eval's HF backend
if [[ "${SKIP_HF:-0}" != 1 || ! -d "$OUT_HF" ]]; then
  echo "== lm_eval --model hf"
  rm -rf "$OUT_HF"
  T=$(date +%s)
  "$VENV/bin/lm_eval" --model hf --model_args "pretrained=$HF_DIR,dtype=float32" --tasks $TASK \
    --include_path "$TASK_DIR" --device cpu --batch_size 8 "${LIMIT_ARGS[@]}" \
    --output_path "$OUT_HF" --log_samples > "$WORK/hf.log" 2>&1 || { tail -30 "$WORK/hf.log"; exit 1; }
  echo "hf: $(( $(date +%s) - T )) s"
fi

# 4b. lm-eval's local-completions backend against pagellm serve
SERVE_ARGS=${SERVE_ARGS---dtype float32}
if [[ -n "${SERVE_CMD:-}" ]]; then
  echo "== $SERVE_CMD (PORT=$PORT)"
  PORT=$PORT bash -c "$SERVE_CMD" > "$WORK/serve.log" 2>&1 &
else
  echo "== pagellm serve --port $PORT $SERVE_ARGS"
  "$PAGELLM" serve --port "$PORT" --disable-uvicorn-access-log $SERVE_ARGS > "$WORK/serve.log" 2>&1 &
fi
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do  # vLLM takes minutes to be ready
  curl -sf "http://127.0.0.1:$PORT/v1/models" > /dev/null && break
  kill -0 $SERVER 2>/dev/null || { tail -30 "$WORK/serve.log"; exit 1; }
  sleep 1
done
MODEL=$(curl -sf "http://127.0.0.1:$PORT/v1/models" | "$VENV/bin/python" -c "import json,sys; print(json.load(sys.stdin)['data'][0]['id'])")
echo "== lm_eval --model local-completions (model $MODEL)"
rm -rf "$OUT_API"
T=$(date +%s)
"$VENV/bin/lm_eval" --model local-completions \
  --model_args "model=$MODEL,base_url=http://127.0.0.1:$PORT/v1/completions,tokenizer=$HF_DIR,tokenizer_backend=huggingface,num_concurrent=8,max_retries=3" \
  --tasks $TASK --include_path "$TASK_DIR" "${LIMIT_ARGS[@]}" \
  --output_path "$OUT_API" --log_samples > "$WORK/api.log" 2>&1 || { tail -30 "$WORK/api.log"; exit 1; }
echo "local-completions: $(( $(date +%s) - T )) s"
kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true
trap - EXIT

# compare
"$VENV/bin/python" - "$OUT_HF" "$OUT_API" $TASK <<'PY'
import glob, json, os, sys
hf_dir, api_dir, task = sys.argv[1:4]
def load(d):
    res = max(glob.glob(f"{d}/**/results_*.json", recursive=True), key=os.path.getmtime)
    smp = max(glob.glob(f"{d}/**/samples_{task}_*.jsonl", recursive=True), key=os.path.getmtime)
    r = json.load(open(res))["results"][task]
    samples = {}
    for line in open(smp):
        s = json.loads(line)
        samples[s["doc_id"]] = s
    return r, samples
(rh, sh), (ra, sa) = load(hf_dir), load(api_dir)
n = len(sh)
assert set(sh) == set(sa), "different items"
fail = False
for m in ("acc", "acc_norm"):
    h, a = rh[f"{m},none"], ra[f"{m},none"]
    d = 100 * (a - h)
    fail |= abs(d) > 0.5
    print(f"{m:9s} hf {100*h:6.2f}   served {100*a:6.2f}   diff {d:+.2f} points")
same = {m: sum(sh[i][m] == sa[i][m] for i in sh) for m in ("acc", "acc_norm")}
dl = [abs(float(x[0][0]) - float(y[0][0])) for i in sh for x, y in zip(sh[i]["resps"], sa[i]["resps"])]
print(f"items {n}; per-item agreement acc {same['acc']}/{n}, acc_norm {same['acc_norm']}/{n}; "
      f"choice loglikelihood |hf - served|: max {max(dl):.4f}, mean {sum(dl)/len(dl):.4f} nats over {len(dl)} choices")
print("RESULT:", "FAIL (more than 0.5 points apart)" if fail else "OK (within 0.5 points)")
sys.exit(1 if fail else 0)
PY
echo "total: $(( $(date +%s) - T0 )) s"
