#!/usr/bin/env bash
# Makes the Python venv the OpenAI-API tests drive: the official `openai`
# client from PyPI, pinned, and `jsonschema` (validates structured output).
# Idempotent: a venv that already has these versions is left as it is.
#   scripts/openai-venv.sh [DIR]   (default: .venv-openai at the repo root,
#                                   or $MLXNET_OPENAI_VENV)
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-${MLXNET_OPENAI_VENV:-$PWD/.venv-openai}}"
pins=(openai==3.57.0 jsonschema==4.26.0)
if [ -x "$dir/bin/python" ] && "$dir/bin/python" - "${pins[@]}" <<'PY' 2>/dev/null
import sys, importlib.metadata as m
for pin in sys.argv[1:]:
    name, version = pin.split("==")
    assert m.version(name) == version, pin
PY
then
  echo "$dir"
  exit 0
fi
python3 -m venv "$dir" >&2
"$dir/bin/python" -m pip install --quiet --disable-pip-version-check "${pins[@]}" >&2
echo "$dir"
