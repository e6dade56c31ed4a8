#!/usr/bin/env bash
# Builds the cegen wheel a training node installs (docs/packaging.md), offline, with
# Debian 12's pip, setuptools and wheel:
#   1. one prebuilt kernel bundle per target (host sm_90 gfx942 gfx950 gfx90a) with
#      build/bin/ce-gen (or $CE_GEN), CE_WHEEL_JOBS targets at a time (default 2), each printing its
#      kernels, bytes on disk and generation seconds; a target whose bundle was made by
#      the same ce-gen binary and command line is reused;
#   2. the runtime built for any x86-64 glibc Linux next to any PyTorch (libstdc++ and
#      libgcc linked in and hidden: test/gpu/build_device_runtime.sh), or the library
#      named by CE_WHEEL_RUNTIME;
#   3. python/ staged with the runtime as cegen/libce_runtime.so and the bundles as
#      cegen/prebuilt-kernels/<target>/, built into a py3-none-linux_x86_64 wheel.
# Output in build/wheel/: the wheel, and kernels.json (per target: kernels, bytes on disk and
# in the wheel, seconds; the wheel's name and size). Needs scripts/build.sh to have run.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=$REPO/build/wheel
BUNDLES=$OUT/bundles
STAGE=$OUT/stage
TARGETS=(host sm_90 gfx942 gfx950 gfx90a)
JOBS=${CE_WHEEL_JOBS:-2}
PYTHON=/usr/bin/python3
export CE_GEN=${CE_GEN:-$REPO/build/bin/ce-gen} BUNDLES

if [ ! -x "$CE_GEN" ]; then
  echo "build_wheel: $CE_GEN is not built; run scripts/build.sh first" >&2
  exit 1
fi

# The kernels of every target's bundle: the one line to change for another set.
emit_bundle() {  # TARGET DIR
  "$CE_GEN" --target="$1" -o "$2" --all
}

# A bundle is reused only if this function and the ce-gen binary are unchanged.
STAMP="$(declare -f emit_bundle | sha256sum | cut -c1-16) $(stat -c '%s %Y' "$CE_GEN")"
export STAMP

# Generates TARGET's bundle into $BUNDLES/TARGET and its figures into $BUNDLES/TARGET.json.
generate_target() {
  local target=$1
  local dir=$BUNDLES/$target stats=$BUNDLES/$target.json log=$BUNDLES/$target.log
  if [ -f "$dir/manifest.json" ] && [ -f "$stats" ] \
      && [ "$(cat "$dir.stamp" 2>/dev/null)" = "$STAMP" ]; then
    echo "[$target] up to date: $(cat "$stats")"
    return 0
  fi
  rm -rf "$dir" "$dir.tmp" "$dir.stamp" "$stats"
  echo "[$target] generating"
  local start=$EPOCHREALTIME
  if ! emit_bundle "$target" "$dir.tmp" >"$log" 2>&1; then
    tail -n 30 "$log" | sed "s/^/[$target] /"
    echo "[$target] ce-gen FAILED (log: $log)"
    return 1
  fi
  local seconds kernels bytes
  seconds=$(awk -v a="$start" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
  mv "$dir.tmp" "$dir"
  kernels=$(/usr/bin/python3 -c 'import json, sys; print(len(json.load(open(sys.argv[1]))["kernels"]))' "$dir/manifest.json")
  bytes=$(find "$dir" -type f -printf '%s\n' | awk '{ s += $1 } END { print s + 0 }')
  printf '{"target": "%s", "kernels": %d, "bytes": %d, "seconds": %s}\n' \
    "$target" "$kernels" "$bytes" "$seconds" >"$stats"
  echo "$STAMP" >"$dir.stamp"
  echo "[$target] $kernels kernels, $bytes bytes, $seconds s"
}
export -f emit_bundle generate_target

mkdir -p "$BUNDLES"
rm -f "$OUT"/*.whl "$OUT/kernels.json"  # no stale wheel survives a failed build
echo "== prebuilt bundles for ${TARGETS[*]} ($JOBS at a time)"
started=$EPOCHREALTIME
printf '%s\n' "${TARGETS[@]}" | xargs -P "$JOBS" -I{} bash -c 'generate_target "$1"' _ {}
bundle_seconds=$(awk -v a="$started" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
echo "== bundles: $bundle_seconds s"

echo "== runtime"
if [ -n "${CE_WHEEL_RUNTIME:-}" ]; then
  runtime=$CE_WHEEL_RUNTIME
else
  BUILD_DIR=$OUT/runtime-build test/gpu/build_device_runtime.sh "$OUT/runtime" >/dev/null
  runtime=$OUT/runtime/libce_runtime.so
fi
if readelf -d "$runtime" | grep -E 'NEEDED.*(LLVM|MLIR)'; then
  echo "build_wheel: $runtime links LLVM or MLIR; the runtime must not" >&2
  exit 1
fi
echo "$runtime"

echo "== staging python/ with the runtime and the bundles"
rm -rf "$STAGE"
mkdir -p "$STAGE"
tar -C python --exclude=__pycache__ --exclude='*.pyc' -cf - \
  pyproject.toml setup.py README.md primus_with_cegen.py cegen | tar -C "$STAGE" -xf -
cp -L "$runtime" "$STAGE/cegen/libce_runtime.so"
strip --strip-unneeded "$STAGE/cegen/libce_runtime.so"  # the C API stays in .dynsym
mkdir "$STAGE/cegen/prebuilt-kernels"
for target in "${TARGETS[@]}"; do
  cp -r "$BUNDLES/$target" "$STAGE/cegen/prebuilt-kernels/$target"
done

echo "== wheel"
"$PYTHON" -m pip wheel --no-deps --no-build-isolation --no-index --no-cache-dir -q \
  -w "$OUT" "$STAGE"
wheel=$(ls "$OUT"/cegen-*.whl)

# What the wheel must hold, and the figures next to it.
"$PYTHON" - "$wheel" "$BUNDLES" "$bundle_seconds" "$JOBS" "$(declare -f emit_bundle | sed -n 3p)" \
  "${TARGETS[@]}" <<'EOF'
import datetime, json, os, sys, zipfile
wheel, bundles, seconds, jobs, command, targets = (sys.argv[1], sys.argv[2], sys.argv[3],
                                                   sys.argv[4], sys.argv[5], sys.argv[6:])
entries = zipfile.ZipFile(wheel).infolist()
names = {entry.filename for entry in entries}
needed = ["cegen/libce_runtime.so", "cegen/__init__.py"] + [
    f"cegen/prebuilt-kernels/{target}/manifest.json" for target in targets]
missing = [name for name in needed if name not in names]
if missing or not wheel.endswith("-py3-none-linux_x86_64.whl"):
    sys.exit(f"build_wheel: {wheel} lacks {missing} or is not py3-none-linux_x86_64")
figures = {
    "wheel": os.path.basename(wheel),
    "wheel_bytes": os.path.getsize(wheel),
    "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    "machine": f"{os.cpu_count()} cores, {jobs} targets at a time",
    "ce_gen_command": command.strip().rstrip(";"),
    "bundles_wall_seconds_this_run": float(seconds),
    "targets": [json.load(open(os.path.join(bundles, f"{target}.json"))) for target in targets],
}
for row in figures["targets"]:  # what each target adds to the wheel, compressed
    prefix = f"cegen/prebuilt-kernels/{row['target']}/"
    row["bytes_in_wheel"] = sum(e.compress_size for e in entries if e.filename.startswith(prefix))
with open(os.path.join(os.path.dirname(wheel), "kernels.json"), "w") as out:
    json.dump(figures, out, indent=1)
    out.write("\n")
print(f"{'target':8} {'kernels':>8} {'bytes':>12} {'in wheel':>12} {'seconds':>8}")
for row in figures["targets"]:
    print(f"{row['target']:8} {row['kernels']:8d} {row['bytes']:12d} {row['bytes_in_wheel']:12d} "
          f"{row['seconds']:8.1f}")
EOF
echo "== $wheel ($(stat -c %s "$wheel") bytes; figures in $OUT/kernels.json)"
echo "Install it into a virtual environment that sees Debian's torch (or one with pip's torch):"
echo "  /usr/bin/python3 -m venv --system-site-packages ~/cegen-venv"
echo "  ~/cegen-venv/bin/pip install --no-deps ${wheel#"$REPO"/}"
