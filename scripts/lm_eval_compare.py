"""Two lm-eval runs of the same task compared item by item (say the bfloat16 and an 8-bit KV cache).

    python scripts/lm_eval_compare.py RUN_A RUN_B [--task pagellm_mc]

RUN_* are --output_path directories of `lm_eval ... --log_samples` (scripts/lm_eval_check.sh's
OUT_API). For acc and acc_norm: both scores, B - A in points, the items where exactly one run is
right, and the standard error of the paired difference (sqrt(discordant) / n points x 100: the
items both get right or both wrong carry no information about the difference).
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os


def load_samples(run_dir: str, task: str) -> dict[int, dict]:
    paths = glob.glob(f"{run_dir}/**/samples_{task}_*.jsonl", recursive=True)
    if not paths:
        raise SystemExit(f"no samples_{task}_*.jsonl under {run_dir}")
    with open(max(paths, key=os.path.getmtime)) as f:
        return {s["doc_id"]: s for s in map(json.loads, f)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_a")
    ap.add_argument("run_b")
    ap.add_argument("--task", default="pagellm_mc")
    args = ap.parse_args()
    a, b = load_samples(args.run_a, args.task), load_samples(args.run_b, args.task)
    if set(a) != set(b):
        raise SystemExit(f"the runs scored different items ({len(a)} and {len(b)})")
    n = len(a)
    print(f"{n} items: A = {args.run_a}, B = {args.run_b}")
    for metric in ("acc", "acc_norm"):
        score_a = sum(s[metric] for s in a.values())
        score_b = sum(s[metric] for s in b.values())
        only_a = sum(1 for i in a if a[i][metric] > b[i][metric])
        only_b = sum(1 for i in a if b[i][metric] > a[i][metric])
        se = 100 * math.sqrt(only_a + only_b) / n
        print(f"{metric:9s} A {100 * score_a / n:6.2f}  B {100 * score_b / n:6.2f}  B - A {100 * (score_b - score_a) / n:+.2f} points "
              f"(+- {se:.2f} standard error; right in A only {only_a}, in B only {only_b})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
