#!/usr/bin/env bash
# Puts o200k_base.tiktoken (what openai_harmony needs for gpt-oss, checked by its sha256) into
# .venv/share/tiktoken, made from the npm package js-tiktoken's copy of the ranks: harmony itself
# would download it at run time. Idempotent; without npm it warns and exits 0 (the tests that need
# the file then skip).
set -euo pipefail
cd "$(dirname "$0")/.."
SHA=446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d
DEST=.venv/share/tiktoken
OUT=$DEST/o200k_base.tiktoken
PY=${PYTHON:-.venv/bin/python}
if [ -f "$OUT" ] && [ "$(sha256sum "$OUT" | cut -d' ' -f1)" = "$SHA" ]; then
  exit 0
fi
if ! command -v npm >/dev/null 2>&1; then
  echo "fetch_o200k.sh: npm not found; $OUT not made (the gpt-oss harmony tests will skip)" >&2
  exit 0
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
# A registry that cannot be reached costs the harmony tests (they skip), never the setup.
if ! (cd "$TMP" && timeout 300 npm pack --silent js-tiktoken@1.0.21 >/dev/null && tar xzf js-tiktoken-1.0.21.tgz); then
  echo "fetch_o200k.sh: could not fetch js-tiktoken from npm; $OUT not made (the gpt-oss harmony tests will skip)" >&2
  exit 0
fi
mkdir -p "$DEST"
# The ranks file is `export default {...}` whose bpe_ranks holds lines "FIRST OFFSET tok tok ...":
# token i of a line (base64 bytes) has rank OFFSET + i.
"$PY" - "$TMP/package/dist/ranks/o200k_base.js" "$TMP/o200k_base.tiktoken" <<'PYEOF'
import json, sys
src = open(sys.argv[1], encoding="utf-8").read()
data = json.loads(src[src.index("{"):].rstrip().rstrip(";"))
with open(sys.argv[2], "w", encoding="ascii", newline="\n") as out:
    for line in data["bpe_ranks"].split("\n"):
        fields = line.split(" ")
        if len(fields) < 2:
            continue
        offset = int(fields[1])
        for i, token in enumerate(fields[2:]):
            out.write(f"{token} {offset + i}\n")
PYEOF
GOT=$(sha256sum "$TMP/o200k_base.tiktoken" | cut -d' ' -f1)
if [ "$GOT" != "$SHA" ]; then
  echo "fetch_o200k.sh: the converted file has sha256 $GOT, expected $SHA" >&2
  exit 1
fi
mv "$TMP/o200k_base.tiktoken" "$OUT"
echo "fetch_o200k.sh: wrote $OUT"
