#!/usr/bin/env bash
# Builds, on this machine, what test/gpu/titan_primus_h200.py needs on the GPU machine, under
# .dev/gpu20 (git-ignored; the `run` tool carries it with carry=[".dev/gpu20"]):
#   titan/torchtitan     TorchTitan v0.2.2 (the version Primus pins), from a pytorch/torchtitan git dir
#   megatron/megatron    Megatron-LM d98e8a6's megatron/core, from an NVIDIA/Megatron-LM git dir
#   primus/primus        Primus fd1eeab's primus package, from an AMD-AGI/Primus git dir
#   lib/libce_runtime.so the runtime (build_device_runtime.sh, or RUNTIME=path copied)
#   bundle-titan         sm_90: [B, S, V] logits read as [S, B, V] with "sb" labels (and flat),
#                        bf16/f32, int64 labels, overwrite off and on (ignore index -100 is a
#                        run-time argument since bundle format version 3)
#   bundle-megatron      sm_90: Megatron's [S, B, V] logits with [B, S] labels, bf16/f32,
#                        int64 labels, overwrite off and on
# Usage: prepare_titan_primus_run.sh TORCHTITAN_GIT_DIR MEGATRON_GIT_DIR PRIMUS_GIT_DIR
# Then, on the GPU machine:
#   python3 test/gpu/titan_primus_h200.py --src .dev/gpu20 --out $OUT/titan_primus.json
set -euo pipefail
TITAN_GIT=${1:?usage: prepare_titan_primus_run.sh TORCHTITAN_GIT MEGATRON_GIT PRIMUS_GIT}
MEGATRON_GIT=${2:?megatron git dir}
PRIMUS_GIT=${3:?primus git dir}
cd "$(dirname "$0")/../.."
CE_GEN=${CE_GEN:-build/bin/ce-gen}
OUT=.dev/gpu20
rm -rf "$OUT"
mkdir -p "$OUT/titan" "$OUT/megatron" "$OUT/primus"
git --git-dir="$TITAN_GIT" archive v0.2.2 torchtitan | tar -x -C "$OUT/titan"
git --git-dir="$MEGATRON_GIT" archive d98e8a6 megatron/core | tar -x -C "$OUT/megatron"
git --git-dir="$PRIMUS_GIT" archive fd1eeab primus | tar -x -C "$OUT/primus"
if [[ -n "${RUNTIME:-}" ]]; then  # a libce_runtime.so built elsewhere (GLIBC <= the GPU machine's)
  mkdir -p "$OUT/lib" && cp -L "$RUNTIME" "$OUT/lib/libce_runtime.so"
else
  test/gpu/build_device_runtime.sh "$OUT/lib"
fi
"$CE_GEN" --target=sm_90 --op=forward,backward --logits=bf16,f32 --labels=i64 \
  --layout=sbv_sb,flat --label-smoothing=off --z-loss=off --overwrite=0,1 \
  -o "$OUT/bundle-titan"
"$CE_GEN" --target=sm_90 --op=forward,backward --logits=bf16,f32 --labels=i64 \
  --layout=sbv_bs --overwrite=0,1 -o "$OUT/bundle-megatron"
du -sh "$OUT"/*
