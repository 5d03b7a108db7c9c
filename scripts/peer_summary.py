"""The results of scripts/peer_compare.sh as one markdown table per workload, each engine's
output throughput also as a ratio to vLLM's. Usage: python scripts/peer_summary.py OUTDIR"""
from __future__ import annotations

import json
import sys
from pathlib import Path

WORKLOADS = {"random": "R (256 in / 128 out)", "prefix": "P (4 x 512-token prefixes + 64, 64 out)", "variable": "V (256/256 spread)"}
ENGINES = ("vllm", "pagellm", "pagellm-fp32", "llamacpp")


def main(out: Path) -> None:
    for key, title in WORKLOADS.items():
        results = {e: json.loads((out / f"{e}-{key}.json").read_text()) for e in ENGINES if (out / f"{e}-{key}.json").exists()}
        if not results:
            continue
        base = results.get("vllm", {}).get("output_throughput")
        print(f"\n### {title}\n")
        print("| engine | out tok/s | vs vLLM | mean TTFT ms | mean TPOT ms | duration s | completed |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for engine, r in results.items():
            ratio = f"{r['output_throughput'] / base:.2f}x" if base else "-"
            print(
                f"| {engine} | {r['output_throughput']:.1f} | {ratio} | {r['mean_ttft_ms']:.0f} | {r['mean_tpot_ms']:.1f} "
                f"| {r['duration']:.1f} | {r['completed']} |"
            )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
