#!/usr/bin/env bash
# Runs the randomized tests with many fresh seeds, to find the rare input that fails a
# tolerance or a kernel before a CI run (one seed per stop) trips on it:
# runtime_numerics_test (CE_TEST_SEED) and the Python suite (its seed is the time in ms).
# Needs a built tree (scripts/build.sh) whose numerics bundles ctest has made once.
# Prints one line per run and, for a failing run, its FAIL lines and the seed to replay:
#   CE_TEST_SEED=S build/bin/runtime_numerics_test DIRS...   (the line printed says which)
#   FIXED_SEED = S in test/python/_support.py, then python3 -m unittest discover ...
# Usage: scripts/seed_hunt.sh [RUNS] [numerics|python|both]   (default 10 both)
set -uo pipefail
cd "$(dirname "$0")/.."
runs=${1:-10}
which=${2:-both}
bundles=build/test/runtime/numerics-bundles
failed=0
if [ "$which" != python ]; then
  if [ ! -d "$bundles/dtypes" ]; then
    (cd build && ctest -R runtime_numerics_bundle >/dev/null) || exit 2
  fi
  for i in $(seq 1 "$runs"); do
    seed=$(od -An -N8 -tu8 /dev/urandom | tr -d ' ')
    out=$(CE_TEST_SEED=$seed build/bin/runtime_numerics_test "$bundles/dtypes" \
      "$bundles/options" "$bundles/overwrite" "$bundles/softcap" 2>&1)
    rc=$?
    echo "numerics $i/$runs: rc=$rc $(echo "$out" | tail -1)"
    if [ $rc -ne 0 ]; then
      failed=$((failed + 1))
      echo "$out" | grep "FAIL" | head -10
      echo "replay: CE_TEST_SEED=$seed build/bin/runtime_numerics_test $bundles/{dtypes,options,overwrite,softcap}"
    fi
  done
fi
if [ "$which" != numerics ]; then
  for i in $(seq 1 "$runs"); do
    out=$(/usr/bin/python3 -m unittest discover -s test/python -t test/python 2>&1)
    rc=$?
    echo "python $i/$runs: rc=$rc $(echo "$out" | grep -m1 'seed=') $(echo "$out" | tail -1)"
    if [ $rc -ne 0 ]; then
      failed=$((failed + 1))
      echo "$out" | grep -A12 "^FAIL:\|^ERROR:" | head -40
    fi
    sleep 1  # the next run's seed is the time in ms
  done
fi
echo "$failed failing runs"
[ "$failed" -eq 0 ]
