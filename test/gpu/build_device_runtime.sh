#!/usr/bin/env bash
# Builds the runtime library for a GPU machine that has PyTorch but no LLVM:
# libstdc++ and libgcc linked in and hidden, so it loads next to any PyTorch
# on any x86-64 glibc Linux. Usage: build_device_runtime.sh OUT_DIR
# (writes OUT_DIR/libce_runtime.so). BUILD_DIR (default build-gpu-runtime)
# may be set.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT_DIR=${1:?usage: build_device_runtime.sh OUT_DIR}
BUILD_DIR=${BUILD_DIR:-build-gpu-runtime}
cmake -S runtime -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCE_RUNTIME_BUILD_TESTS=OFF \
  "-DCMAKE_SHARED_LINKER_FLAGS=-static-libstdc++ -static-libgcc -Wl,--exclude-libs,ALL -Wl,-Bsymbolic" \
  >/dev/null
ninja -C "$BUILD_DIR" -j"${CE_JOBS:-2}" ce_runtime
mkdir -p "$OUT_DIR"
cp -L "$BUILD_DIR/libce_runtime.so" "$OUT_DIR/libce_runtime.so"
