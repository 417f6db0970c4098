#!/usr/bin/env bash
# Type-checks the Mac build of mlx-node on Linux (no Mac needed, nothing is linked).
#
# Needs: `rustup target add aarch64-apple-darwin` and clang (apt-get install clang).
# Build scripts that compile C for the target (ring, under rustls/quinn) get a
# freestanding clang and three stub headers standing in for the macOS SDK's;
# the objects are never linked, so this only lets rustc check the Rust code,
# including everything behind cfg(target_os = "macos") and the metal feature.
set -euo pipefail
cd "$(dirname "$0")/.."
stubs=$(mktemp -d)
trap 'rm -rf "$stubs"' EXIT
cat >"$stubs/TargetConditionals.h" <<'H'
#pragma once
#define TARGET_OS_OSX 1
#define TARGET_OS_MAC 1
#define TARGET_OS_IPHONE 0
#define TARGET_OS_IOS 0
#define TARGET_OS_WATCH 0
#define TARGET_OS_TV 0
#define TARGET_OS_SIMULATOR 0
H
cat >"$stubs/assert.h" <<'H'
#pragma once
#define assert(x) ((void)0)
H
cat >"$stubs/string.h" <<'H'
#pragma once
#include <stddef.h>
void *memcpy(void *, const void *, size_t);
void *memset(void *, int, size_t);
int memcmp(const void *, const void *, size_t);
void *memmove(void *, const void *, size_t);
H
export CC_aarch64_apple_darwin=clang
export CFLAGS_aarch64_apple_darwin="-ffreestanding -nostdinc -isystem $(clang -print-resource-dir)/include -I$stubs"
cargo check --locked --target aarch64-apple-darwin -p mlx-node "$@"
