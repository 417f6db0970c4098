#!/usr/bin/env bash
# Runs the node's kernel and engine tests built for aarch64 Linux, under
# qemu-user emulation: the NEON kernels (node/src/engine/kernels/neon.rs) and
# everything else under cfg(target_arch = "aarch64") execute on an x86
# machine, CI included. (Apple's own OS paths are type-checked separately by
# scripts/check-macos.sh.)
#
# Needs: rustup target add aarch64-unknown-linux-gnu
#        apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user
# Extra arguments go to the test binary (default: the kernel tests and the
# engine tests on the tiny generated models; the SmolLM2 ones, minutes each
# under emulation, stay with the native run).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-test-model.sh
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"
export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc
export AR_aarch64_unknown_linux_gnu=aarch64-linux-gnu-ar
filters=("$@")
if [ ${#filters[@]} -eq 0 ]; then
  filters=(engine::kernels:: engine::tests:: --skip engine::tests::smollm)
fi
cargo test --locked --target aarch64-unknown-linux-gnu -p mlx-node --lib -- "${filters[@]}"
