#!/usr/bin/env bash
# Builds llama.cpp's HTTP server (`llama-server`), the peer of the batching
# bench (tests/benches/batching.rs), from the llama.cpp source that the PyPI
# package llama-cpp-python 0.3.36 vendors: the same llama.cpp as the
# project's other reference figures.
#
#   scripts/build-llama-server.sh [OUT_DIR]     (default: target/llama-server)
#
# Prints the path of the binary. Nothing is committed: the sdist, the
# unpacked source and the build stay under OUT_DIR (git-ignored). Needs pip,
# a C++ compiler and cmake (taken from PyPI into OUT_DIR/venv when absent).
#
# The AMX flags: on CPUs that advertise AMX but do not allow it (some VMs),
# ggml's AMX code dies with SIGILL; building without it avoids that.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36
OUT=${1:-target/llama-server}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
BIN="$OUT/build/bin/llama-server"
if [[ -x "$BIN" ]]; then
  echo "$BIN"
  exit 0
fi
if ! command -v cmake >/dev/null 2>&1; then
  if [[ ! -x "$OUT/venv/bin/cmake" ]]; then
    python3 -m venv "$OUT/venv"
    "$OUT/venv/bin/pip" install --quiet cmake >&2
  fi
  export PATH="$OUT/venv/bin:$PATH"
fi
SRC="$OUT/llama_cpp_python-$VERSION/vendor/llama.cpp"
if [[ ! -d "$SRC" ]]; then
  # Only this package from source: with `--no-binary :all:` pip would also
  # build its build tools (cmake itself) from source to read its metadata.
  pip download --quiet --no-binary llama-cpp-python --no-deps "llama-cpp-python==$VERSION" -d "$OUT/sdist" >&2
  tar -xzf "$OUT/sdist/llama_cpp_python-$VERSION.tar.gz" -C "$OUT"
fi
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
cmake -S "$SRC" -B "$OUT/build" -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DGGML_NATIVE=ON \
  -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" >&2
cmake --build "$OUT/build" --target llama-server -j "$(nproc)" >&2
echo "$BIN"
