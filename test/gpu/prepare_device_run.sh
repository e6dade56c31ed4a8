#!/usr/bin/env bash
# Builds, on this machine, what test/gpu/test_h200.py needs on a GPU machine
# that has PyTorch but no LLVM (so no ce-gen), under .dev/ (git-ignored):
#   .dev/lib/libce_runtime.so  the runtime; libstdc++ and libgcc linked in and
#                              hidden, so it loads next to any PyTorch on any
#                              x86-64 glibc Linux
#   .dev/bundles/{dtypes,options,overwrite}
#                              sm_90 bundles (format version 3) with the kernels
#                              of test/runtime/CMakeLists.txt's numerics bundles;
#                              option values (ignore_index, the smoothing and z-loss
#                              coefficients) are run-time arguments that each case
#                              of test_h200.py draws
# Then, on the GPU machine (the `run` tool carries .dev):
#   python3 test/gpu/test_h200.py --runtime .dev/lib/libce_runtime.so \
#     --bundles .dev/bundles/dtypes .dev/bundles/options .dev/bundles/overwrite
# CE_GEN (default build/bin/ce-gen) and BUILD_DIR (default build-gpu-runtime)
# may be set.
set -euo pipefail
cd "$(dirname "$0")/../.."
CE_GEN=${CE_GEN:-build/bin/ce-gen}
BUILD_DIR=${BUILD_DIR:-build-gpu-runtime}

test/gpu/build_device_runtime.sh .dev/lib

rm -rf .dev/bundles
mkdir -p .dev/bundles
common=(--target=sm_90 --op=forward,backward,fused --logits=bf16,f16,f32)
"$CE_GEN" "${common[@]}" -o .dev/bundles/dtypes --labels=i32,i64 \
  --layout=flat,sbv_bs,sbv_sb --label-smoothing=off --z-loss=off \
  --overwrite=0 --weights=token
"$CE_GEN" "${common[@]}" -o .dev/bundles/options --labels=i64 \
  --layout=sbv_bs --label-smoothing=off,on --z-loss=off,on --overwrite=0 \
  --weights=token
"$CE_GEN" "${common[@]}" -o .dev/bundles/overwrite --labels=i64 \
  --layout=flat,sbv_sb --label-smoothing=on --z-loss=on --overwrite=1 \
  --weights=token
echo "ce-gen: $(git log -1 --format='%h %s' -- codegen passes tools)"
du -sh .dev/lib .dev/bundles
