#!/usr/bin/env bash
# Builds, on this machine, the sm_90 bundles that test/gpu/sanitize_h200.py runs under
# compute-sanitizer on a GPU machine without LLVM: every kernel kind (forward, backward,
# fused, shard_stats) with odd-V- and view-capable variants, overwrite on and off, per-token
# weights (a scalar weight is one of stride 0), with and without label smoothing, bf16 and f32 logits (bundle format
# version 3: option values are run-time arguments, drawn by the script). Usage:
#   prepare_sanitize_run.sh DIR         bundles into DIR/{kinds,plain,shards,slices}
# and, unless NO_RUNTIME=1, the runtime library into DIR/lib (build_device_runtime.sh).
# CE_GEN (default build/bin/ce-gen) may be set, e.g. to an older ce-gen for a before/after
# comparison. Then, on the GPU machine (the `run` tool carries DIR):
#   python3 test/gpu/sanitize_h200.py --runtime DIR/lib/libce_runtime.so \
#     --bundles DIR/kinds DIR/plain DIR/softcap --shard-bundles DIR/shards DIR/slices --out $OUT
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=${1:?usage: prepare_sanitize_run.sh DIR}
CE_GEN=${CE_GEN:-build/bin/ce-gen}
if [ "${NO_RUNTIME:-0}" != 1 ]; then
  test/gpu/build_device_runtime.sh "$DIR/lib"
fi
rm -rf "$DIR/kinds" "$DIR/plain" "$DIR/softcap" "$DIR/shards" "$DIR/slices"
mkdir -p "$DIR"
# Every op with smoothing (three reductions per row) and z-loss, flat and [S,B,V] rows,
# overwrite on and off.
"$CE_GEN" --target=sm_90 -o "$DIR/kinds" --op=forward,backward,fused --logits=bf16,f32 \
  --labels=i64 --layout=flat,sbv_sb --label-smoothing=on --z-loss=on --overwrite=0,1 \
  --weights=token
# The plain kernels (no smoothing: two reductions per row), among them the fused bf16
# token-weights kernel of issue 23, item 13.
"$CE_GEN" --target=sm_90 -o "$DIR/plain" --op=forward,backward,fused --logits=bf16 \
  --labels=i64 --layout=flat --label-smoothing=off --z-loss=off --overwrite=0 --weights=token
# The logit-softcap kernels (z from an exp2 and an approximate reciprocal; the cap a run-time
# argument): every op, overwrite on and off, bf16 and f32 logits, flat and [S,B,V] rows.
"$CE_GEN" --target=sm_90 -o "$DIR/softcap" --op=forward,backward,fused --logits=bf16,f32 \
  --labels=i64 --layout=flat,sbv_bs --label-smoothing=off --z-loss=off --overwrite=0,1 \
  --weights=token --softcap=on
# Vocabulary-parallel statistics (sanitize_h200.py runs slices at 0 and at 1000 of a
# 300000-entry vocabulary, smoothing over the slice and over the global vocabulary: the bounds
# and the smoothing flag are run-time arguments since bundle format version 3).
"$CE_GEN" --target=sm_90 -o "$DIR/shards" --op=shard_stats --logits=bf16,f32 --labels=i64 \
  --layout=flat,sbv_bs --label-smoothing=off,on --softcap=off,on
# Backward kernels that sanitize_h200.py runs on slices (every backward takes one; an
# unsharded call is the slice [0, V) of V).
"$CE_GEN" --target=sm_90 -o "$DIR/slices" --op=backward --logits=bf16,f32 --labels=i64 \
  --layout=flat,sbv_bs --label-smoothing=on --z-loss=off,on --overwrite=0,1
echo "ce-gen: $CE_GEN ($(git log -1 --format='%h %s' -- codegen passes tools | cut -c1-100))"
du -sh "$DIR"/*
