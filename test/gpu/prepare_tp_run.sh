#!/usr/bin/env bash
# Builds, on this machine, what test/gpu/tp_h200.py needs on a two-GPU
# machine without LLVM, under .dev/tp (git-ignored): the runtime library and
# sm_90 bundles with the shard kernels (smoothing over the slice and over the
# global vocabulary; a slice's bounds are run-time arguments since bundle
# format version 3, so they serve every rank and V), and the single-GPU
# kernels the TP=1 comparison uses. Then, on the GPU machine (the `run` tool carries .dev/tp and
# .dev/megatron):
#   python3 test/gpu/tp_h200.py --runtime .dev/tp/lib/libce_runtime.so \
#     --bundles .dev/tp/bundles/shards .dev/tp/bundles/whole \
#     --megatron .dev/megatron --out $OUT
set -euo pipefail
cd "$(dirname "$0")/../.."
CE_GEN=${CE_GEN:-build/bin/ce-gen}
test/gpu/build_device_runtime.sh .dev/tp/lib
rm -rf .dev/tp/bundles
common=(--target=sm_90 --logits=bf16,f32 --labels=i64 --layout=sbv_bs
  --label-smoothing=off,on --z-loss=off,on)
"$CE_GEN" "${common[@]}" -o .dev/tp/bundles/shards --op=shard_stats,backward \
  --overwrite=0,1 --shard=local,global
"$CE_GEN" "${common[@]}" -o .dev/tp/bundles/whole --op=forward,backward,fused \
  --overwrite=0,1 --weights=scalar,token
echo "ce-gen: $(git log -1 --format='%h %s' -- codegen passes tools)"
du -sh .dev/tp/lib .dev/tp/bundles/*
