#!/usr/bin/env bash
# Builds, on this machine (which has ce-gen), what test/gpu/test_graphs_compile.py and
# bench/api_bench.py need on a GPU machine without LLVM, under .dev/ (git-ignored):
#   .dev/lib/libce_runtime.so   the runtime (test/gpu/build_device_runtime.sh)
#   .dev/api/bundles/api        sm_90 forward/backward/fused and rescale, bf16 logits, int64 labels,
#                               [N,V] and [S,B,V] (Megatron's), no smoothing or z-loss,
#                               overwrite 0/1, per-token weights (a scalar weight is one of
#                               stride 0; ignore_index is a run-time argument since bundle
#                               format version 3)
#   .dev/api/bundles/rescale    sm_90 rescale kernels, every logits dtype and layout
#   .dev/api/bundles/shard      shard_stats of a vocabulary slice (a slice's bounds and how it
#                               smooths are run-time arguments; its backward is api's backward,
#                               which takes every slice)
#   .dev/peers                  flash-attention's and Liger's cross-entropy sources, copied
#                               from .dev/peers-amd when that holds them (bench/peers.py's
#                               layout; docs/PERFORMANCE.md says how to fetch them otherwise)
# Then, on the GPU machine (the `run` tool carrying .dev/lib, .dev/api, .dev/peers):
#   python3 test/gpu/test_graphs_compile.py --runtime .dev/lib/libce_runtime.so \
#     --bundles .dev/api/bundles/api .dev/api/bundles/shard --out $OUT/graphs
#   python3 bench/api_bench.py --runtime .dev/lib/libce_runtime.so \
#     --bundle .dev/api/bundles/api --peers .dev/peers --out $OUT/api
set -euo pipefail
cd "$(dirname "$0")/../.."
CE_GEN=${CE_GEN:-build/bin/ce-gen}
test/gpu/build_device_runtime.sh .dev/lib
rm -rf .dev/api/bundles
mkdir -p .dev/api/bundles
common=(--target=sm_90 --logits=bf16 --labels=i64 --label-smoothing=off --z-loss=off)
"$CE_GEN" "${common[@]}" -o .dev/api/bundles/api --op=forward,backward,fused,rescale \
  --layout=flat,sbv_bs --overwrite=0,1 --weights=token
"$CE_GEN" "${common[@]}" -o .dev/api/bundles/shard --op=shard_stats --layout=flat
# Every rescale kernel (bench/rescale_bench.py's float64 checks of each dtype and layout).
"$CE_GEN" --target=sm_90 -o .dev/api/bundles/rescale --op=rescale --logits=bf16,f16,f32 \
  --layout=flat,sbv_bs,sbv_sb
if [ ! -d .dev/peers ] && [ -d .dev/peers-amd/flash_attn ] && [ -d .dev/peers-amd/liger_kernel ]; then
  mkdir -p .dev/peers
  cp -r .dev/peers-amd/flash_attn .dev/peers-amd/liger_kernel .dev/peers/
  [ -f .dev/peers-amd/SOURCES.md ] && cp .dev/peers-amd/SOURCES.md .dev/peers/
fi
echo "ce-gen: $(git log -1 --format='%h %s' -- codegen passes tools)"
du -sh .dev/lib .dev/api/bundles/* .dev/peers 2>/dev/null || true
