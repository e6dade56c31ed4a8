#!/usr/bin/env bash
# cegen quick start on a fresh Debian 12 machine: installs the Debian
# packages, configures and builds everything, emits a host kernel bundle with
# ce-gen and runs one forward and backward on random data through the runtime;
# then builds the wheel (runtime + prebuilt kernels for every target,
# scripts/build_wheel.sh) and prints how to pip install it.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
PACKAGES=(
  cmake ninja-build g++ git
  llvm-22-dev llvm-22-tools libmlir-22-dev mlir-22-tools lld-22
  googletest libgtest-dev libgmock-dev
  python3-torch python3-yaml python3-numpy
  python3-pip python3-setuptools python3-wheel python3-venv
)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "== installing: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi

scripts/build.sh

echo "== emitting a host bundle (forward + backward, bf16 logits [S,B,V], labels [B,S])"
rm -rf build/quickstart-bundle
build/bin/ce-gen --target=host --op=forward,backward --logits=bf16 \
  --labels=i64 --layout=sbv_bs -o build/quickstart-bundle
echo "== running one forward and backward through libce_runtime"
build/bin/ce-demo build/quickstart-bundle 16 4 32000

echo "== building the wheel: the runtime and prebuilt kernels for every target"
scripts/build_wheel.sh
