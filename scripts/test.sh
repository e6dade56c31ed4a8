#!/usr/bin/env bash
# Runs every cegen test: the lit suite (dialect, passes, ce-gen, codegen),
# the runtime's unit tests, the numerical tests of the generated kernels
# against a float64 reference, and the Python/Megatron integration tests,
# all through ctest; then the wheel (scripts/build_wheel.sh) installed into a
# fresh virtual environment and tested there with no compiler reachable
# (scripts/test_wheel.sh); then the runtime's tests again under AddressSanitizer
# and UndefinedBehaviorSanitizer. Exits non-zero if any test fails.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/build.sh
echo "== ctest (lit, runtime, numerics, python)"
(cd build && ctest --output-on-failure -j2)

echo "== the wheel, installed into a fresh venv and tested there without ce-gen or build/"
scripts/build_wheel.sh
scripts/test_wheel.sh

echo "== runtime and numerics tests under ASan + UBSan"
if [ ! -f build-sanitize/build.ninja ]; then
  cmake -S . -B build-sanitize -G Ninja -DCMAKE_BUILD_TYPE=Debug \
    -DCE_BUILD_COMPILER=OFF -DCE_SANITIZE=ON \
    -DCE_GEN_EXECUTABLE="$PWD/build/bin/ce-gen"
fi
ninja -C build-sanitize -j"${CE_JOBS:-2}"
(cd build-sanitize && ctest --output-on-failure -j2)
echo "== all tests passed"
