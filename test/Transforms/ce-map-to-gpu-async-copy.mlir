// RUN: ce-opt %s --pass-pipeline='builtin.module(gpu.module(ce-map-to-gpu{target=nvvm block-size=64 subgroup-size=32 unroll=2 async-copy=1},canonicalize,cse))' | FileCheck %s --check-prefix=NVVM
// RUN: ce-opt %s --pass-pipeline='builtin.module(gpu.module(ce-map-to-gpu{target=rocdl block-size=64 subgroup-size=64 unroll=2},canonicalize,cse))' | FileCheck %s --check-prefix=ROCDL

// Asynchronous copies (the TargetInfo feature `hasAsyncCopy`): on nvvm the
// fused kernel's row cache is filled by cp.async copies in groups, one per
// cached chunk, waited for chunk by chunk, and the uncached rest of the row
// is prefetched into L2; rocdl has none (the statistics sweep stores the
// cached chunks itself). The packed maximum and the stream ring have tests
// of their own (ce-map-to-gpu-packed-max.mlir, -stream-ring.mlir).

// NVVM-LABEL: gpu.func @fused
// NVVM: nvgpu.device_async_copy %{{.*}}, %{{.*}}, 8 {bypassL1}
// NVVM: nvgpu.device_async_create_group
// NVVM: nvvm.cp.async.bulk.prefetch
// NVVM: nvgpu.device_async_wait %{{.*}} {numGroups = 3 : i32}
// NVVM: nvgpu.device_async_wait %{{.*}}{{$}}

// ROCDL-LABEL: gpu.func @fused
// ROCDL-NOT: nvgpu.
// ROCDL-NOT: nvvm.
// ROCDL: gpu.return

gpu.module @kernels {
  gpu.func @fused(%x: memref<?x?xbf16, #gpu.address_space<global>>, %y: memref<?xi64, #gpu.address_space<global>>, %w: memref<?xf32, #gpu.address_space<global>>, %loss: memref<?xf32, #gpu.address_space<global>>, %lse: memref<?xf32, #gpu.address_space<global>>) kernel attributes {ce.tuning = #ce.tuning<block_size = 64, unroll = 2, row_cache_bytes = 4096>} {
    ce.fused %x, %y, %w into %loss, %lse, %x layout = flat {overwrite_input} : memref<?x?xbf16, #gpu.address_space<global>>, memref<?xi64, #gpu.address_space<global>>, memref<?xf32, #gpu.address_space<global>> into memref<?xf32, #gpu.address_space<global>>, memref<?xf32, #gpu.address_space<global>>, memref<?x?xbf16, #gpu.address_space<global>>
    gpu.return
  }
}
