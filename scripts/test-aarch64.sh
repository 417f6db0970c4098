#!/usr/bin/env bash
# Runs the node's kernel and engine tests built for aarch64 Linux, under
# qemu-user emulation: the NEON kernels (node/src/engine/kernels/neon.rs) and
# everything else under cfg(target_arch = "aarch64") execute on an x86
# machine, CI included. (Apple's own OS paths are type-checked separately by
# scripts/check-macos.sh.)
#
# Needs: rustup target add aarch64-unknown-linux-gnu
#        apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user
# (.ci/run installs what is missing.)
#
# Extra arguments go to the test binary. Default: the kernel tests (every
# quantized format on NEON against the scalar reference; the test fails if
# NEON is not the path offered) and the engine tests on the tiny generated
# models, which run whole models through the NEON kernels. The tests on the
# real SmolLM2 and Gemma 3 files stay with the native run: they take minutes
# each under emulation and add no aarch64 code path.
#
# Fails when the filter selects no test: a green step that ran nothing would
# prove nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-test-model.sh
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"
export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc
export AR_aarch64_unknown_linux_gnu=aarch64-linux-gnu-ar
filters=("$@")
if [ ${#filters[@]} -eq 0 ]; then
  filters=(engine::kernels:: engine::tests::
    --skip engine::tests::smollm
    --skip engine::tests::gemma3_greedy_matches_llama_cpp
    --skip engine::tests::gemma3_tokenizer_matches_llama_cpp)
fi
log=$(mktemp)
trap 'rm -f "$log"' EXIT
cargo test --locked --target aarch64-unknown-linux-gnu -p mlx-node --lib -- "${filters[@]}" 2>&1 | tee "$log"
passed=$(sed -n 's/^test result: ok\. \([0-9]*\) passed.*/\1/p' "$log" | tail -1)
if [ -z "$passed" ] || [ "$passed" -eq 0 ]; then
  echo "test-aarch64: no test ran under qemu-aarch64" >&2
  exit 1
fi
echo "test-aarch64: $passed tests passed under qemu-aarch64"
