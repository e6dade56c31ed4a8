#!/usr/bin/env bash
# Builds, on this machine (which has ce-gen), what bench/megatron_step.py needs on a GPU
# machine without LLVM or internet, under .dev/mstep (git-ignored; the `run` tool carries it
# with carry=[".dev/mstep"], about 13 MB):
#   megatron/megatron/core  Megatron-LM d98e8a6's megatron/core (Megatron-Core 0.20.0), never
#                           committed: from a Megatron-LM git dir (git archive), or copied from
#                           a folder that already holds megatron/core
#   lib/libce_runtime.so    the runtime (build_device_runtime.sh; RUNTIME=path copies a built one)
#   bundles/loss            sm_90 kernels of the Megatron patch at TP = 1: forward, backward and
#                           fused, bf16 logits, int64 labels, Megatron's [S, B, V] logits with
#                           [B, S] labels, overwrite off and on, per-token weights (a scalar
#                           grad_weights is a token weight of stride 0); Megatron's label policy
#                           and TE's ignore index are run-time arguments
#   bundles/rescale         the fused gradient's device rescale, where ce-gen has that op
#   python/cegen            with PYTHON_FROM=<commit> only: the cegen package of that commit
#                           (run the bench with --python .dev/mstep/python to use it rather
#                           than the checkout's python/, e.g. while python/ is being edited)
#   SOURCE.txt              the cegen commit these were built from (bench/megatron_step.py
#                           prints it)
# Usage: prepare_megatron_step_run.sh MEGATRON_GIT_DIR_OR_SOURCE
# Then, on the GPU machine:
#   python3 bench/megatron_step.py --src .dev/mstep --out $OUT/megatron_step
set -euo pipefail
MEGATRON=${1:?usage: prepare_megatron_step_run.sh MEGATRON_GIT_DIR_OR_SOURCE}
MEGATRON_COMMIT=${MEGATRON_COMMIT:-d98e8a6}
cd "$(dirname "$0")/../.."
CE_GEN=${CE_GEN:-build/bin/ce-gen}
OUT=.dev/mstep
rm -rf "$OUT"
mkdir -p "$OUT/megatron" "$OUT/lib" "$OUT/bundles"
if [[ -d "$MEGATRON/megatron/core" ]]; then
  cp -r "$MEGATRON/megatron" "$OUT/megatron/"
else
  git --git-dir="$MEGATRON" archive "$MEGATRON_COMMIT" megatron/core | tar -x -C "$OUT/megatron"
fi
if [[ -n "${RUNTIME:-}" ]]; then  # a libce_runtime.so built elsewhere (GLIBC <= the GPU machine's)
  cp -L "$RUNTIME" "$OUT/lib/libce_runtime.so"
else
  test/gpu/build_device_runtime.sh "$OUT/lib"
fi
common=(--target=sm_90 --logits=bf16 --labels=i64 --layout=sbv_bs --label-smoothing=off
  --z-loss=off)
"$CE_GEN" "${common[@]}" --op=forward,backward,fused --overwrite=0,1 --weights=token \
  -o "$OUT/bundles/loss"
if "$CE_GEN" "${common[@]}" --op=rescale -o "$OUT/bundles/rescale" 2>/dev/null; then
  echo "ce-gen: rescale kernels in $OUT/bundles/rescale"
else
  rm -rf "$OUT/bundles/rescale"
  echo "ce-gen: no rescale op (the fused gradient's rescale runs as PyTorch operations)"
fi
if [[ -n "${PYTHON_FROM:-}" ]]; then
  git archive "$PYTHON_FROM" python/cegen | tar -x -C "$OUT"
  echo "python/cegen of $(git log -1 --format=%h "$PYTHON_FROM") in $OUT/python"
fi
dirty=$(git status --porcelain -- python runtime codegen passes dialect tools | wc -l)
echo "$(git log -1 --format='%h %cd' --date=format:'%Y-%m-%d %H:%M') (+${dirty} changed files" \
  "in python/runtime/codegen/passes/dialect/tools); ce-gen $(stat -c '%y' "$CE_GEN" | cut -c1-16)" \
  > "$OUT/SOURCE.txt"
cat "$OUT/SOURCE.txt"
du -sh "$OUT"/*
