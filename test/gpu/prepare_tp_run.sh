#!/usr/bin/env bash
# Builds, on this machine, what test/gpu/tp_h200.py needs on a two-GPU
# machine without LLVM, under .dev/tp (git-ignored): the runtime library and
# sm_90 bundles with the shard_stats kernels and the forward, backward and
# fused kernels (a slice's bounds and whether it smooths over the slice or the
# global vocabulary are run-time arguments since bundle format version 3, so
# one kernel serves every rank and V, and every backward takes a slice: the
# sharded backward and the TP=1 comparison's are the same kernels). Then, on the GPU machine (the `run` tool carries .dev/tp and
# .dev/megatron):
#   python3 test/gpu/tp_h200.py --runtime .dev/tp/lib/libce_runtime.so \
#     --bundles .dev/tp/bundles/shards .dev/tp/bundles/whole \
#     --megatron .dev/megatron --out $OUT
# and test/gpu/tp_runs_h200.py (issue 21's runs) with --bundles .dev/tp/bundles/*.
set -euo pipefail
cd "$(dirname "$0")/../.."
CE_GEN=${CE_GEN:-build/bin/ce-gen}
test/gpu/build_device_runtime.sh .dev/tp/lib
rm -rf .dev/tp/bundles
# flat: linear cross entropy's chunks of [N, H] hidden states (tp_runs_h200.py); the softcap
# kernels (a compile-time variant) for its outputs-and-softcap checks.
common=(--target=sm_90 --logits=bf16,f32 --labels=i64 --layout=flat,sbv_bs
  --label-smoothing=off,on --z-loss=off,on)
"$CE_GEN" "${common[@]}" -o .dev/tp/bundles/shards --op=shard_stats
"$CE_GEN" "${common[@]}" -o .dev/tp/bundles/whole --op=forward,backward,fused \
  --overwrite=0,1 --weights=token
"$CE_GEN" --target=sm_90 --logits=bf16,f32 --labels=i64 --layout=flat,sbv_bs \
  --label-smoothing=off --z-loss=off --softcap=on -o .dev/tp/bundles/softcap \
  --op=shard_stats,forward,backward,fused --overwrite=0,1 --weights=token
# linear cross entropy's rescale of d hidden and d weight on the device
"$CE_GEN" --target=sm_90 --logits=bf16,f32 --layout=flat,sbv_bs --op=rescale \
  -o .dev/tp/bundles/rescale
echo "ce-gen: $(git log -1 --format='%h %s' -- codegen passes tools)"
du -sh .dev/tp/lib .dev/tp/bundles/*
