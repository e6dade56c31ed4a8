#!/usr/bin/env bash
# Installs the wheel of scripts/build_wheel.sh into a fresh virtual environment that sees
# Debian's torch (--system-site-packages) and runs the Python tests against the installed
# package: from a copy of test/python outside the repository, without PYTHONPATH, with a
# fresh HOME and a PATH that reaches no ce-gen (issue 15, item 4). Usage:
#   scripts/test_wheel.sh [WHEEL]     (default: build/wheel/cegen-*.whl)
set -euo pipefail
cd "$(dirname "$0")/.."
WHEEL=$(realpath "${1:-$(ls build/wheel/cegen-*.whl)}")
# The tests run against the installed package: test_installed_package.py, and
# test_cross_entropy.py (numerics of every dtype, label type, layout and option through the
# public API, all from the prebuilt host bundle).
TESTS=(test_installed_package test_cross_entropy)

started=$EPOCHREALTIME
scratch=$(mktemp -d "${TMPDIR:-/tmp}/cegen-wheel-test.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
/usr/bin/python3 -m venv --system-site-packages "$scratch/venv"
"$scratch/venv/bin/python" -m pip install -q --no-index --no-deps --no-cache-dir "$WHEEL"
mkdir "$scratch/home" "$scratch/tests"
tar -C test/python --exclude=__pycache__ -cf - . | tar -C "$scratch/tests" -xf -
echo "== $(basename "$WHEEL") installed into $scratch/venv; running ${TESTS[*]} there"
(
  cd "$scratch/tests"
  env -u PYTHONPATH HOME="$scratch/home" PATH="$scratch/venv/bin:/usr/local/bin:/usr/bin:/bin" \
    CEGEN_TEST_INSTALLED=1 "$scratch/venv/bin/python" -m unittest -v "${TESTS[@]}"
)
echo "== the installed wheel passed ($(awk -v a="$started" -v b="$EPOCHREALTIME" \
  'BEGIN { printf "%.1f", b - a }') s)"
