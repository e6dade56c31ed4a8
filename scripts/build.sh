#!/usr/bin/env bash
# Configures (once) and builds the compiler, the runtime and the tests in
# build/. Used by quickstart.sh and test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -f build/build.ninja ]; then
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DLLVM_EXTERNAL_LIT=/usr/lib/llvm-22/bin/lit
fi
ninja -C build -j"${CE_JOBS:-2}"
